"""The registry helper (fxdp.registry.TypeRegistry): registration by type, lookup along the MRO, snapshots.
The public batch-rule registration: tests/passes/batch_rules/test_registration.py."""

import re

import pytest
import torch
from torch import nn

import fxdp
from fxdp.registry import TypeRegistry, find_in


# --------------------------------------------------------------------------------------------
# TypeRegistry
# --------------------------------------------------------------------------------------------


class Base:
    pass


class Child(Base):
    pass


class GrandChild(Child):
    pass


def test_register_accepts_a_type_or_a_collection_and_lookup_walks_the_mro():
    registry = TypeRegistry()
    registry.register(Base)("base rule")
    assert registry.find(GrandChild()) == "base rule"  # an instance
    assert registry.find(Child) == "base rule"  # a class
    assert registry.owner(GrandChild) is Base
    registry.register([Child, int])("child rule")
    assert registry.find(GrandChild) == "child rule" and registry.find(3) == "child rule"
    assert registry.find(Base()) == "base rule"
    assert registry.find("text") is None and registry.owner(str) is None


def test_the_last_registration_wins_and_snapshots_restore():
    registry = TypeRegistry()
    registry.register((Base,))("first")
    saved = registry.snapshot()
    registry.register({Base})("second")
    assert registry.find(Child) == "second"
    registry.restore(saved)
    assert registry.find(Child) == "first"


def test_a_base_class_restricts_what_may_be_registered():
    registry = TypeRegistry(nn.Module, "only modules, got {!r}")
    with pytest.raises(TypeError, match=re.escape("only modules, got <class 'int'>")):
        registry.register([nn.Linear, int])
    with pytest.raises(TypeError, match="only modules"):
        registry.register("nn.Linear")
    assert registry.find(nn.Linear) is None  # nothing of a refused registration is kept


def test_find_in_prefers_the_most_specific_class_then_the_first_registry():
    own, parent = TypeRegistry(), TypeRegistry()
    parent.register(Child)("parent's child rule")
    own.register(Base)("own base rule")
    parent.register(GrandChild)("parent's grandchild rule")
    own.register(GrandChild)("own grandchild rule")
    assert find_in([own, parent], GrandChild) == "own grandchild rule"
    assert find_in([own, parent], Child) == "parent's child rule"  # more specific beats own registry
    assert find_in([own, parent], Base) == "own base rule"


def test_a_lookup_is_remembered_only_until_the_registrations_change():
    """find() remembers its answer per class; any change to the registrations (register, restore, the dict
    edited directly as tests do) is seen by the next lookup."""
    registry = TypeRegistry(unless_overridden="forward")
    registry.register(Base)("base rule")
    assert registry.find(GrandChild) == "base rule"
    registry.register(Child)("child rule")  # more specific, after the first lookup
    assert registry.find(GrandChild()) == "child rule"
    saved = registry.snapshot()
    registry.entries[Child] = "edited rule"
    assert registry.find(GrandChild) == "edited rule"
    del registry.entries[Child]
    assert registry.find(GrandChild) == "base rule"
    registry.entries.pop(Base)
    assert registry.find(GrandChild) is None
    registry.restore(saved)
    assert registry.find(GrandChild) == "child rule"


def test_an_instance_that_replaced_the_method_is_not_answered_from_its_class():
    class Layer(nn.Linear):
        pass

    registry = TypeRegistry(unless_overridden="forward")
    registry.register(nn.Linear)("linear rule")
    plain, patched = Layer(2, 2), Layer(2, 2)
    assert registry.find(plain) == "linear rule"
    patched.forward = lambda x: 2 * x
    assert registry.find(patched) is None
    assert registry.find(plain) == "linear rule"


def test_a_class_whose_method_is_replaced_after_a_lookup_is_looked_up_again():
    class Layer(nn.Linear):
        pass

    class Deeper(Layer):
        pass

    registry = TypeRegistry(unless_overridden="forward")
    registry.register(nn.Linear)("linear rule")
    assert registry.find(Deeper(2, 2)) == "linear rule" and registry.find(Layer) == "linear rule"
    Layer.forward = lambda self, x: 2 * x  # now computes something else: the Linear rule no longer applies
    assert registry.find(Deeper(2, 2)) is None and registry.find(Layer) is None
    del Layer.forward
    assert registry.find(Deeper) == "linear rule"


def test_grad_sampler_registry_keeps_its_type_check():
    with pytest.raises(TypeError, match="register_grad_sampler expects nn.Module subclasses"):
        fxdp.register_grad_sampler(torch.Tensor)

"""How an engine that cannot see the model's code checks it on a real batch.

The hooks engine (the fallback for a model torch.fx cannot trace) assumes that every sample's
computation reads only that sample's data, and that the batch sits at the same dimension everywhere.
It cannot read the model's code, so it tests the model once, on its first batch of two samples or
more, before that batch's forward:

- :func:`cross_sample_dependence`: perturb one sample's input and check that every other sample's
  output is unchanged (same random seed for both runs, buffers restored afterwards);
- the engine's per-sample gradients on a few samples against the gradients of each sample run alone
  (:func:`batch_of_one_gradients`, the definition, which :mod:`fxdp.checker` compares with too;
  :func:`compare_gradients`).

What the tests find is raised as an fxdp error (:class:`~fxdp.errors.SampleMixingError`,
:class:`~fxdp.errors.SelfCheckError`). When the cross-sample test cannot run (no input to perturb, outputs
without the batch, a model that is random under a fixed seed), the model is *unverified*
(:class:`Untested` says why and what to do) and the engine refuses it, strict or not
(:class:`~fxdp.errors.UnverifiedModelError`): per-sample gradients that were not checked are never handed
out. A model that is random only across seeds (functional dropout) passes the cross-sample test under a
fixed seed and is verified without the comparison with batches of one, which a random model cannot pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence
from torch.utils import _pytree as pytree

from fxdp.diagnostics import Finding, Kind, Severity
from fxdp.diagnostics.source import SourceLocation, is_library_file

PASS_NAME = "self-check"


def finding(node: str, op: str, kind: Kind, message: str, fix: str,
            location: Optional[SourceLocation] = None) -> Finding:
    return Finding(PASS_NAME, node, op, kind, Severity.ERROR, message, fix, location)


def forward_location(model: nn.Module) -> Optional[SourceLocation]:
    """Where the user's model defines ``forward`` (the code a finding about the whole model points at), or None
    for a model of torch's (or fxdp's) own."""
    forward = getattr(type(model), "forward", None)
    try:
        forward = inspect.unwrap(forward)  # through decorators (transformers' can_return_tuple, ...)
        file = inspect.getsourcefile(forward)
        lines, line = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        return None
    if file is None or is_library_file(file):
        return None
    return SourceLocation(file, line, f"{type(model).__name__}.forward", lines[0].strip() if lines else "")


def batch_size_of(args: Sequence[Any], kwargs: Dict[str, Any], batch_dim: int) -> Optional[int]:
    """The size of the first tensor input (positional first) at ``batch_dim``, or None."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, PackedSequence):  # its rows are time steps; the first holds every sample
            return int(a.batch_sizes[0])
    for t in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
            return t.shape[batch_dim]
    return None


@dataclasses.dataclass(frozen=True)
class Bags:
    """A batch of bags, the classic text classifier's ``EmbeddingBag(ids, offsets)``: the positional input
    ``ids`` (1-D) holds the samples' indices one after another, ``offsets`` where each sample's start (and, with
    ``include_last``, where the last one ends). One bag is one sample; other inputs with a row per bag at
    the batch dimension are batched as usual."""

    ids: int
    offsets: int
    include_last: bool

    def count(self, args) -> int:
        return max(args[self.offsets].shape[0] - int(self.include_last), 0)

    def entries(self, args) -> List[torch.Tensor]:
        starts = args[self.offsets].tolist()
        ends = starts[1:] if self.include_last else starts[1:] + [args[self.ids].shape[0]]
        return [args[self.ids][a:b] for a, b in zip(starts[:self.count(args)], ends)]

    def with_entries(self, args, bags: List[torch.Tensor]) -> tuple:
        """``args`` with the bags' entries replaced by ``bags``."""
        like = args[self.offsets]
        offsets = torch.tensor([0] + [b.shape[0] for b in bags], dtype=like.dtype, device=like.device).cumsum(0)
        new = list(args)
        new[self.ids] = torch.cat(bags) if bags else args[self.ids][:0]
        new[self.offsets] = offsets if self.include_last else offsets[:-1]
        return tuple(new)

    def sample(self, args, kwargs, i: int, batch_dim: int):
        """(args, kwargs) of bag ``i`` alone, with its rows of the other batched inputs."""
        n = self.count(args)
        alone, alone_kwargs = sample_alone(args, kwargs, n, batch_dim, i)
        alone = list(alone)
        alone[self.ids], alone[self.offsets] = args[self.ids], args[self.offsets]
        return self.with_entries(tuple(alone), [self.entries(args)[i]]), alone_kwargs


def find_bags(model: nn.Module, args: Sequence[Any]) -> Optional[Bags]:
    """The :class:`Bags` of a model with ``nn.EmbeddingBag`` layers (all with one ``include_last_offset``)
    whose first two positional inputs read as flat indices and their offsets: 1-D integer tensors, the
    offsets starting at 0, non-decreasing, within the indices. The hooks engine checks at every call that
    a bag layer fed a 1-D input receives these two."""
    flags = {m.include_last_offset for m in model.modules() if isinstance(m, nn.EmbeddingBag)}
    if len(flags) != 1 or len(args) < 2:
        return None
    ids, offsets = args[0], args[1]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() and not t.is_complex()
               for t in (ids, offsets)):
        return None
    if offsets.numel() and (offsets[0] != 0 or bool((offsets.diff() < 0).any()) or offsets[-1] > ids.shape[0]):
        return None  # (no offsets: an empty batch, as Poisson sampling draws)
    return Bags(0, 1, flags.pop())


def _is_batched(t: Any, n: int, batch_dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == n


def output_batch_dim(t: torch.Tensor, n: int, batch_dim: int) -> Optional[int]:
    """Where an output holds one row per sample: ``batch_dim``, or dimension 0 (a time-major model's ``(N, C)``
    classifier output); None where neither has the batch's ``n`` rows."""
    if _is_batched(t, n, batch_dim):
        return batch_dim
    return 0 if _is_batched(t, n, 0) else None


def _is_packed(t: Any) -> bool:
    return isinstance(t, PackedSequence)


def sequences_of(packed: PackedSequence) -> List[torch.Tensor]:
    """The sequences of a PackedSequence, one per sample, in the order the samples were given."""
    padded, lengths = pad_packed_sequence(packed, batch_first=True)
    return [padded[i, :length] for i, length in enumerate(lengths.tolist())]


def map_batched(args, kwargs, n: int, batch_dim: int, fn: Callable[[torch.Tensor], torch.Tensor],
                packed_fn: Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]] = None):
    """(args, kwargs) with ``fn`` applied to every tensor that has ``n`` rows at ``batch_dim``, and ``packed_fn``
    to the sequences of every PackedSequence of ``n`` samples (packed again afterwards, in any order of lengths)."""
    def apply(t):
        if _is_packed(t):
            if packed_fn is None or int(t.batch_sizes[0]) != n:
                return t
            return pack_sequence(packed_fn(sequences_of(t)), enforce_sorted=False)
        return fn(t) if _is_batched(t, n, batch_dim) else t

    return pytree.tree_map(apply, (tuple(args), dict(kwargs)), is_leaf=_is_packed)


def sample_alone(args, kwargs, n: int, batch_dim: int, i: int):
    """(args, kwargs) of sample ``i`` alone (a batch of one): its rows, or its sequence of a PackedSequence."""
    return map_batched(args, kwargs, n, batch_dim, lambda t: t.narrow(batch_dim, i, 1), lambda seqs: [seqs[i]])


@contextlib.contextmanager
def preserved_state(model: nn.Module):
    """Runs of the model inside leave no trace: buffers (running statistics) are restored, dropout
    layers are off (they would draw different masks for a batch and its samples). Yields ``reset()``,
    which puts the buffers back as they were, so that every run starts from the same state."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    for m, _ in dropouts:
        m.p = 0.0

    def reset() -> None:  # every run starts from the same state (running statistics, power iterations)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    try:
        yield reset
    finally:
        reset()
        for m, p in dropouts:
            m.p = p


def seeded(fn: Callable[[], Any], seed: int = 1234) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def output_tensors(out: Any, batch_dim: int = 0) -> List[torch.Tensor]:
    """The floating-point tensors in a model's output: nested tuples, lists, dicts (ModelOutput-like
    subclasses too) and dataclasses; a PackedSequence padded, its samples in the order given, at ``batch_dim``."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, PackedSequence):
        return [pad_packed_sequence(out, batch_first=batch_dim == 0)[0]] if out.data.is_floating_point() else []
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [getattr(out, f.name) for f in dataclasses.fields(out)]
    elif isinstance(out, Mapping):
        items = list(out.values())
    elif isinstance(out, (tuple, list)):
        items = list(out)
    else:
        return []
    return [t for item in items for t in output_tensors(item, batch_dim)]


def _perturbed(args, kwargs, n: int, batch_dim: int, j: int):
    """The inputs with sample ``j``'s rows replaced by another sample's (so they stay valid inputs:
    token ids, masks, lengths), and whether anything changed."""
    changed = [False]
    samples = [sequences_of(t) if _is_packed(t) else t.unbind(batch_dim)  # each input, split into its samples
               for t in pytree.tree_leaves((tuple(args), dict(kwargs)), is_leaf=_is_packed)
               if _is_batched(t, n, batch_dim) or (_is_packed(t) and int(t.batch_sizes[0]) == n)]
    # the first other sample whose inputs differ from sample j's
    donor = next((k for k in range(n) if k != j and any(not torch.equal(s[k], s[j]) for s in samples)), None)

    def perturb(t: torch.Tensor) -> torch.Tensor:
        if donor is None or torch.equal(t.select(batch_dim, donor), t.select(batch_dim, j)):
            return t
        changed[0] = True
        t = t.clone()
        t.select(batch_dim, j).copy_(t.select(batch_dim, donor))
        return t

    def perturb_sequences(seqs: List[torch.Tensor]) -> List[torch.Tensor]:
        if donor is None or torch.equal(seqs[donor], seqs[j]):
            return seqs
        changed[0] = True
        return seqs[:j] + [seqs[donor]] + seqs[j + 1:]

    new_args, new_kwargs = map_batched(args, kwargs, n, batch_dim, perturb, perturb_sequences)
    return new_args, new_kwargs, changed[0]


def _perturbed_bag(args, kwargs, bags: Bags, j: int):
    """The inputs with bag ``j``'s entries replaced by another bag's, and whether anything changed."""
    entries = bags.entries(args)
    donor = next((k for k in range(len(entries)) if k != j and not torch.equal(entries[k], entries[j])), None)
    if donor is None:
        return args, kwargs, False
    entries[j] = entries[donor]
    return bags.with_entries(args, entries), kwargs, True


@dataclasses.dataclass(frozen=True)
class Untested:
    """Why the cross-sample test could not run on a batch (``why``), and what the user can do (``fix``)."""

    why: str
    fix: str

    def __str__(self) -> str:
        return self.why


_TRACEABLE = "or make the model traceable by torch.fx (grad_sample_mode='fx' follows the batch through the graph)"


def cross_sample_dependence(run: Callable[..., Any], args, kwargs, batch_dim: int, bags: Optional[Bags] = None
                            ) -> Tuple[Optional[str], Optional[Untested]]:
    """Does sample i's output depend on sample j's input (i != j)? ``run(*args, **kwargs)`` runs the
    model (hooks muted, state preserved by the caller); ``bags``: the batch is one of bags. Returns (what
    was found, or None; why the test could not run, or None)."""
    n = bags.count(args) if bags is not None else batch_size_of(args, kwargs, batch_dim)
    if n is None or n < 2:
        return None, Untested("the batch has fewer than two samples",
                              "test the model on a batch of two samples or more")
    with torch.no_grad():
        base = output_tensors(seeded(lambda: run(*args, **kwargs)), batch_dim)
        again = output_tensors(seeded(lambda: run(*args, **kwargs)), batch_dim)
        if not base:
            return None, Untested("the model returned no floating-point tensor",
                                  "return the model's per-sample outputs (one row per sample) and compute the loss "
                                  "outside the model")
        if any(not torch.equal(a, b) for a, b in zip(base, again)):
            return None, Untested("the model's output differs between two runs on the same batch with the same seed",
                                  "make the model's randomness follow torch's seed (torch.manual_seed), "
                                  "or switch it off while training privately")
        for k, t in enumerate(base):
            if not _is_batched(t, n, batch_dim) and t.dim() == 0:
                return None, Untested(
                    f"output #{k} has shape (), without the batch ({n} samples) in dimension {batch_dim}",
                    "return per-sample outputs (one row per sample) and compute the loss outside the model (call a "
                    "Hugging Face model without labels), " + _TRACEABLE)
            if output_batch_dim(t, n, batch_dim) is None:
                return None, Untested(
                    f"output #{k} has shape {tuple(t.shape)}, without the batch ({n} samples) in dimension {batch_dim}",
                    f"return one row per sample in dimension {batch_dim} of every output (compute the loss outside "
                    "the model). The hooks engine counts one sample per row of the first input: a batch of graphs "
                    "(the nodes of several graphs in one tensor, with a vector saying which graph each node is in) is "
                    "not one it can split; pad each graph to a fixed number of nodes, (N, nodes, features) with a "
                    "mask, so that every layer sees one row per graph, " + _TRACEABLE)
        j = 0
        new_args, new_kwargs, changed = (_perturbed_bag(args, kwargs, bags, j) if bags is not None
                                         else _perturbed(args, kwargs, n, batch_dim, j))
        if not changed:
            return None, Untested(f"no input with the batch ({n} samples) in dimension {batch_dim} differs between "
                                  "samples, so none could be changed",
                                  "draw the first batch from your data (samples that differ), not copies of one sample")
        try:
            after = output_tensors(seeded(lambda: run(*new_args, **new_kwargs)), batch_dim)
        except Exception as exc:  # noqa: BLE001 - the model refuses the changed batch: nothing learned
            return None, Untested(
                f"the model failed on the batch with sample {j}'s input changed ({type(exc).__name__}: {exc})",
                "let the model accept a batch whose first sample is replaced by another of the batch, " + _TRACEABLE)
    packed = any(_is_packed(a) for a in (*args, *kwargs.values()))
    for k, (a, b) in enumerate(zip(base, after)):
        if packed and a.dim() == b.dim() and a.shape[batch_dim] == b.shape[batch_dim]:
            # a padded sequence output is as long as the longest sample: the others' steps fit in the shorter
            a, b = (t[tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))] for t in (a, b))
        if a.shape != b.shape:
            return (f"output #{k} changed shape from {tuple(a.shape)} to {tuple(b.shape)} when sample {j}'s "
                    "input changed"), None
        others = torch.ones(n, dtype=torch.bool)
        others[j] = False
        d = output_batch_dim(a, n, batch_dim)
        a_rest, b_rest = a.movedim(d, 0)[others], b.movedim(d, 0)[others]
        tol = 1e-6 * (1 + a_rest.abs().max().item()) if a_rest.numel() else 0.0
        # one row per other sample, whatever the output's rank (a (N,) output has no dimension 1)
        moved = (a_rest - b_rest).abs().reshape(n - 1, -1).amax(1) if a_rest.numel() else torch.zeros(0)
        rows = [i for i, d in zip([i for i in range(n) if i != j], moved.tolist()) if d > tol]
        if rows:
            return (f"the output of sample(s) {rows[:5]} (output #{k}) changed by up to {max(moved.tolist()):.3g} "
                    f"when only sample {j}'s input changed: the model mixes samples across the batch"), None
    return None, None


def is_random(run: Callable[..., Any], args, kwargs) -> bool:
    """Does the model's output change with the random seed (functional dropout, noise)?"""
    with torch.no_grad():
        first = output_tensors(seeded(lambda: run(*args, **kwargs), seed=1))
        second = output_tensors(seeded(lambda: run(*args, **kwargs), seed=2))
    return any(not torch.equal(a, b) for a, b in zip(first, second))


def gradient_rtol(dtypes) -> float:
    """The relative tolerance of :func:`compare_gradients` for a model computing in ``dtypes`` (its
    parameters', and autocast's when on): 1e-3 in float32 or wider; in half precision 4 units in the last
    place (bfloat16: 2**-5), since the batch and each sample alone run through kernels of other shapes whose
    roundings differ by about one unit per layer, while a batch read in the wrong place is off by O(1)."""
    eps = max([torch.finfo(d).eps for d in dtypes if d.is_floating_point], default=0.0)
    return max(1e-3, 4 * eps)


def batch_of_one_gradients(loss_alone: Callable[[int], torch.Tensor], named: Sequence[Tuple[str, nn.Parameter]],
                           k: int) -> Dict[str, Optional[torch.Tensor]]:
    """The definition of per-sample gradients, which every check compares with: ``{name: (k, *p.shape)}``,
    row ``i`` the gradient of ``loss_alone(i)``, sample ``i``'s loss computed with sample ``i`` run alone
    (a batch of one). A row is zero where sample ``i`` does not reach the parameter; None for a parameter
    no sample reaches."""
    params = [p for _, p in named]
    rows: List[Tuple[Optional[torch.Tensor], ...]] = []
    for i in range(k):
        loss = loss_alone(i)
        rows.append(torch.autograd.grad(loss, params, allow_unused=True) if params else ())
    found: Dict[str, Optional[torch.Tensor]] = {}
    for j, (name, p) in enumerate(named):
        grads = [row[j] for row in rows]
        found[name] = None if all(g is None for g in grads) else torch.stack(
            [torch.zeros_like(p) if g is None else g.detach() for g in grads])
    return found


def compare_gradients(engine_rows: Dict[str, torch.Tensor], alone: Dict[str, Optional[torch.Tensor]],
                      rtol: float = 1e-3) -> Optional[str]:
    """Compare per-sample gradients (``{name: (k, *shape)}``) with those of each sample run alone
    (:func:`batch_of_one_gradients`), row by row, at ``rtol`` of the row's largest entry."""
    for name, rows in engine_rows.items():
        for i in range(rows.shape[0]):
            expected = alone.get(name)
            expected = torch.zeros_like(rows[i]) if expected is None else expected[i].to(rows.dtype)
            scale = expected.abs().max().item() if expected.numel() else 0.0
            diff = (rows[i] - expected).abs().max().item() if expected.numel() else 0.0
            if not diff <= 1e-5 + rtol * scale:
                return (f"the per-sample gradient of parameter '{name}' for sample {i} differs from the gradient "
                        f"of that sample run alone (max abs diff {diff:.3g}, gradient scale {scale:.3g}): "
                        "the batch is not where the engine assumes in some layer, or a parameter is used "
                        "where no hook sees it")
    return None

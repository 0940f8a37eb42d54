"""Padded Poisson batches (``padded_batches``): every batch padded with rows of zeros to a few fixed sizes, the
padding rows dropped before clipping. The update with padding must be the update without, in float64, for every
engine and sink; an empty batch and a batch larger than the base size included; the accountant's history the same;
the padding rows independent of the data."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fxdp import PrivacyEngine
from fxdp.data import BatchMemoryManager, DPDataLoader, PoissonBatchSampler
from fxdp.data.padding import base_bucket_size, bucket_size, pad_batch
from fxdp.errors import StepRefusedError

N, FEATURES, CLASSES = 40, 6, 3
# batches of 3 samples, none, 30 (more than the base size 16: padded to 32) and 1
SCRIPT = [[3, 7, 11], [], list(range(2, 32)), [5]]
ENGINES = [("fx", False), ("fx", True), ("hooks", False), ("ew", False), ("functorch", False)]


class ScriptedBatches(PoissonBatchSampler):
    """The loader's own Poisson sampler, made to hand out ``script``'s batches (the same in both runs)."""

    def __iter__(self):
        for indices in self.script:
            yield list(indices)


def scripted(loader: DPDataLoader, script) -> DPDataLoader:
    loader.batch_sampler.__class__ = ScriptedBatches
    loader.batch_sampler.script = script
    return loader


def dataset(seed: int = 0, positive: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g, dtype=torch.float64)
    return TensorDataset(x.abs() + 0.1 if positive else x, torch.randint(0, CLASSES, (N,), generator=g))


class MLP(nn.Module):
    def __init__(self, log_inputs: bool = False):
        super().__init__()
        self.log_inputs = log_inputs
        self.fc1 = nn.Linear(FEATURES, 5)
        self.fc2 = nn.Linear(5, CLASSES)

    def forward(self, x):
        if self.log_inputs:  # a padding row of zeros gives -inf here, and inf or nan after
            x = torch.log(x)
        return self.fc2(torch.tanh(self.fc1(x)))


def private_mlp(padded, *, log_inputs=False, engine=None, **settings):
    """``(model, private model, optimizer, loader)``: the seeded MLP in float64 made private on the test data set
    (bound 1.4, noise 0.7 from a seeded generator, batches padded as ``padded`` says), ``settings`` overriding.
    (Most samples' gradient norms lie between 1 and 2: the bound 1.4 clips some and leaves others as they are.)"""
    torch.manual_seed(0)
    model = MLP(log_inputs).double()
    defaults = dict(max_grad_norm=1.4, noise_multiplier=0.7, noise_generator=torch.Generator().manual_seed(1))
    module, optimizer, loader = (engine or PrivacyEngine()).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(positive=log_inputs), batch_size=8), padded_batches=padded,
        **{**defaults, **settings})
    return model, module, optimizer, loader


def train(mode, materialise, padded, *, script=SCRIPT, reduction="mean", log_inputs=False, loss=None,
          **private):
    """Parameters after one step per scripted batch, the accountant's history and the batch sizes handed out."""
    engine = PrivacyEngine()
    model, module, optimizer, loader = private_mlp(
        padded, log_inputs=log_inputs, engine=engine,
        **{**dict(grad_sample_mode=mode, loss_reduction=reduction, materialise_grad_sample=materialise), **private})
    loss = loss or (lambda out, y, loader: F.cross_entropy(out, y, reduction=reduction))
    sizes = []
    for x, y in scripted(loader, script):
        optimizer.zero_grad()
        loss(module(x), y, loader).backward()
        optimizer.step()
        sizes.append(x.shape[0])
    return [p.detach().clone() for p in model.parameters()], list(engine.accountant.history), sizes, loader


@pytest.mark.parametrize("mode,materialise", ENGINES)
def test_the_update_with_padding_is_the_update_without(mode, materialise):
    plain, plain_history, plain_sizes, _ = train(mode, materialise, False)
    padded, padded_history, padded_sizes, loader = train(mode, materialise, 16)
    assert plain_sizes == [3, 0, 30, 1]
    assert padded_sizes == [16, 16, 32, 16]
    assert dict(loader.padded_sizes) == {16: 3, 32: 1}
    for a, b in zip(plain, padded):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert padded_history == plain_history  # the same Poisson steps at the same rate


ADACLIP = dict(clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.5, max_clipbound=10.0,
               min_clipbound=0.1, unclipped_num_std=1.0)


def masked_mean_over_the_rows_run(out, y, loader):
    """The padding rows left out of the loss by selection, divided by the rows the model ran on."""
    per_row = F.cross_entropy(out, y, reduction="none")
    return torch.where(loader.row_mask, per_row, 0.0).sum() / out.shape[0]


@pytest.mark.parametrize("case", ["summed loss", "per-layer clipping", "adaptive clipping", "masked loss"])
def test_the_update_is_the_same_with_other_settings(case):
    kwargs = {"summed loss": dict(reduction="sum"), "per-layer clipping": dict(clipping="per_layer",
                                                                               max_grad_norm=[0.9, 0.3, 0.8, 0.2]),
              "adaptive clipping": ADACLIP, "masked loss": {}}[case]
    plain, *_ = train("fx", False, False, **kwargs)
    padded, *_ = train("fx", False, 16, **kwargs,
                       loss=masked_mean_over_the_rows_run if case == "masked loss" else None)
    for a, b in zip(plain, padded):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_worker_processes_pad_too():
    loader = scripted(DPDataLoader(dataset(), sample_rate=0.2, padded_batches=16, num_workers=1), [[1, 4], []])
    loader.batch_observer = lambda **told: None
    assert [(x.shape[0], loader.real_rows) for x, _ in loader] == [(16, 2), (16, 0)]


@pytest.mark.parametrize("mode,materialise", [("fx", False), ("fx", True), ("functorch", False)])
def test_padding_rows_whose_gradient_is_not_finite_change_nothing(mode, materialise):
    # log(0) = -inf in every padding row: its loss is nan and its per-sample gradient inf or nan. They are dropped by
    # selection (0 * inf would be nan), so the update is the one without padding, and nothing warns.
    plain, *_ = train(mode, materialise, False, log_inputs=True, script=[[3, 7, 11], list(range(2, 32))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded, *_ = train(mode, materialise, 16, log_inputs=True, script=[[3, 7, 11], list(range(2, 32))])
    for a, b in zip(plain, padded):
        assert bool(torch.isfinite(b).all())
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_padding_rows_are_zeros_whatever_the_data():
    batches = []
    for seed in (0, 1):
        loader = scripted(DPDataLoader(dataset(seed), sample_rate=0.2, padded_batches=16), [[1, 4], []])
        loader.batch_observer = lambda **told: None
        batches.append([(x.clone(), y.clone(), loader.real_rows, loader.row_mask.clone()) for x, y in loader])
    for (x0, y0, real0, mask0), (x1, y1, real1, mask1) in zip(*batches):
        assert x0.shape == x1.shape == (16, FEATURES) and y0.shape == (16,)
        assert real0 == real1 and torch.equal(mask0, torch.arange(16) < real0)
        assert torch.equal(x0[real0:], torch.zeros_like(x0[real0:])) and not bool(y0[real0:].any())
        assert torch.equal(x0[real0:], x1[real1:])  # the padding does not depend on the dataset
        assert not torch.equal(x0[:real0], x1[:real1]) or real0 == 0  # (while the samples do)


def test_the_default_base_size_is_a_high_quantile_of_the_batch_size():
    # Binomial(60000, 256/60000): mean 256, sd 16; its 99.9% quantile (about 305) rounded up to a multiple of 8
    assert base_bucket_size(60000, 256 / 60000) == 312
    assert base_bucket_size(40, 0.2) == 16 and base_bucket_size(10, 1.0) == 16
    assert [bucket_size(n, 16) for n in (0, 1, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    loader = DPDataLoader(dataset(), sample_rate=0.2, padded_batches=True)
    assert loader.padding_base == 16
    assert DPDataLoader(dataset(), sample_rate=0.2).padding_base == 0  # off by default


def test_an_empty_batch_is_padded_and_flagged_empty():
    told = []
    loader = scripted(DPDataLoader(dataset(), sample_rate=0.2, padded_batches=8), [[]])
    loader.batch_observer = lambda **kw: told.append(kw)
    (x, y), = list(loader)
    assert x.shape == (8, FEATURES) and loader.real_rows == 0 and not bool(loader.row_mask.any())
    assert told == [dict(empty=True, new_epoch=True, real_rows=0, padded_to=8)]


def test_batch_second_layout_pads_dimension_one():
    seqs = TensorDataset(torch.randn(10, 4, 3), torch.arange(10))  # a sample: (T=4, 3); collated (T, N, 3)

    def time_major(samples):
        return torch.stack([s[0] for s in samples], 1), torch.stack([s[1] for s in samples])

    loader = scripted(DPDataLoader(seqs, sample_rate=0.3, collate_fn=time_major, padded_batches=8, batch_first=False),
                      [[0, 2, 5], []])
    loader.batch_observer = lambda **told: None
    (x, y), (e, f) = list(loader)
    assert x.shape == (4, 8, 3) and y.shape == (8,) and e.shape == (4, 8, 3)
    assert torch.equal(x[:, :3], torch.stack([seqs[i][0] for i in (0, 2, 5)], 1)) and not bool(x[:, 3:].any())


def test_what_cannot_be_padded_is_refused_by_name():
    with pytest.raises(TypeError, match=r"batch\[1\].*list"):
        pad_batch((torch.zeros(2, 3), ["a", "b"]), 2, 8)
    with pytest.raises(TypeError, match=r"batch\['mask'\], a tensor of shape \(5,\)"):
        pad_batch({"x": torch.zeros(2, 3), "mask": torch.zeros(5)}, 2, 8)
    with pytest.raises(ValueError, match="padded_batches must be"):
        DPDataLoader(dataset(), sample_rate=0.2, padded_batches=-3)


def test_a_model_run_on_other_rows_is_refused():
    model, module, optimizer, loader = private_mlp(16)
    x, y = next(iter(scripted(loader, [[3, 7, 11]])))
    F.cross_entropy(module(x[:5]), y[:5]).backward()  # neither the padded batch nor its real rows
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StepRefusedError, match="padded to 16 rows, of which the first 3"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_real_rows_alone_give_the_same_update():
    plain, *_ = train("fx", False, False, script=[[3, 7, 11]])
    model, module, optimizer, loader = private_mlp(16)
    for x, y in scripted(loader, [[3, 7, 11]]):
        real = loader.row_mask
        F.cross_entropy(module(x[real]), y[real]).backward()
        optimizer.step()
    for a, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.detach(), a, rtol=1e-12, atol=1e-12)


def test_what_padding_does_not_support_yet_is_refused():
    model = MLP().double()
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                  data_loader=DataLoader(dataset(), batch_size=8), noise_multiplier=0.7, max_grad_norm=1.4)
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        PrivacyEngine().make_private(**kwargs, poisson_sampling=False, padded_batches=True)
    _, optimizer, loader = PrivacyEngine().make_private(**kwargs, padded_batches=True)
    with pytest.raises(ValueError, match="BatchMemoryManager cannot"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=optimizer)


@pytest.mark.parametrize("mode", ["fx", "hooks", "ew", "functorch"])
def test_real_rows_per_sample_gradients_are_those_of_the_unpadded_batch(mode):
    grad_samples = []
    for padded in (False, 16):
        model, module, optimizer, loader = private_mlp(padded, grad_sample_mode=mode, materialise_grad_sample=True)
        x, y = next(iter(scripted(loader, [[3, 7, 11]])))
        F.cross_entropy(module(x), y).backward()  # the mean over the 16 rows of the padded batch
        grad_samples.append([p.grad_sample.clone() for p in model.parameters()])
        optimizer.step()
        if padded:  # after the step: the padding rows' records are zeros
            assert all(not bool(p.grad_sample[3:].any()) for p in model.parameters())
    for plain, padded in zip(*grad_samples):
        assert plain.shape[0] == 3 and padded.shape[0] == 16
        torch.testing.assert_close(padded[:3], plain, rtol=1e-12, atol=1e-12)


def test_a_padded_loader_no_optimizer_observes_warns():
    loader = scripted(DPDataLoader(dataset(), sample_rate=0.2, padded_batches=16), [[1, 4]])
    with pytest.warns(UserWarning, match="no DP optimizer observes them"):
        list(loader)


def test_a_distributed_loader_is_not_padded_yet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.distributed is not initialised here)
        with pytest.raises(ValueError, match="not supported with distributed=True"):
            DPDataLoader(dataset(), sample_rate=0.2, padded_batches=True, distributed=True)


class TokenModel(nn.Module):
    """Token ids (N, T) -> embedding -> a linear layer on the sequence -> mean over time -> classes: the embedding's
    and the sequence layer's book-keeping (a padding row is token 0 at every position)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))).mean(1))


@pytest.mark.parametrize("mode,materialise", ENGINES)
def test_token_sequences_too(mode, materialise):
    g = torch.Generator().manual_seed(2)
    tokens = TensorDataset(torch.randint(1, 11, (N, 5), generator=g), torch.randint(0, CLASSES, (N,), generator=g))
    updated = []
    for padded in (False, 16):
        torch.manual_seed(0)
        model = TokenModel().double()
        module, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(tokens, batch_size=8), noise_multiplier=0.7, max_grad_norm=1.1,
            grad_sample_mode=mode, materialise_grad_sample=materialise,
            noise_generator=torch.Generator().manual_seed(1), padded_batches=padded)
        for ids, y in scripted(loader, SCRIPT):
            optimizer.zero_grad()
            F.cross_entropy(module(ids), y).backward()
            optimizer.step()
        updated.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*updated):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


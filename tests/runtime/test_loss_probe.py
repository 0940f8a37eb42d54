"""The loss probe (the run-time path): a compiled model's output carries the batch analysis into the user's loss
on the first step; ``backward()`` on a loss that mixes samples raises before anything is differentiated, a
normaliser the batch sets warns with its fix, per-sample losses pass silently; later steps return plain tensors.
Each case of tests/support/losses.py is found here as on the criterion path (tests/passes/test_loss.py)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.diagnostics import Kind, Severity
from fxdp.runtime.loss_probe import LossProbe
from tests.passes.test_loss import criterion_findings
from tests.support.losses import MIXING, N, NONE, NORMALISERS, PER_SAMPLE, inputs, model

CASES = PER_SAMPLE + MIXING + NORMALISERS


def run_first_step(case, dp=None, loss=None):
    """One training step's forward and backward as a user writes it, on ``dp`` (by default compiled from
    ``model()``) with the case's own targets; returns (the findings, the error raised or None, fxdp's warnings)."""
    dp = dp if dp is not None else fxdp.compile_for_dp(model(), inputs(case.shape))
    return _step(dp, inputs(case.shape), case.targets(N), loss or case.loss)


def run_first_step_from_the_loader(case, samples: int = 40):
    """The first step of ``make_private``'s training loop: the batch (inputs and targets) from its loader."""
    torch.manual_seed(0)
    net = model()
    data = torch.utils.data.TensorDataset(inputs(case.shape, samples), *case.targets(samples))
    dp, _, loader = fxdp.PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        data_loader=torch.utils.data.DataLoader(data, batch_size=samples // 2))
    x, *targets = next(iter(loader))
    return _step(dp, x, targets, case.loss)


def _step(dp, x, targets, loss):
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dp(x)
        try:
            loss(out, *targets).backward()
        except fxdp.errors.SampleMixingError as exc:
            error = exc
    findings = error.findings if error is not None else fxdp.report(dp).pass_report("loss").findings
    return findings, error, [w for w in caught if str(w.message).startswith("fxdp loss")]


def _seen(findings):
    return sorted((f.kind, f.location.line if f.location else None) for f in findings)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_run_time_path_finds_what_the_criterion_path_finds(case):
    findings, error, caught = run_first_step_from_the_loader(case)
    assert _seen(findings) == _seen(criterion_findings(case))
    if case.expect == NONE:
        assert findings == () and error is None and caught == []
    elif case.expect == Kind.MIXES_SAMPLES.value:
        assert error is not None and any(f.kind is Kind.MIXES_SAMPLES for f in findings)
    else:
        assert error is None and [f.kind for f in findings] == [Kind.NORMALISER]
        assert len(caught) == 1 and caught[0].filename == __file__  # at the user's backward()
        assert "per_sample_mean" in str(caught[0].message) or "reduction='none'" in str(caught[0].message)


# the losses that mix samples through the model's output (seen without make_private's loader too)
THROUGH_THE_OUTPUT = [c for c in MIXING if c.name != "labels_centred_by_the_batch"]


@pytest.mark.parametrize("case", THROUGH_THE_OUTPUT, ids=lambda c: c.name)
def test_a_mixing_loss_is_refused_before_any_gradient_exists(case):
    net = model()
    dp = fxdp.compile_for_dp(net, inputs(case.shape))
    findings, error, _ = run_first_step(case, dp)
    assert error is not None
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in net.parameters())
    assert "nothing was differentiated" in str(error) and "losses.py:" in str(error)
    # refused again on the next step: a caught error does not let it train
    _, again, _ = run_first_step(case, dp)
    assert again is not None


def _alone(net, case, loss, i):
    """Sample i's gradient of ``loss`` run alone (a batch of one), as a flat list per parameter."""
    net.zero_grad()
    x = inputs(case.shape)[i:i + 1]
    targets = [t[i:i + 1] for t in case.targets(N)]
    loss(net(x), *targets).backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("case", NORMALISERS, ids=lambda c: c.name)
def test_the_fix_of_a_normaliser_gives_each_sample_its_own_gradient(case):
    net = model()
    dp = fxdp.compile_for_dp(net, inputs(case.shape))
    findings, error, caught = run_first_step(case, dp, loss=case.fix)
    assert findings == () and error is None and caught == []
    rows = [p.grad_sample.clone() for p in net.parameters()]
    reference = model()  # the same weights, no fxdp
    for i in range(N):
        for row, alone in zip(rows, _alone(reference, case, case.fix, i)):
            torch.testing.assert_close(row[i], alone, rtol=1e-9, atol=1e-12)
        if case.shape == "tokens":  # the per-sample fix of a token mean is the original loss on each sample alone
            for row, alone in zip(rows, _alone(reference, case, case.loss, i)):
                torch.testing.assert_close(row[i], alone, rtol=1e-9, atol=1e-12)


def test_a_normaliser_trains_on_with_the_warning_and_the_report_lists_it():
    case = next(c for c in NORMALISERS if c.name == "language_model_token_mean")
    dp = fxdp.compile_for_dp(model(), inputs(case.shape))
    findings, error, caught = run_first_step(case, dp)
    assert error is None and len(caught) == 1
    text = str(fxdp.report(dp))
    assert "loss" in text and "normalised by the batch" in text and "losses.py" in text


def test_later_steps_return_plain_tensors():
    case = PER_SAMPLE[0]
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    first = dp(inputs("flat"))
    assert type(first) is LossProbe
    case.loss(first, *case.targets(N)).backward()
    assert type(dp(inputs("flat"))) is torch.Tensor
    assert [p.name for p in fxdp.report(dp).passes][-1] == "loss"


def test_evaluation_forwards_are_not_probed():
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    with torch.no_grad():
        assert type(dp(inputs("flat"))) is torch.Tensor
    dp.eval()
    assert type(dp(inputs("flat"))) is torch.Tensor
    dp.train()
    assert type(dp(inputs("flat"))) is LossProbe  # still armed: the first training step is judged


def test_a_model_compiled_again_has_its_loss_judged_again():
    net = model()
    dp = fxdp.compile_for_dp(net, inputs("flat"))
    F.cross_entropy(dp(inputs("flat")), torch.arange(N) % 6).backward()
    assert type(dp(inputs("flat"))) is torch.Tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "compiled again before this forward"
        net[2] = nn.Linear(8, 6).double()
        out = dp(inputs("flat"))
    assert type(out) is LossProbe
    with pytest.raises(fxdp.errors.SampleMixingError):
        F.cross_entropy(out @ out.T, torch.arange(N)).backward()


def test_two_views_of_one_batch_contrasted_in_the_batch_are_refused():
    """SimCLR's NT-Xent: two forwards (two augmented views), then every view against every other."""
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    x = inputs("flat")
    z = torch.cat([dp(x), dp(x + 0.1)])
    sim = F.normalize(z, dim=1) @ F.normalize(z, dim=1).T / 0.5
    sim = sim.masked_fill(torch.eye(2 * N, dtype=torch.bool), -1e9)
    targets = torch.cat([torch.arange(N, 2 * N), torch.arange(N)])
    with pytest.raises(fxdp.errors.SampleMixingError):
        F.cross_entropy(sim, targets).backward()


def test_two_views_contrasted_only_with_each_other_train():
    """The private alternative: each sample's two views against each other only (no in-batch negatives)."""
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    x = inputs("flat")
    z1, z2 = F.normalize(dp(x), dim=1), F.normalize(dp(x + 0.1), dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (1 - (z1 * z2).sum(1)).mean().backward()
    assert fxdp.report(dp).pass_report("loss").findings == ()


def test_a_loss_read_only_for_logging_before_backward_is_not_judged_as_the_loss():
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    out = dp(inputs("flat"))
    _ = (out @ out.T).sum().item()  # a diagnostic across the batch, not part of the loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.cross_entropy(out, torch.arange(N) % 6).backward()


def test_autograd_grad_is_judged_too():
    net = model()
    dp = fxdp.compile_for_dp(net, inputs("flat"))
    out = dp(inputs("flat"))
    with pytest.raises(fxdp.errors.SampleMixingError):
        torch.autograd.grad(F.cross_entropy(out @ out.T, torch.arange(N)), list(net.parameters()))


def test_without_the_loader_what_the_labels_go_through_before_they_meet_the_output_is_not_seen():
    """Without make_private's loader the probe records the ops that read the model's output: labels centred by the
    batch's mean before that arrive as one tensor (the criterion path, tracing the whole criterion, refuses it;
    so does the probe when the labels come from make_private's loader: the test above)."""
    case = next(c for c in MIXING if c.name == "labels_centred_by_the_batch")
    findings, error, _ = run_first_step(case)
    assert error is None and findings == ()


def test_the_finding_is_an_error_severity_with_the_user_line():
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    out = dp(inputs("flat"))
    logits = out @ out.T  # marked
    with pytest.raises(fxdp.errors.SampleMixingError) as caught:
        F.cross_entropy(logits, torch.arange(N)).backward()
    (finding,) = caught.value.findings
    assert finding.severity is Severity.ERROR and finding.location.code == "logits = out @ out.T  # marked"


def test_a_tensor_with_the_batchs_rows_is_read_per_sample_unless_marked_shared():
    """A vector the loss reads besides the output and the loader's batch, of the batch's length by chance: read as
    one row per sample (then ``out * weights`` pairs sample i with feature i), refused with how to say otherwise."""
    net = nn.Linear(3, 2).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64)
    dp = fxdp.compile_for_dp(net, x)
    with pytest.raises(fxdp.errors.SampleMixingError) as caught:
        (dp(x) * weights).sum().backward()
    assert "a tensor of shape (2,) the loss reads was taken as one row per sample" in caught.value.findings[0].message
    assert "fxdp.shared(tensor)" in caught.value.findings[0].fix
    dp = fxdp.compile_for_dp(net, x, loss_reduction="sum")
    (dp(x) * fxdp.shared(weights)).sum().backward()
    for i in range(2):
        net.zero_grad()
        (net(x[i:i + 1]) * weights).sum().backward()
        torch.testing.assert_close(net.weight.grad_sample[i], net.weight.grad)


def test_a_parameter_the_loss_reads_is_shared_by_all_samples():
    net = nn.Linear(3, 2).double()
    temperature = nn.Parameter(torch.ones(2, dtype=torch.float64))  # a learnable scale, of the batch's length
    x = torch.randn(2, 3, dtype=torch.float64)
    dp = fxdp.compile_for_dp(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (dp(x) / temperature).pow(2).sum().backward()
    assert fxdp.report(dp).pass_report("loss").findings == ()


def test_a_loss_torch_compile_traces_is_not_judged_and_says_so():
    net = model()
    dp = fxdp.compile_for_dp(net, inputs("flat"))
    loss = torch.compile(lambda o, y: F.cross_entropy(o, y), backend="eager")
    with pytest.warns(UserWarning, match="the first step's loss ran under torch.compile"):
        loss(dp(inputs("flat")), torch.arange(N) % 6).backward()
    assert net[0].weight.grad_sample.shape[0] == N
    assert any("not judged" in note for note in fxdp.report(dp).notes)
    assert type(dp(inputs("flat"))) is torch.Tensor  # the probe stepped aside


def test_two_forwards_of_one_step_are_recorded_together():
    dp = fxdp.compile_for_dp(model(), inputs("flat"))
    x = inputs("flat")
    first, second = dp(x), dp(x + 0.1)
    assert first._fxdp_recording is second._fxdp_recording
    with pytest.raises(fxdp.errors.SampleMixingError):  # the first view against every sample's second view
        F.cross_entropy(first @ second.T, torch.arange(N)).backward()

"""The loss pass on a criterion (the static path): traced by torch.fx with the model's output as a batched input,
judged by the batch rules. Losses that mix samples are errors with their line, normalisers the batch sets are
warnings with their fix, per-sample losses have no finding (tests/support/losses.py lists them)."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdp
from fxdp.diagnostics import Kind, Severity
from fxdp.passes.loss import trace_criterion
from tests.support.losses import MIXING, N, NONE, NORMALISERS, PER_SAMPLE, inputs, model
from tests.support.source_lines import line_of

CASES = PER_SAMPLE + MIXING + NORMALISERS


def criterion_findings(case, n=N):
    """What the criterion path finds in ``case``: the compiled model's analysis judging the traced loss."""
    dp = fxdp.compile_for_dp(model(), inputs(case.shape, n))
    with torch.no_grad():
        out = dp(inputs(case.shape, n))
    report = dp.fxdp_batch_guard.reanalysis.judge_criterion(case.loss, [out, *case.targets(n)], n)
    assert report is not None, f"{case.name}: torch.fx could not trace the criterion"
    return report.findings


def test_the_catalogue_has_at_least_twenty_per_sample_losses():
    assert len(PER_SAMPLE) >= 20


@pytest.mark.parametrize("case", PER_SAMPLE, ids=lambda c: c.name)
def test_a_per_sample_loss_has_no_finding(case):
    assert criterion_findings(case) == ()


@pytest.mark.parametrize("case", MIXING, ids=lambda c: c.name)
def test_a_loss_that_mixes_samples_is_an_error_at_its_line(case):
    findings = criterion_findings(case)
    errors = [f for f in findings if f.severity is Severity.ERROR]
    assert errors and all(f.kind is Kind.MIXES_SAMPLES for f in errors), findings
    assert errors[0].location is not None and errors[0].location.file.endswith("losses.py")
    assert errors[0].location.line == inspect.getsourcelines(case.loss)[1]  # the line of the loss's code
    assert "contrast each sample only with its own augmented views" in errors[0].fix


def test_the_in_batch_negatives_finding_names_the_matmul_and_says_why():
    case = next(c for c in MIXING if c.name == "infonce_in_batch_negatives")
    (finding,) = criterion_findings(case)
    assert finding.op == "matmul" and finding.pass_name == "loss"
    assert "z @ z.T" in finding.location.code
    assert "clipping each sample's gradient to C no longer bounds its influence" in finding.message


@pytest.mark.parametrize("case", NORMALISERS, ids=lambda c: c.name)
def test_a_normaliser_the_batch_sets_is_a_warning_with_its_fix(case):
    findings = criterion_findings(case)
    assert [f.kind for f in findings] == [Kind.NORMALISER], findings
    assert findings[0].severity is Severity.WARNING
    assert "sensitivity is more than C" in findings[0].message
    assert "per_sample_mean" in findings[0].fix or "reduction='none'" in findings[0].fix


@pytest.mark.parametrize("case", NORMALISERS, ids=lambda c: c.name)
def test_the_fix_of_a_normaliser_has_no_finding(case):
    fixed = type(case)(case.name + "_fixed", case.fix, case.targets, NONE, case.shape)
    assert criterion_findings(fixed) == ()


def test_the_class_weights_finding_says_what_sets_the_count():
    case = next(c for c in NORMALISERS if c.name == "cross_entropy_class_weights")
    (finding,) = criterion_findings(case)
    assert finding.op == "cross_entropy"
    assert "sum of weight[target]" in finding.message


def test_the_token_mean_finding_counts_the_targets():
    case = next(c for c in NORMALISERS if c.name == "language_model_token_mean")
    (finding,) = criterion_findings(case)
    assert f"over {N * 4} targets of {N} samples" in finding.message
    assert "not ignore_index" in finding.message


def test_a_criterion_torch_fx_cannot_trace_says_why():
    def loss(o, y):
        if o.sum() > 0:  # data-dependent control flow
            return F.cross_entropy(o, y)
        return o.sum()

    graph, why = trace_criterion(loss, 2)
    assert graph is None and "torch.fx cannot trace it" in why


def test_make_private_with_a_contrastive_criterion_refuses_before_the_first_loss():
    class InfoNCE(nn.Module):
        reduction = "mean"

        def forward(self, z, labels):
            logits = z @ z.T  # every sample against every other
            return F.cross_entropy(logits, labels, reduction=self.reduction)

    net = model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs("flat", 40), torch.arange(40) % 6),
                                         batch_size=8)
    dp, optimizer, criterion, loader = fxdp.PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, criterion=InfoNCE(), poisson_sampling=False)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = next(iter(loader))
    with pytest.raises(fxdp.errors.SampleMixingError) as caught:
        criterion(dp(x), y)
    assert f"test_loss.py:{line_of(InfoNCE, 'logits = z @ z.T')}" in str(caught.value)
    assert "matmul" in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_make_private_with_class_weights_in_the_criterion_trains_them_per_sample():
    """Opacus's criterion path computes each sample's loss (reduction 'none'): class weights are each sample's own
    factor there, so nothing is normalised by the batch and nothing is reported."""
    net = model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs("flat", 40), torch.arange(40) % 6),
                                         batch_size=8)
    dp, optimizer, criterion, loader = fxdp.PrivacyEngine().make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2, 6, dtype=torch.float64)),
        poisson_sampling=False)
    x, y = next(iter(loader))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        criterion(dp(x), y).backward()
    optimizer.step()
    assert fxdp.report(dp).pass_report("loss").findings == ()

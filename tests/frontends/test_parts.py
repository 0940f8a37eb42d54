"""The parts of a model no front end captures (fxdp/frontends/parts.py): which submodule is untraceable, why and at
which line, which are traceable, and the compile report's lines naming each part's engine (compile_for_dp,
fxdp.inspect and the fxdp command line)."""

from pathlib import Path

import pytest
from torch import nn

import fxdp
from fxdp.cli import main
from fxdp.frontends.parts import ROOT, find_parts
from tests.support import untraceable_zoo
from tests.support.untraceable_zoo import ZOO

ZOO_FILE = Path(untraceable_zoo.__file__)
ROOT_DIR = Path(__file__).resolve().parents[2]

INT_OF_PROXY = ("TypeError: int() argument must be a string, a bytes-like object or a real number, not "
                "'_InplaceRecordingProxy'")
ITERATED = "TraceError: Proxy object cannot be iterated."
CONTROL_FLOW = "TraceError: symbolically traced variables cannot be used as inputs to control flow"


def line_of(code: str) -> int:
    lines = [i for i, text in enumerate(ZOO_FILE.read_text().splitlines(), 1) if code in text]
    assert len(lines) == 1, code
    return lines[0]


# model -> (untraceable part, its type, the reason's start, the code the tracer stopped at, traceable parts)
EXPECTED = {
    "chunked_encoder": ("block", "SlidingWindowMixer", INT_OF_PROXY, "used = int(mask.sum(1).max().item())",
                        (("embed", "Embedding"), ("head", "Linear"))),
    "adaptive_depth": ("depth", "AdaptiveDepth", ITERATED, "for row in h.split(1):",
                       (("conv", "Conv1d"), ("proj", "Linear"), ("out", "Linear"))),
    "batch_branch": ("branch", "BatchBranch", CONTROL_FLOW, "return self.a(h) if h.sum() > 0 else self.b(h)",
                     (("inp", "Linear"), ("out", "Linear"))),
    "batch_loop": ("loop", "BatchLoopCount", INT_OF_PROXY, "for _ in range(1 + int(h.abs().max().item() * 4) % 3):",
                   (("inp", "Linear"), ("out", "Linear"))),
    "root_item": (ROOT, "RootItemScale", CONTROL_FLOW, "if self.warm.item() > 2:",
                  (("inp", "Linear"), ("norm", "LayerNorm"), ("out", "Linear"))),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_untraceable_part_is_named_with_its_reason_and_line(name):
    path, kind, reason, code, traceable = EXPECTED[name]
    model, _, _ = ZOO[name]()
    parts = find_parts(model)
    (part,) = parts.untraceable
    assert (part.path, part.type_name) == (path, kind)
    assert part.reason.startswith(reason)
    assert Path(part.location.file).resolve() == ZOO_FILE.resolve() and part.location.line == line_of(code)
    assert parts.traceable == traceable
    assert parts.blocks == (() if path == ROOT else (part,))


def test_a_model_with_an_untraceable_block_and_untraceable_code_of_its_own():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = untraceable_zoo.AdaptiveDepth()
            self.fc = nn.Linear(untraceable_zoo.D, 2)

        def forward(self, h):
            h = self.inner(h)
            return self.fc(h) if h.shape[0] > 0 and bool(h.sum() != 0) else h

    parts = find_parts(Both())
    assert [(p.path, p.type_name) for p in parts.untraceable] == [("inner", "AdaptiveDepth"), (ROOT, "Both")]
    assert [p.path for p in parts.blocks] == ["inner"]
    assert parts.traceable == (("fc", "Linear"),)


def test_a_traceable_module_inside_a_block_is_not_a_part_of_its_own():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(untraceable_zoo.D, untraceable_zoo.D)
            self.body = nn.Sequential(nn.Linear(untraceable_zoo.D, untraceable_zoo.D))

        def forward(self, h):
            for _ in range(int(h.abs().max().item())):
                h = self.body(h)
            return self.fc(h)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer = Outer()
            self.head = nn.Linear(untraceable_zoo.D, 2)

        def forward(self, h):
            return self.head(self.outer(h))

    parts = find_parts(Model())
    assert [p.path for p in parts.untraceable] == ["outer"]
    assert parts.traceable == (("head", "Linear"),)


PER_LAYER = ("batch_branch", "batch_loop")  # untraceable submodules whose layers see the batch


def _part_lines(name):
    path, kind, reason, code, traceable = EXPECTED[name]
    where = f"{ZOO_FILE}:{line_of(code)}"
    listed = ", ".join(f"'{p}' ({t})" for p, t in traceable)
    if path == ROOT:
        engine = ("engine: hooks (its layers' per-layer rules; the model is tested against batches of one on its first "
                  "batch)")
    elif name in PER_LAYER:
        engine = ("engine: hooks (its layers' per-layer rules; every forward checks that its output for each sample "
                  "equals that sample's alone; it runs as one op instead if one of its layers does not see the batch "
                  "on the first batch)")
    else:
        engine = ("engine: hooks, the block as one op (the generic rule over its parameters, each sample re-run alone; "
                  "every forward checks that the block's output for each sample equals that sample's alone)")
    return (f"untraceable part '{path}' ({kind}) at {where}: {reason}", engine,
            f"traceable parts (torch.fx traces them alone): {listed}; engine: hooks (per-layer rules)")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_compile_report_names_each_part_and_its_engine(name):
    model, inputs, _ = ZOO[name]()
    start, engine, traceable = _part_lines(name)
    for rep in (fxdp.report(fxdp.compile_for_dp(model, example_inputs=inputs)),
                fxdp.inspect(model, example_inputs=inputs)):
        lines = str(rep).splitlines()
        assert lines[1] == "traced: no, falling back to the hooks engine (GradSampleModule)"
        (part,) = [line for line in lines if line.startswith("untraceable part ")]
        assert part.startswith(start) and part.endswith(engine)
        assert traceable in lines
        assert rep.engine == "hooks"


def test_the_command_line_prints_the_parts(capsys, monkeypatch):
    monkeypatch.chdir(ROOT_DIR)
    code = main(["inspect", "tests/support/untraceable_zoo.py:BatchBranchNet", "--input", "4,4"])
    out = capsys.readouterr().out
    assert code == 1
    where = f"tests/support/untraceable_zoo.py:{line_of('return self.a(h) if h.sum() > 0 else self.b(h)')}"
    assert f"untraceable part 'branch' (BatchBranch) at {where}: {CONTROL_FLOW}; engine: hooks (its layers' " \
        "per-layer rules; every forward checks" in out
    assert "traceable parts (torch.fx traces them alone): 'inp' (Linear), 'out' (Linear); engine: hooks " \
           "(per-layer rules)" in out
    assert "mixes samples  branch  BatchBranch" in out

"""A printed report keeps every ``file:line`` whole on one line, however long the path: a location
split across lines can be neither clicked nor searched. The message column wraps instead."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

import fxdp

MODEL_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn


    class LongPathModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.fc(x)
            out += x
            out = self.act(out)
            return out.transpose(0, 1).transpose(0, 1)


    class MixingModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return h - h.mean(0)
''')


@pytest.fixture
def long_path_module(tmp_path):
    folder = tmp_path / ("a_directory_with_a_name_long_enough_to_be_wrapped_by_any_table_" * 2)
    folder.mkdir()
    path = folder / "model_defined_far_away.py"
    path.write_text(MODEL_SOURCE)
    assert len(str(path)) > 60
    spec = importlib.util.spec_from_file_location("fxdp_test_model_defined_far_away", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path)


def _assert_locations_whole(text: str, findings, path: str) -> None:
    located = [f for f in findings if f.location is not None]
    assert located, "the test needs findings with locations"
    lines = text.splitlines()
    for f in located:
        assert f.location.file == path
        where = f"{path}:{f.location.line}"
        assert any(where in line for line in lines), f"{where} is broken across lines in:\n{text}"


def test_a_report_keeps_long_locations_on_one_line(long_path_module):
    module, path = long_path_module
    rep = fxdp.inspect(module.LongPathModel(), torch.randn(3, 4))
    _assert_locations_whole(str(rep), rep.changes + rep.findings, path)
    # the long message column is wrapped instead, so the table keeps a readable width
    assert max(len(line) for line in str(rep).splitlines()) < len(path) + 250


def test_an_error_keeps_long_locations_on_one_line(long_path_module):
    module, path = long_path_module
    with pytest.raises(fxdp.errors.NotPrivateError) as info:
        fxdp.compile_for_dp(module.MixingModel(), example_inputs=torch.randn(3, 4))
    _assert_locations_whole(str(info.value), info.value.findings, path)


# -- a layer torch's code calls (nn.Sequential's forward) is located where the user's code built it ----

BUILT_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn

    import fxdp


    class Built(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(4, 8),  # @net.0
                nn.ReLU(),
                nn.Sequential(nn.Linear(8, 8),  # @net.2.0
                              nn.Tanh()),
                nn.Linear(8, 4),  # @net.3
            )
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # @blocks
                                         for _ in range(2)])
            self.listed = nn.ModuleList([
                nn.Sequential(nn.Linear(4, 4)),  # @listed.0.0
                nn.Sequential(nn.Linear(4, 4)),  # @listed.1.0
            ])
            self.heads = nn.ModuleDict({"a": nn.Sequential(nn.Linear(4, 4))})  # @heads.a.0
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            x = self.net(x)
            for block in self.blocks:
                x = block(x)
            for block in self.listed:
                x = block(x)
            x = self.heads["a"](x)
            return self.head(x)  # @head


    def make_sequential():
        return nn.Sequential(
            nn.Linear(4, 8),  # @root.0
            nn.ReLU(),
            nn.Linear(8, 2),  # @root.2
        )


    def compile_here():
        return fxdp.compile_for_dp(make_sequential(), example_inputs=torch.randn(3, 4))
''')


@pytest.fixture
def built_module(tmp_path):
    path = tmp_path / "built_models.py"
    path.write_text(BUILT_SOURCE)
    spec = importlib.util.spec_from_file_location("fxdp_test_built_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = {line.split("# @")[1].strip(): number
             for number, line in enumerate(BUILT_SOURCE.splitlines(), start=1) if "# @" in line}
    return module, str(path), lines


def _located(model):
    """{layer's node name: its location} of the per_sample pass's rows."""
    return {f.node: f.location for f in fxdp.report(model).changes if f.pass_name == "per_sample"}


def test_a_layer_of_a_sequential_is_located_where_it_was_built(built_module):
    module, path, lines = built_module
    model = fxdp.compile_for_dp(module.Built(), example_inputs=torch.randn(3, 4))
    located = _located(model)
    expected = {"net_0": "net.0", "net_2_0": "net.2.0", "net_3": "net.3", "blocks_0_0": "blocks",
                "blocks_1_0": "blocks", "listed_0_0": "listed.0.0", "listed_1_0": "listed.1.0",
                "heads_a_0": "heads.a.0"}
    for node, marker in expected.items():
        location = located[node]
        assert location is not None and location.built, (node, location)
        assert (location.file, location.line) == (path, lines[marker]), node
    # labelled as the construction line, in the table and in messages
    assert f"built at {path}:{lines['net.0']}" in str(fxdp.report(model))
    assert str(located["net_0"]).endswith("(where the layer was built)")


def test_a_layer_the_users_code_calls_keeps_its_call_site(built_module):
    module, path, lines = built_module
    location = _located(fxdp.compile_for_dp(module.Built(), example_inputs=torch.randn(3, 4)))["head"]
    assert not location.built and (location.file, location.line) == (path, lines["head"])


def test_a_root_sequential_built_beside_the_call_is_located(built_module):
    module, path, lines = built_module
    located = _located(module.compile_here())
    assert (located["_0"].line, located["_2"].line) == (lines["root.0"], lines["root.2"])
    assert located["_0"].built and located["_0"].file == path


def test_a_root_sequential_built_elsewhere_stays_unknown(built_module):
    # built in built_models.py, compiled from this file: no line here built it, so none is shown
    module, _, _ = built_module
    located = _located(fxdp.compile_for_dp(module.make_sequential(), example_inputs=torch.randn(3, 4)))
    assert located["_0"] is None and located["_2"] is None


def test_a_root_sequential_is_never_matched_by_a_guess(tmp_path):
    from fxdp.diagnostics.source import build_location

    path = tmp_path / "callers.py"
    path.write_text("from torch import nn\n"
                    "a = nn.Sequential(nn.Linear(4, 9), nn.ReLU())\n"  # another width
                    "b = nn.Sequential(nn.Linear(4, 8), nn.ReLU())\n"
                    "c = nn.Sequential(nn.Linear(4, 8), nn.ReLU())\n")  # two candidates: ambiguous
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    assert build_location(model, "0", str(path)) is None
    path.write_text("from torch import nn\nb = nn.Sequential(nn.Linear(4, 8), nn.ReLU())\n")
    assert build_location(model, "0", str(path)).line == 2
    assert build_location(model, "no.such.layer", str(path)) is None
    assert build_location(model, "0", str(tmp_path / "missing.py")) is None

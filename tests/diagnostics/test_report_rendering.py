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
    with pytest.raises(fxdp.NotPrivateError) as info:
        fxdp.compile_for_dp(module.MixingModel(), example_inputs=torch.randn(3, 4))
    _assert_locations_whole(str(info.value), info.value.findings, path)

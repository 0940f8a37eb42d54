"""A stock ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` run layer by layer and direction by direction with the
Functions of :mod:`~fxdp.runtime.recurrent.cells`, using the module's own parameters (its state_dict
and its output are the stock module's), so that backward delivers one Linear-like capture per projection
(:class:`~fxdp.grad_sample.recurrent.RecurrentProjection`, see :mod:`fxdp.grad_sample.recurrent`) with its
input ``A`` and output gradient ``G`` batch first. Time steps a sequence does not have (a
``PackedSequence``) have ``G = 0`` exactly, so they add nothing.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from fxdp.grad_sample.generic import summed_loss_scale
from fxdp.grad_sample.recurrent import projections
from fxdp.runtime.recurrent.cells import GRULayer, LSTMLayer, RNNLayer
from fxdp.sinks.capture import layer_capture
from fxdp.sinks.contract import LayerCapture


class _Rows:
    """Where packed rows (time step after time step, each step's active sequences longest first) sit in the
    batch-first ``(N, T, c)`` layout of the samples in the caller's order."""

    def __init__(self, batch_sizes: List[int], sorted_indices: Optional[torch.Tensor], padded: bool, device):
        self.n, self.t = batch_sizes[0], len(batch_sizes)
        self.padded = padded
        starts = [0]
        for size in batch_sizes[:-1]:
            starts.append(starts[-1] + size)
        self.steps = list(zip(starts, batch_sizes))
        if not padded:
            active = torch.arange(self.n) < torch.tensor(batch_sizes).unsqueeze(1)  # (T, N): step t, slot j
            time, slot = active.nonzero(as_tuple=True)  # row-major: the packed order
            sample = slot if sorted_indices is None else sorted_indices.cpu()[slot]
            self.position = (sample * self.t + time).to(device)

    def to_batch_first(self, rows: torch.Tensor) -> torch.Tensor:
        if self.padded:
            return rows.view(self.t, self.n, -1).transpose(0, 1)
        out = rows.new_zeros(self.n * self.t, rows.shape[-1])
        return out.index_copy_(0, self.position, rows).view(self.n, self.t, -1)


def _recorder(suffix_views, rows: _Rows, deliver: Callable[[LayerCapture], None], loss_reduction: str):
    """The backward step of one layer and direction: its two projections' captures for the sink."""
    ih, hh = suffix_views

    def record(g_ih, g_hh, h_prev, x):
        batch_first = {}  # an LSTM's or RNN's one G goes to both captures as one tensor (a sink shares its work)
        for view, a, g in ((ih, x, g_ih), (hh, h_prev, g_hh)):
            if not any(p is not None and p.requires_grad for p in (view.weight, view.bias)):
                continue
            if id(g) not in batch_first:
                batch_first[id(g)] = rows.to_batch_first(g)
            # G as it came and the mean's factor, which a book-keeping sink folds into norms (see LayerCapture)
            deliver(layer_capture(view, [rows.to_batch_first(a)], batch_first[id(g)], batch_size=rows.n,
                                  backprops_scale=summed_loss_scale(loss_reduction, rows.n)))

    return record


def recurrent_forward(module: nn.Module, input, hx=None, *, deliver: Optional[Callable[[LayerCapture], None]] = None,
                      loss_reduction: str = "mean", param_grads: bool = True):
    """``module(input, hx)`` for a module :func:`~fxdp.grad_sample.recurrent.recurrent_rule_applies` to, with a
    batched input (a ``(N, T, d)`` / ``(T, N, d)`` tensor or a ``PackedSequence``). In backward, each
    projection's capture goes to ``deliver``; ``param_grads=False`` leaves the parameters' ``.grad`` to the
    sink."""
    packed = isinstance(input, PackedSequence)
    lstm = module.mode == "LSTM"
    if packed:
        data, batch_sizes, sorted_indices, unsorted_indices = input
        sizes = batch_sizes.tolist()
        rows = _Rows(sizes, sorted_indices, padded=False, device=data.device)
    else:
        sorted_indices = unsorted_indices = None
        batch_sizes = None
        x = input.transpose(0, 1) if module.batch_first else input  # (T, N, d)
        rows = _Rows([x.shape[1]] * x.shape[0], None, padded=True, device=input.device)
        data = x.reshape(-1, x.shape[-1])
    n, layers, directions = rows.n, module.num_layers, 2 if module.bidirectional else 1
    if hx is None:
        zeros = torch.zeros(layers * directions, n, module.hidden_size, dtype=data.dtype, device=data.device)
        hx = (zeros, zeros) if lstm else zeros
    elif sorted_indices is not None:  # the caller's order -> longest first, as the stock module does
        hx = module.permute_hidden(hx, sorted_indices)
    module.check_forward_args(input if not packed else data, hx, batch_sizes)
    h0, c0 = hx if lstm else (hx, None)

    h_n, c_n = [], []
    for layer in range(layers):
        outs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            k = layer * directions + direction
            weights = [getattr(module, f"{w}{suffix}", None) for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            record = None if deliver is None else _recorder(projections(module, suffix), rows, deliver, loss_reduction)
            common = (rows.steps, direction == 1, record, param_grads)
            if lstm:
                out, h, c = LSTMLayer.apply(data, h0[k], c0[k], *weights, *common)
                c_n.append(c)
            elif module.mode == "GRU":
                out, h = GRULayer.apply(data, h0[k], *weights, *common)
            else:
                out, h = RNNLayer.apply(data, h0[k], *weights, *common, module.mode == "RNN_RELU")
            outs.append(out)
            h_n.append(h)
        data = outs[0] if directions == 1 else torch.cat(outs, 1)
        if module.dropout and module.training and layer < layers - 1:
            data = F.dropout(data, module.dropout, True)

    hidden = torch.stack(h_n)
    cell = torch.stack(c_n) if lstm else None
    if packed:
        output = PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)
        if unsorted_indices is not None:
            hidden = hidden.index_select(1, unsorted_indices)
            cell = cell.index_select(1, unsorted_indices) if lstm else None
    else:
        output = data.view(rows.t, n, -1)
        output = output.transpose(0, 1) if module.batch_first else output
    return output, ((hidden, cell) if lstm else hidden)

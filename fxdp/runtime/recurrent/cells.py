"""One direction of one recurrent layer as an autograd Function whose backward hands out the gradient of
every time step's gate pre-activations in one tensor.

Rows are in *packed* order: time step ``t`` owns rows ``start_t : start_t + size_t`` of every tensor,
its ``size_t`` active sequences sorted longest first (a padded batch is the case ``size_t = N`` for every
``t``). A sequence that has ended (or, in the reverse direction, not yet begun) is simply not among the
first ``size_t`` rows of the state, so its state carries over unchanged, exactly as ``nn.LSTM`` treats a
``PackedSequence``.

For step ``t`` of a layer with input ``x_t`` and previous state ``h_{t-1}``::

    LSTM, RNN:  pre_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh          (one pre-activation)
    GRU:        gx_t = x_t W_ih^T + b_ih,   gh_t = h_{t-1} W_hh^T + b_hh    (the n gate reads r * gh_n)

so the per-sample gradient of ``W_ih`` is ``G_ih^T X`` and that of ``W_hh`` is ``G_hh^T H_prev``, summed
over a sample's steps, with ``G_ih = dL/d gx`` and ``G_hh = dL/d gh`` (the same tensor for LSTM and RNN).
Backward computes ``G_ih`` and ``G_hh`` step by step, passes them to ``record(g_ih, g_hh, h_prev, x)``
and returns the input and state gradients. Parameter gradients are one product each over all steps,
or not computed at all (``param_grads=False``) when the sink forms them from the same tensors.

The forward runs the recurrence without autograd (no graph of per-step ops), writing into preallocated
buffers; the backward is written out per cell type.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

Steps = Sequence[Tuple[int, int]]  # (first row, number of active sequences) of every time step, t = 0..T-1
Recorder = Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]]


def _order(steps: Steps, reverse: bool):
    return reversed(steps) if reverse else steps


def _bias(*biases: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    present = [b for b in biases if b is not None]
    return None if not present else present[0] if len(present) == 1 else present[0] + present[1]


def _project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.addmm(bias, x, weight.t()) if bias is not None else x.mm(weight.t())


def _param_grads(ctx, first: int, g_ih, g_hh, x, h_prev) -> List[Optional[torch.Tensor]]:
    """Gradients of (w_ih, w_hh, b_ih, b_hh), inputs ``first`` to ``first + 3`` of the Function: one
    product over all steps each, when asked for."""
    need = ctx.needs_input_grad[first:first + 4] if ctx.param_grads else (False,) * 4
    return [
        g_ih.t().mm(x) if need[0] else None,
        g_hh.t().mm(h_prev) if need[1] else None,
        g_ih.sum(0) if need[2] else None,
        g_hh.sum(0) if need[3] else None,
    ]


class LSTMLayer(torch.autograd.Function):
    """``(x, h0, c0, w_ih, w_hh, b_ih, b_hh) -> (out, h_n, c_n)`` over packed rows (see the module)."""

    @staticmethod
    def forward(ctx, x, h0, c0, w_ih, w_hh, b_ih, b_hh, steps: Steps, reverse: bool, record: Recorder,
                param_grads: bool):
        hidden, n = w_hh.shape[1], h0.shape[0]
        cell = slice(2 * hidden, 3 * hidden)
        # tanh(a) = 2 sigmoid(2a) - 1, and sigmoid is the cheaper kernel: the cell gate's rows are doubled
        # so that one sigmoid per step serves all four gates
        gates = _project(x, w_ih, _bias(b_ih, b_hh))  # (L, 4h): i, f, g, o; activated in place below
        gates[:, cell].mul_(2)
        w_hh_t = w_hh.clone()
        w_hh_t[cell].mul_(2)
        w_hh_t = w_hh_t.t()
        rows, sizes = x.shape[0], [size for _, size in steps]
        out, h_prev, c_prev, tanh_c = (x.new_empty(rows, hidden) for _ in range(4))
        h, c = h0.clone(), c0.clone()
        # every step's rows as views, made once (slicing in the loop costs more than the small ops)
        g_s, out_s, hp_s, cp_s, tc_s = (t.split(sizes) for t in (gates, out, h_prev, c_prev, tanh_c))
        i_s, f_s, c_gate_s, o_s = (t.split(sizes) for t in gates.chunk(4, 1))
        for k in _order(range(len(sizes)), reverse):
            size = sizes[k]
            h_b, c_b = (h, c) if size == n else (h[:size], c[:size])
            hp_s[k].copy_(h_b)
            cp_s[k].copy_(c_b)
            g_s[k].addmm_(h_b, w_hh_t).sigmoid_()
            c_gate_s[k].mul_(2).sub_(1)
            c_b.mul_(f_s[k]).addcmul_(i_s[k], c_gate_s[k])
            torch.tanh(c_b, out=tc_s[k])
            torch.mul(o_s[k], tc_s[k], out=h_b)
            out_s[k].copy_(h_b)
        ctx.save_for_backward(x, w_ih, w_hh, gates, h_prev, c_prev, tanh_c)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads = steps, reverse, record, param_grads
        return out, h, c

    @staticmethod
    def backward(ctx, d_out, d_hn, d_cn):
        x, w_ih, w_hh, gates, h_prev, c_prev, tanh_c = ctx.saved_tensors
        hidden, n, rows = w_hh.shape[1], d_hn.shape[0], gates.shape[0]
        i, f, g, o = gates.chunk(4, 1)
        # what every step needs, computed once for all rows
        through_c = tanh_c.square().neg_().add_(1).mul_(o)  # d h / d c at fixed o
        slope = torch.addcmul(gates, gates, gates, value=-1)  # sigmoid'(pre) = s (1 - s) for i, f, o ...
        torch.mul(g, g, out=slope[:, 2 * hidden:3 * hidden]).neg_().add_(1)  # ... tanh'(pre) = 1 - g^2 for g
        # dL/d pre of i, f, g is dc times (g, c_prev, i) times the slope; of o, dh times tanh(c) times the slope
        by_dc = torch.stack([g, c_prev, i], 1).mul_(slope[:, :3 * hidden].view(rows, 3, hidden))
        by_dh = slope[:, 3 * hidden:].mul(tanh_c)
        grad = torch.empty_like(gates)
        dh, dc = d_hn.clone(), d_cn.clone()
        sizes = [size for _, size in ctx.steps]
        d_out_s, through_s, by_dc_s, by_dh_s, f_s, grad_s = (
            t.split(sizes) for t in (d_out, through_c, by_dc, by_dh, f, grad))
        grad_dc_s, grad_dh_s = grad.view(rows, 4, hidden)[:, :3].split(sizes), grad[:, 3 * hidden:].split(sizes)
        for k in _order(range(len(sizes)), not ctx.reverse):
            size = sizes[k]
            dh_b, dc_b = (dh, dc) if size == n else (dh[:size], dc[:size])
            dh_b.add_(d_out_s[k])
            dc_b.addcmul_(dh_b, through_s[k])
            torch.mul(by_dc_s[k], dc_b.unsqueeze(1), out=grad_dc_s[k])
            torch.mul(dh_b, by_dh_s[k], out=grad_dh_s[k])
            torch.mm(grad_s[k], w_hh, out=dh_b)
            dc_b.mul_(f_s[k])
        if ctx.record is not None:
            ctx.record(grad, grad, h_prev, x)
        dx = grad.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, dc, *_param_grads(ctx, 3, grad, grad, x, h_prev), None, None, None, None)


class GRULayer(torch.autograd.Function):
    """``(x, h0, w_ih, w_hh, b_ih, b_hh) -> (out, h_n)`` over packed rows; gates r, z, n as in nn.GRU."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh, steps: Steps, reverse: bool, record: Recorder,
                param_grads: bool):
        hidden, n = w_hh.shape[1], h0.shape[0]
        gates = _project(x, w_ih, b_ih)  # (L, 3h): gx, then r, z, n in place
        rows, sizes = x.shape[0], [size for _, size in steps]
        out, h_prev, gh_n = (x.new_empty(rows, hidden) for _ in range(3))
        h = h0.clone()
        w_hh_t = w_hh.t()
        out_s, hp_s, ghn_s, rz_s, new_s = (t.split(sizes) for t in (out, h_prev, gh_n, gates[:, :2 * hidden],
                                                                     gates[:, 2 * hidden:]))
        r_s, z_s = gates[:, :hidden].split(sizes), gates[:, hidden:2 * hidden].split(sizes)
        for k in _order(range(len(sizes)), reverse):
            size = sizes[k]
            h_b = h if size == n else h[:size]
            hp_s[k].copy_(h_b)
            gh = torch.addmm(b_hh, h_b, w_hh_t) if b_hh is not None else h_b.mm(w_hh_t)
            rz_s[k].add_(gh[:, :2 * hidden]).sigmoid_()
            ghn_s[k].copy_(gh[:, 2 * hidden:])
            new = new_s[k].addcmul_(r_s[k], ghn_s[k]).tanh_()
            h_b.sub_(new).mul_(z_s[k]).add_(new)  # h = n + z * (h_prev - n)
            out_s[k].copy_(h_b)
        ctx.save_for_backward(x, w_ih, w_hh, gates, h_prev, gh_n)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads = steps, reverse, record, param_grads
        return out, h

    @staticmethod
    def backward(ctx, d_out, d_hn):
        x, w_ih, w_hh, gates, h_prev, gh_n = ctx.saved_tensors
        hidden, n = w_hh.shape[1], d_hn.shape[0]
        r, z, new = gates.chunk(3, 1)
        by_dh_n = new.square().neg_().add_(1).mul_(1 - z)  # d n_pre / d h
        by_dh_z = torch.addcmul(z, z, z, value=-1).mul_(h_prev - new)  # d z_pre / d h
        by_dn_r = torch.addcmul(r, r, r, value=-1).mul_(gh_n)  # d r_pre / d n_pre
        g_ih, g_hh = torch.empty_like(gates), torch.empty_like(gates)
        dh = d_hn.clone()
        sizes = [size for _, size in ctx.steps]
        d_out_s, n_s, z_s, rr_s, r_s, zz_s, gh_s = (
            t.split(sizes) for t in (d_out, by_dh_n, by_dh_z, by_dn_r, r, z, g_hh))
        gi_r, gi_z, gi_n, gi_rz = (g_ih[:, a:b].split(sizes) for a, b in (
            (0, hidden), (hidden, 2 * hidden), (2 * hidden, 3 * hidden), (0, 2 * hidden)))
        gh_rz, gh_n_s = g_hh[:, :2 * hidden].split(sizes), g_hh[:, 2 * hidden:].split(sizes)
        for k in _order(range(len(sizes)), not ctx.reverse):
            size = sizes[k]
            dh_b = dh if size == n else dh[:size]
            dh_b.add_(d_out_s[k])
            torch.mul(dh_b, n_s[k], out=gi_n[k])
            torch.mul(dh_b, z_s[k], out=gi_z[k])
            torch.mul(gi_n[k], rr_s[k], out=gi_r[k])
            gh_rz[k].copy_(gi_rz[k])
            torch.mul(gi_n[k], r_s[k], out=gh_n_s[k])  # n_pre = gx_n + r * gh_n
            dh_b.mul_(zz_s[k]).addmm_(gh_s[k], w_hh)
        if ctx.record is not None:
            ctx.record(g_ih, g_hh, h_prev, x)
        dx = g_ih.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, *_param_grads(ctx, 2, g_ih, g_hh, x, h_prev), None, None, None, None)


class RNNLayer(torch.autograd.Function):
    """``(x, h0, w_ih, w_hh, b_ih, b_hh) -> (out, h_n)`` over packed rows; ``relu`` or tanh (nn.RNN)."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh, steps: Steps, reverse: bool, record: Recorder,
                param_grads: bool, relu: bool):
        n, sizes = h0.shape[0], [size for _, size in steps]
        out = _project(x, w_ih, _bias(b_ih, b_hh))  # (L, h): pre-activations, then h in place
        h_prev = torch.empty_like(out)
        h = h0.clone()
        w_hh_t = w_hh.t()
        out_s, hp_s = out.split(sizes), h_prev.split(sizes)
        for k in _order(range(len(sizes)), reverse):
            size = sizes[k]
            h_b = h if size == n else h[:size]
            hp_s[k].copy_(h_b)
            o_t = out_s[k].addmm_(h_b, w_hh_t)
            o_t.relu_() if relu else o_t.tanh_()
            h_b.copy_(o_t)
        ctx.save_for_backward(x, w_ih, w_hh, out, h_prev)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads, ctx.relu = steps, reverse, record, param_grads, relu
        return out.clone(), h

    @staticmethod
    def backward(ctx, d_out, d_hn):
        x, w_ih, w_hh, out, h_prev = ctx.saved_tensors
        n, sizes = d_hn.shape[0], [size for _, size in ctx.steps]
        slope = (out > 0).to(out.dtype) if ctx.relu else out.square().neg_().add_(1)
        grad = torch.empty_like(out)
        dh = d_hn.clone()
        d_out_s, slope_s, grad_s = (t.split(sizes) for t in (d_out, slope, grad))
        for k in _order(range(len(sizes)), not ctx.reverse):
            size = sizes[k]
            dh_b = dh if size == n else dh[:size]
            dh_b.add_(d_out_s[k])
            torch.mul(dh_b, slope_s[k], out=grad_s[k])
            torch.mm(grad_s[k], w_hh, out=dh_b)
        if ctx.record is not None:
            ctx.record(grad, grad, h_prev, x)
        dx = grad.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, *_param_grads(ctx, 2, grad, grad, x, h_prev), None, None, None, None, None)

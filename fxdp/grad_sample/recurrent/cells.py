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
        hidden = w_hh.shape[1]
        gates = _project(x, w_ih, _bias(b_ih, b_hh))  # (L, 4h): i, f, g, o; activated in place below
        rows = x.shape[0]
        out, h_prev, c_prev, tanh_c = (x.new_empty(rows, hidden) for _ in range(4))
        h, c = h0.clone(), c0.clone()
        w_hh_t = w_hh.t()
        for start, size in _order(steps, reverse):
            span = slice(start, start + size)
            g_t, h_b, c_b = gates[span], h[:size], c[:size]
            h_prev[span] = h_b
            c_prev[span] = c_b
            g_t.addmm_(h_b, w_hh_t)
            g_t[:, :2 * hidden].sigmoid_()
            g_t[:, 2 * hidden:3 * hidden].tanh_()
            g_t[:, 3 * hidden:].sigmoid_()
            i, f, g, o = g_t.chunk(4, 1)
            c_b.mul_(f).addcmul_(i, g)
            torch.tanh(c_b, out=tanh_c[span])
            torch.mul(o, tanh_c[span], out=h_b)
            out[span] = h_b
        ctx.save_for_backward(x, w_ih, w_hh, gates, h_prev, c_prev, tanh_c)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads = steps, reverse, record, param_grads
        return out, h, c

    @staticmethod
    def backward(ctx, d_out, d_hn, d_cn):
        x, w_ih, w_hh, gates, h_prev, c_prev, tanh_c = ctx.saved_tensors
        hidden = w_hh.shape[1]
        i, f, g, o = gates.chunk(4, 1)
        # what every step needs, computed once for all rows
        through_c = tanh_c.square().neg_().add_(1).mul_(o)  # d h / d c at fixed o
        slope = torch.addcmul(gates, gates, gates, value=-1)  # sigmoid'(pre) = s (1 - s) for i, f, o ...
        torch.mul(g, g, out=slope[:, 2 * hidden:3 * hidden]).neg_().add_(1)  # ... tanh'(pre) = 1 - g^2 for g
        by_dc = torch.stack([g, c_prev, i], 1)  # dL/di, dL/df, dL/dg are dc times these
        grad = torch.empty_like(gates)
        dh, dc = d_hn.clone(), d_cn.clone()
        for start, size in _order(ctx.steps, not ctx.reverse):
            span = slice(start, start + size)
            dh_b, dc_b, g_t = dh[:size], dc[:size], grad[span]
            dh_b.add_(d_out[span])
            dc_b.addcmul_(dh_b, through_c[span])
            torch.mul(by_dc[span], dc_b.unsqueeze(1), out=g_t[:, :3 * hidden].view(size, 3, hidden))
            torch.mul(dh_b, tanh_c[span], out=g_t[:, 3 * hidden:])
            g_t.mul_(slope[span])
            torch.mm(g_t, w_hh, out=dh_b)
            dc_b.mul_(f[span])
        if ctx.record is not None:
            ctx.record(grad, grad, h_prev, x)
        dx = grad.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, dc, *_param_grads(ctx, 3, grad, grad, x, h_prev), None, None, None, None)


class GRULayer(torch.autograd.Function):
    """``(x, h0, w_ih, w_hh, b_ih, b_hh) -> (out, h_n)`` over packed rows; gates r, z, n as in nn.GRU."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh, steps: Steps, reverse: bool, record: Recorder,
                param_grads: bool):
        hidden = w_hh.shape[1]
        gates = _project(x, w_ih, b_ih)  # (L, 3h): gx, then r, z, n in place
        rows = x.shape[0]
        out, h_prev, gh_n = (x.new_empty(rows, hidden) for _ in range(3))
        h = h0.clone()
        w_hh_t = w_hh.t()
        for start, size in _order(steps, reverse):
            span = slice(start, start + size)
            g_t, h_b = gates[span], h[:size]
            h_prev[span] = h_b
            gh = _project(h_b, w_hh, b_hh) if b_hh is not None else h_b.mm(w_hh_t)
            rz = g_t[:, :2 * hidden].add_(gh[:, :2 * hidden]).sigmoid_()
            gh_n[span] = gh[:, 2 * hidden:]
            n = g_t[:, 2 * hidden:].addcmul_(rz[:, :hidden], gh[:, 2 * hidden:]).tanh_()
            h_b.sub_(n).mul_(rz[:, hidden:]).add_(n)  # h = n + z * (h_prev - n)
            out[span] = h_b
        ctx.save_for_backward(x, w_ih, w_hh, gates, h_prev, gh_n)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads = steps, reverse, record, param_grads
        return out, h

    @staticmethod
    def backward(ctx, d_out, d_hn):
        x, w_ih, w_hh, gates, h_prev, gh_n = ctx.saved_tensors
        hidden = w_hh.shape[1]
        r, z, n = gates.chunk(3, 1)
        by_dh_n = n.square().neg_().add_(1).mul_(1 - z)  # d n_pre / d h
        by_dh_z = torch.addcmul(z, z, z, value=-1).mul_(h_prev - n)  # d z_pre / d h
        by_dn_r = torch.addcmul(r, r, r, value=-1).mul_(gh_n)  # d r_pre / d n_pre
        g_ih, g_hh = torch.empty_like(gates), torch.empty_like(gates)
        dh = d_hn.clone()
        for start, size in _order(ctx.steps, not ctx.reverse):
            span = slice(start, start + size)
            dh_b, gi, gh = dh[:size], g_ih[span], g_hh[span]
            dh_b.add_(d_out[span])
            torch.mul(dh_b, by_dh_n[span], out=gi[:, 2 * hidden:])
            torch.mul(dh_b, by_dh_z[span], out=gi[:, hidden:2 * hidden])
            torch.mul(gi[:, 2 * hidden:], by_dn_r[span], out=gi[:, :hidden])
            gh[:, :2 * hidden] = gi[:, :2 * hidden]
            torch.mul(gi[:, 2 * hidden:], r[span], out=gh[:, 2 * hidden:])  # n_pre = gx_n + r * gh_n
            dh_b.mul_(z[span]).addmm_(gh, w_hh)
        if ctx.record is not None:
            ctx.record(g_ih, g_hh, h_prev, x)
        dx = g_ih.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, *_param_grads(ctx, 2, g_ih, g_hh, x, h_prev), None, None, None, None)


class RNNLayer(torch.autograd.Function):
    """``(x, h0, w_ih, w_hh, b_ih, b_hh) -> (out, h_n)`` over packed rows; ``relu`` or tanh (nn.RNN)."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh, steps: Steps, reverse: bool, record: Recorder,
                param_grads: bool, relu: bool):
        out = _project(x, w_ih, _bias(b_ih, b_hh))  # (L, h): pre-activations, then h in place
        h_prev = torch.empty_like(out)
        h = h0.clone()
        w_hh_t = w_hh.t()
        for start, size in _order(steps, reverse):
            span = slice(start, start + size)
            h_b, o_t = h[:size], out[span]
            h_prev[span] = h_b
            o_t.addmm_(h_b, w_hh_t)
            o_t.relu_() if relu else o_t.tanh_()
            h_b.copy_(o_t)
        ctx.save_for_backward(x, w_ih, w_hh, out, h_prev)
        ctx.steps, ctx.reverse, ctx.record, ctx.param_grads, ctx.relu = steps, reverse, record, param_grads, relu
        return out.clone(), h

    @staticmethod
    def backward(ctx, d_out, d_hn):
        x, w_ih, w_hh, out, h_prev = ctx.saved_tensors
        slope = (out > 0).to(out.dtype) if ctx.relu else out.square().neg_().add_(1)
        grad = torch.empty_like(out)
        dh = d_hn.clone()
        for start, size in _order(ctx.steps, not ctx.reverse):
            span = slice(start, start + size)
            dh_b, g_t = dh[:size], grad[span]
            dh_b.add_(d_out[span])
            torch.mul(dh_b, slope[span], out=g_t)
            torch.mm(g_t, w_hh, out=dh_b)
        if ctx.record is not None:
            ctx.record(grad, grad, h_prev, x)
        dx = grad.mm(w_ih) if ctx.needs_input_grad[0] else None
        return (dx, dh, *_param_grads(ctx, 2, grad, grad, x, h_prev), None, None, None, None, None)

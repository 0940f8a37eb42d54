"""BLT's state as one flat tensor, ``buffers x`` the parameters, and its recurrence as a few operations on it.

:class:`~fxdp.optim.correlated.BufferedLinearToeplitz` keeps ``d`` buffers per trainable parameter and runs, for every
coordinate (see :mod:`.blt`)::

    w = z - (omega_1 u_1 + ... + omega_d u_d);    u_i <- theta_i u_i + w;    out += std * scale * w

:class:`FlatBuffers` keeps the buffers of all the parameters of one dtype and device as the rows of one
``(d, values)`` tensor (a "block"; one block in the usual case of parameters of one dtype on one device), each
parameter's buffers a view of its columns, and the step's unit draws in one flat tensor of the block's values. The
recurrence is then three operations on a block whatever the number of parameters: ``w.addmv_`` (the weighted sum of
the buffers, one pass over them), ``torch.addcmul`` (every buffer's decay and update, one pass) and one
``torch._foreach_add_`` of views of ``w`` to the outputs, where a loop over parameters or a ``torch._foreach_*``
call per buffer and operation ran ``3 d + 1`` passes. The values are the same recurrence's, rounded differently (the
weighted sum is a matrix-vector product, the update a fused multiply-add where the CPU has one): within a few units
in the last place of each step's, not bit for bit those of the per-parameter loop; a run resumed from a checkpoint
repeats the run that did not stop bit for bit (the same operations on the same state).

The recurrence acts coordinate by coordinate, so a block of any subset of the coordinates (an FSDP2 rank's rows)
computes those coordinates of the whole state's recurrence: under FSDP2 each rank's block is its shard's rows.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from fxdp.optim.noise import gaussian_noise_into_
from fxdp.sinks.contract import StepRefusedError


class _Block:
    """The buffers of the parameters of one dtype and device: ``state`` (d, values), parameter ``k``'s columns
    ``offsets[k] .. offsets[k] + sizes[k]``."""

    __slots__ = ("indices", "shapes", "strides", "sizes", "offsets", "state", "theta", "omega")

    def __init__(self, indices: List[int], outs: Sequence[torch.Tensor], theta: Sequence[float],
                 omega: Sequence[float]):
        first = outs[indices[0]]
        self.indices = indices
        self.shapes = [tuple(outs[k].shape) for k in indices]
        self.strides = [torch.empty(shape, device="meta").stride() for shape in self.shapes]  # (contiguous)
        self.sizes = [outs[k].numel() for k in indices]
        self.offsets = [sum(self.sizes[:j]) for j in range(len(indices))]
        self.state = torch.zeros((len(theta), sum(self.sizes)), dtype=first.dtype, device=first.device)
        self.theta = torch.tensor(theta, dtype=first.dtype, device=first.device)[:, None]
        self.omega = torch.tensor(omega, dtype=first.dtype, device=first.device)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """The parameters' views of ``flat``, a tensor of the block's values (or ``(rows, values)``: the last dim)."""
        if flat.dim() == 1 and flat.is_contiguous():  # (as_strided: the views of split().view() at less cost)
            start = flat.storage_offset()
            return [flat.as_strided(shape, stride, start + offset)
                    for shape, stride, offset in zip(self.shapes, self.strides, self.offsets)]
        lead = tuple(flat.shape[:-1])
        return [part.view(lead + shape) for part, shape in zip(flat.split(self.sizes, dim=-1), self.shapes)]


class FlatBuffers:
    """The ``d`` buffers of every trainable parameter, as one ``(d, values)`` tensor per dtype and device (see the
    module docstring). Empty until the first :meth:`step_` (or :meth:`load`)."""

    def __init__(self, theta: Sequence[float], omega: Sequence[float], label: str):
        self.theta, self.omega, self.label = tuple(theta), tuple(omega), label
        self._blocks: List[_Block] = []
        self._layout: Optional[List[Tuple[Any, ...]]] = None  # (shape, dtype, device) of each parameter's tensor
        self._order: List[Tuple[int, int]] = []  # parameter k's (block, position in the block)
        self._loaded: Optional[List[List[torch.Tensor]]] = None  # a checkpoint's buffers, until the next step

    def clear(self) -> None:
        self._blocks, self._layout, self._order, self._loaded = [], None, [], None

    def step_(self, outs: List[torch.Tensor], alpha: float, *, draws: Optional[List[torch.Tensor]],
              secure_mode: bool, generator: Optional[torch.Generator]) -> None:
        """One step of the recurrence: this step's unit draws ``z`` (drawn here as one process draws them, in the
        order of ``outs``, or ``draws``, a sharded optimizer's rows), the buffers advanced, ``alpha * w`` added to
        each of ``outs`` (nothing added when ``alpha`` is 0)."""
        if draws is not None and [tuple(d.shape) for d in draws] != [tuple(o.shape) for o in outs]:
            raise StepRefusedError(f"fxdp: the {self.label} noise was handed draws of shapes "
                                   f"{[tuple(d.shape) for d in draws]} for tensors of shapes "
                                   f"{[tuple(o.shape) for o in outs]}; report this")
        layout = [(o.shape, o.dtype, o.device) for o in outs]
        if self._layout is None:
            self._start(outs, layout)
        elif layout != self._layout:
            raise self._changed()
        ws = [torch.empty(block.state.shape[1], dtype=block.state.dtype, device=block.state.device)
              for block in self._blocks]
        if len(self._blocks) == 1:
            views = self._blocks[0].views(ws[0])
        else:
            in_blocks = [block.views(w) for block, w in zip(self._blocks, ws)]
            views = [in_blocks[b][j] for b, j in self._order]
        if draws is None:  # z: the values add_gaussian_noise_all_ adds to zero tensors of the outs' shapes
            gaussian_noise_into_(views, 1.0, secure_mode=secure_mode, generator=generator)
        else:
            for view, draw in zip(views, draws):
                view.copy_(draw)
        for block, w in zip(self._blocks, ws):
            w.addmv_(block.state.t(), block.omega, alpha=-1)  # w = z - (omega_1 u_1 + ... + omega_d u_d)
            torch.addcmul(w, block.theta, block.state, out=block.state)  # u_i <- theta_i u_i + w
        if alpha != 0:
            torch._foreach_add_(outs, views, alpha=alpha)

    def _start(self, outs: List[torch.Tensor], layout: List[Tuple[Any, ...]]) -> None:
        """The blocks for ``outs``: zero buffers, or the loaded checkpoint's (its shapes checked against ``outs``)."""
        loaded = self._loaded
        if loaded is not None and [tuple(u.shape) for u in loaded[0]] != [tuple(o.shape) for o in outs]:
            raise self._changed()  # (the checkpoint's buffers kept: a refused step changes nothing)
        groups: dict = {}
        for k, out in enumerate(outs):
            groups.setdefault((out.dtype, out.device), []).append(k)
        self._blocks = [_Block(indices, outs, self.theta, self.omega) for indices in groups.values()]
        self._order = [(0, 0)] * len(outs)
        for b, block in enumerate(self._blocks):
            for j, k in enumerate(block.indices):
                self._order[k] = (b, j)
        if loaded is not None:
            for block in self._blocks:
                for k, columns in zip(block.indices, block.views(block.state)):  # columns: (d, *shape)
                    for i, buffer in enumerate(loaded):
                        columns[i].copy_(buffer[k])
        self._layout, self._loaded = layout, None

    def _changed(self) -> StepRefusedError:
        return StepRefusedError(f"fxdp: the trainable parameters changed since the {self.label} noise began (its "
                                "state holds buffers per parameter); keep them for the whole run")

    def per_parameter(self) -> List[List[torch.Tensor]]:
        """The buffers as one list per buffer of one tensor per parameter (copies; empty before the first step)."""
        if self._loaded is not None:
            return [[t.clone() for t in buffer] for buffer in self._loaded]
        if not self._blocks:
            return []
        rows = [[block.views(block.state[i]) for block in self._blocks] for i in range(len(self.theta))]
        return [[row[b][j].clone() for b, j in self._order] for row in rows]

    def load(self, buffers: List[List[torch.Tensor]]) -> None:
        """A checkpoint's :meth:`per_parameter` (kept, copied, until the next step lays them out in blocks)."""
        self.clear()
        if buffers:
            self._loaded = [[t.clone() for t in buffer] for buffer in buffers]

    def nbytes(self) -> int:
        if self._loaded is not None:
            return sum(t.numel() * t.element_size() for buffer in self._loaded for t in buffer)
        return sum(block.state.numel() * block.state.element_size() for block in self._blocks)

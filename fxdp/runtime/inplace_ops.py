"""Out-of-place helpers the inplace pass's rewritten graph calls (``x[idx] = v`` becomes
``x = index_assign(x, idx, v)``, ...). They never write into their arguments."""

from __future__ import annotations

import torch
import torch.fx


def index_assign(x: torch.Tensor, index, value) -> torch.Tensor:
    """``x[index] = value`` out of place: a new tensor, differentiable in ``x`` and ``value``."""
    if isinstance(value, torch.Tensor):
        value = value.to(dtype=x.dtype, device=x.device)
    else:
        value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    parts = index if isinstance(index, tuple) else (index,)
    if all(isinstance(p, torch.Tensor) for p in parts):  # x[mask] = v, x[i] = v, x[i, j] = v
        return x.index_put(parts, value)
    if all(is_basic_index(p) for p in parts):  # x[:, 0] = v, x[..., 1:3] = v
        return _assign_basic(x, parts, value)
    # Mixed basic and advanced indexing: find the positions written by indexing an arange alike.
    positions = torch.arange(x.numel(), device=x.device).view(x.shape)[index]
    value = _broadcast_like_setitem(value, positions.shape)
    flat = x.reshape(-1).index_put((positions.reshape(-1),), value.reshape(-1))
    return flat.view(x.shape)


def is_basic_index(p) -> bool:
    return p is None or p is Ellipsis or isinstance(p, slice) or (isinstance(p, int) and not isinstance(p, bool))


def _broadcast_like_setitem(value: torch.Tensor, shape) -> torch.Tensor:
    # setitem accepts extra leading dimensions of size one in the value.
    while value.dim() > len(shape) and value.shape[0] == 1:
        value = value.squeeze(0)
    return value.expand(shape)


def _assign_basic(x: torch.Tensor, parts: tuple, value: torch.Tensor) -> torch.Tensor:
    """Basic indexing: one index vector per dimension of ``x`` (an open mesh) for ``index_put``."""
    consuming = sum(1 for p in parts if p is not None and p is not Ellipsis)
    if any(p is Ellipsis for p in parts):
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        parts = parts[:at] + (slice(None),) * (x.dim() - consuming) + parts[at + 1:]
    else:
        parts = parts + (slice(None),) * (x.dim() - consuming)
    value = _broadcast_like_setitem(value, x[parts].shape)
    indices, squeeze, unsqueeze = [], [], []
    region_dim = 0
    for p in parts:
        if p is None:  # a new dimension of size one in x[parts], none in x
            squeeze.append(region_dim)
            region_dim += 1
            continue
        d = len(indices)
        positions = torch.arange(x.shape[d], device=x.device)[p]
        if isinstance(p, int):  # the dimension is gone from x[parts]; the mesh keeps it, size one
            positions = positions.reshape(1)
            unsqueeze.append(d)
        else:
            region_dim += 1
        indices.append(positions)
    for dim in reversed(squeeze):
        value = value.squeeze(dim)
    for dim in unsqueeze:
        value = value.unsqueeze(dim)
    mesh = tuple(
        idx.reshape([-1 if k == d else 1 for k in range(x.dim())]) for d, idx in enumerate(indices)
    )
    return x.index_put(mesh, value)


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` out of place: ``src`` in ``dst``'s dtype and device, broadcast to its shape."""
    return src.to(dtype=dst.dtype, device=dst.device, non_blocking=non_blocking).expand(dst.shape).clone()


def random_like(dst: torch.Tensor, method: str, *args, **kwargs) -> torch.Tensor:
    """``dst.normal_(...)`` (any random fill) out of place: the fill does not read ``dst``'s values."""
    return getattr(torch.empty_like(dst), method)(*args, **kwargs)


def apply_out_of_place(x: torch.Tensor, method: str, *args, **kwargs) -> torch.Tensor:
    """``x.foo_(...)`` for an in-place method with no out-of-place twin: run it on a private copy."""
    out = x.clone()
    getattr(out, method)(*args, **kwargs)
    return out


# Re-tracing a rewritten GraphModule must keep the helpers as calls (they branch on tensor types).
for _helper in ("index_assign", "copy_into", "random_like", "apply_out_of_place"):
    torch.fx.wrap(_helper)

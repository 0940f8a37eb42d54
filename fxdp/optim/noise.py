"""The Gaussian noise of DP-SGD: from a torch generator, or — in secure mode — from the OS.

Secure mode answers two weaknesses of ``torch.normal``:

1. **Predictable randomness.** PyTorch's generators (Mersenne Twister on CPU, Philox on GPU) are not
   cryptographically secure: whoever learns or guesses the seed can subtract the noise. Secure mode
   reads every random bit from the operating system's cryptographic source (``os.urandom``: the
   kernel's CSPRNG), with no extra package.
2. **The floating-point attack** (I. Mironov, "On significance of the least significant bits for
   differential privacy", CCS 2012; shown for Gaussian samplers by N. Holohan and S. Braghin, "Secure
   random sampling in differential privacy", ESORICS 2021, arXiv:2107.10138). A sampler that maps one
   uniform double to one normal value through ``log``/``cos`` can only output a sparse, irregular set
   of doubles, and that set shifted by the true value ``x`` differs from the one shifted by a
   neighbouring ``x'``: looking at the low bits of ``x + noise`` can reveal which one it was. Holohan
   and Braghin's remedy, which we follow, adds up several independent Gaussian draws and rescales:
   the sum of ``k`` values of ``N(0, 1)`` divided by ``sqrt(k)`` is exactly ``N(0, 1)`` in law, and the
   set of doubles it can reach is dense, so no output is ruled out by its low bits. We use ``k = 4``
   (the division by ``sqrt(4) = 2`` is exact in floating point).

Each secure normal value is the Box–Muller transform of two 53-bit uniforms taken from ``os.urandom``
(one pair of uniforms gives two normals), so a secure noise value costs 4 normals = 4 uniforms' worth
of bits = 32 bytes from the OS, computed in float64 on the CPU and then moved to the parameter's device.

Cost: secure noise is drawn once per optimizer step (per logical batch, not per physical batch) and costs
far more than ``torch.normal``, about half of it reading from the OS: small next to a step's backward for
small models, comparable to it for large ones (docs/training.md, "Secure mode", has the figures).
"""

from __future__ import annotations

import math
import os
import threading
from typing import Optional

import torch

# Number of independent N(0, 1) draws summed for one secure noise value (Holohan & Braghin 2021).
SECURE_DRAWS = 4
_MANTISSA_BITS = 53  # a double's precision: uniforms on the grid k / 2**53


def secure_standard_normal(numel: int) -> torch.Tensor:
    """``numel`` independent N(0, 1) values as a float64 CPU tensor, every bit from ``os.urandom``,
    each the rescaled sum of :data:`SECURE_DRAWS` Box–Muller draws (see the module docstring)."""
    draws = numel * SECURE_DRAWS
    pairs = (draws + 1) // 2
    if pairs == 0:
        return torch.zeros(0, dtype=torch.float64)
    raw = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64)
    bits = (raw & ((1 << _MANTISSA_BITS) - 1)).to(torch.float64)  # 53 uniform bits, exact in a double
    # u1 in (0, 1] so that log(u1) is finite; u2 in [0, 1)
    u1 = (bits[:pairs] + 1.0) * 2.0 ** -_MANTISSA_BITS
    u2 = bits[pairs:] * 2.0 ** -_MANTISSA_BITS
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    normals = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:draws]
    return normals.view(SECURE_DRAWS, numel).sum(0) / math.sqrt(SECURE_DRAWS)


def gaussian_noise(
    reference: torch.Tensor,
    std: float,
    *,
    secure_mode: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Noise N(0, std^2) with the shape, dtype and device of ``reference``.

    Drawn in at least float32 (half-precision parameters get rounded noise, not half-precision draws).
    With ``generator``, the draw happens on the generator's device, so a CPU generator gives the same
    noise whatever device the parameter lives on.
    """
    draw_dtype = torch.promote_types(reference.dtype, torch.float32)
    if secure_mode:
        z = secure_standard_normal(reference.numel()).view(reference.shape)
        noise = z * std
    elif generator is not None:
        noise = torch.normal(0.0, std, size=reference.shape, generator=generator,
                             device=generator.device, dtype=draw_dtype)
    else:
        noise = torch.normal(0.0, std, size=reference.shape, device=reference.device, dtype=draw_dtype)
    return noise.to(device=reference.device, dtype=reference.dtype)


# Values drawn at a time by :func:`add_gaussian_noise_` (a multiple of 16, see there): 256 KiB of float32.
NOISE_CHUNK = 1 << 16


_BUFFERS = threading.local()  # per thread: {dtype: buffer of NOISE_CHUNK + 15 values}


def _chunk_buffer(dtype: torch.dtype) -> torch.Tensor:
    """The calling thread's buffer for chunks of noise, kept between calls: allocating 256 KiB afresh for
    every parameter costs the system calls and page faults of new memory each time (a measurable part of
    the noise draws of a small model; docs/per_sample.md, "Why some code paths look as they do")."""
    buffers = getattr(_BUFFERS, "by_dtype", None)
    if buffers is None:
        buffers = _BUFFERS.by_dtype = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() != NOISE_CHUNK + 15:
        buffer = buffers[dtype] = torch.empty(NOISE_CHUNK + 15, dtype=dtype)
    return buffer


def add_gaussian_noise_(
    out: torch.Tensor,
    std: float,
    *,
    secure_mode: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """``out += N(0, std^2)`` in place, with the very values :func:`gaussian_noise` would draw for a tensor
    of ``out``'s shape, and returns ``out``.

    Where the draw happens on the CPU, into a CPU tensor, the values are drawn :data:`NOISE_CHUNK` at a
    time into one small buffer (the calling thread's, kept between calls) instead of a whole noise tensor,
    so adding noise to a model's gradients needs no second copy of them. Torch's CPU sampler fills a tensor with uniforms in order and maps
    them to normals 16 at a time, recomputing a tail that is not a multiple of 16 from fresh uniforms;
    chunks that are multiples of 16, with a last chunk of at least 16 values, therefore give the same
    stream as one draw (checked bitwise by ``tests/optim/test_private_grads_in_place.py``). Elsewhere (secure
    mode, a GPU draw, a non-contiguous ``out``) the noise is drawn whole and added.
    """
    draw_dtype = torch.promote_types(out.dtype, torch.float32)
    draw_device = generator.device if generator is not None else out.device
    n = out.numel()
    if (secure_mode or n <= NOISE_CHUNK or draw_device.type != "cpu" or out.device.type != "cpu"
            or draw_dtype not in (torch.float32, torch.float64) or not out.is_contiguous()):
        return out.add_(gaussian_noise(out, std, secure_mode=secure_mode, generator=generator))
    flat = out.view(-1)
    buffer = _chunk_buffer(draw_dtype)
    start = 0
    while start < n:
        left = n - start
        size = left if left < NOISE_CHUNK + 16 else NOISE_CHUNK  # never leave a tail under 16 values
        part = buffer[:size].normal_(0.0, std, generator=generator)
        flat[start:start + size].add_(part if part.dtype == out.dtype else part.to(out.dtype))
        start += size
    return out


def secure_seed() -> int:
    """A 63-bit seed from the OS's cryptographic source (for generators that must be torch ones)."""
    return int.from_bytes(os.urandom(8), "little") >> 1

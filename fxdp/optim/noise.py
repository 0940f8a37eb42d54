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

import hashlib
import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

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
    noise whatever device the parameter lives on. More than :data:`NOISE_CHUNK` values drawn on the CPU
    are drawn in blocks, each from a generator of its own (see "Large draws" below).
    """
    draw_dtype = torch.promote_types(reference.dtype, torch.float32)
    draw_device = generator.device if generator is not None else reference.device
    if secure_mode:
        noise = secure_standard_normal(reference.numel()).view(reference.shape) * std
    elif _large_cpu_draw(reference.numel(), draw_device, draw_dtype) and _twister_template() is not None:
        noise = torch.empty(reference.shape, dtype=draw_dtype)
        _draw_blocks(_blocks(noise.view(-1), generator), std, add=False)
    else:
        noise = torch.normal(0.0, std, size=reference.shape, generator=generator, device=draw_device,
                             dtype=draw_dtype)
    return noise.to(device=reference.device, dtype=reference.dtype)


def add_gaussian_noise_(
    out: torch.Tensor,
    std: float,
    *,
    secure_mode: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """``out += N(0, std^2)`` in place, with the very values :func:`gaussian_noise` would draw for a tensor
    of ``out``'s shape, and returns ``out`` (:func:`add_gaussian_noise_all_` of ``[out]``)."""
    add_gaussian_noise_all_([out], std, secure_mode=secure_mode, generator=generator)
    return out


# Values of small CPU tensors' noise held at most before they are added (by one torch._foreach_add_)
_PENDING_VALUES = 1 << 20


def add_gaussian_noise_all_(
    outs: Sequence[torch.Tensor],
    std: float,
    *,
    secure_mode: bool = False,
    generator: Optional[torch.Generator] = None,
) -> None:
    """``out += N(0, std^2)`` in place for each of ``outs``.

    Drawn on the CPU (a CPU ``generator``, or none and a CPU tensor), the values are those :func:`add_gaussian_noise_`
    called on each in turn gives, the large ones drawn in parallel: a contiguous CPU tensor of more than
    :data:`NOISE_CHUNK` values gets its noise in blocks (see "Large draws" below), the blocks of all such ``outs``
    drawn together, on torch's number of threads when they hold :data:`_PARALLEL_FROM` values or more, each added a
    chunk at a time from a small buffer (its thread's, kept between calls), so adding noise to a model's gradients
    needs no second copy of them; the small ones are drawn one after the other (those of sizes multiple of 16 next
    to each other by one draw, the same values: see :data:`_ALIGNED`) and added by one ``torch._foreach_add_`` (a few
    at a time). The others (secure mode, a GPU tensor with a CPU generator, a
    non-contiguous tensor) get :func:`gaussian_noise` added, in order.

    Drawn on a GPU (a GPU ``generator``, or none and GPU tensors), all of them get their noise from one flat draw
    and one fused addition (:func:`fused_add_gaussian_noise_`, see "Device draws" below). Secure mode draws every
    value from the OS, wherever the tensors live.
    """
    blocks: List[tuple] = []
    fused: List[torch.Tensor] = []
    pending: List[torch.Tensor] = []  # small CPU tensors drawn and not yet added, with their noise
    noises: List[torch.Tensor] = []
    held = 0  # values held in noises
    run: List[tuple] = []  # small CPU tensors of sizes multiple of 16, of run_dtype, not drawn yet: (out, numel)
    run_dtype = None
    generator_device = generator.device if generator is not None else None
    for out in outs:
        draw_dtype = torch.promote_types(out.dtype, torch.float32)
        draw_device = generator_device if generator_device is not None else out.device
        if not secure_mode and (draw_device.type != "cpu" or _FUSED_ON_CPU):
            fused.append(out)  # (no CPU draw's order depends on it: it draws from another generator)
            continue
        numel = out.numel()
        small = (not secure_mode and numel <= NOISE_CHUNK and out.device.type == "cpu"
                 and draw_dtype in (torch.float32, torch.float64))
        aligned = small and numel > 0 and numel % _ALIGNED == 0
        if run and not (aligned and draw_dtype == run_dtype):
            # (drawn before anything else draws from the generator: the order of the draws is kept)
            held += _draw_run(run, run_dtype, std, generator, pending, noises)
            run = []
        if aligned:  # drawn with the run (the same values: see _ALIGNED)
            run.append((out, numel))
            run_dtype = draw_dtype
        elif small:  # gaussian_noise's draw, with less Python per tensor; the addition deferred (values unchanged)
            _draw_alone(out, std, generator, draw_dtype, pending, noises)
            held += numel
        elif (secure_mode or out.device.type != "cpu" or not out.is_contiguous()
                or not _large_cpu_draw(numel, draw_device, draw_dtype)):
            out.add_(gaussian_noise(out, std, secure_mode=secure_mode, generator=generator))
        elif _twister_template() is None:  # one stream (see below), still without a second copy of out
            _add_in_chunks(out.view(-1), std, generator)
        else:
            blocks += _blocks(out.view(-1), generator)  # the key drawn now: the generator's draws in order
        if held >= _PENDING_VALUES:
            torch._foreach_add_(pending, noises)
            pending, noises, held = [], [], 0
    if run:
        _draw_run(run, run_dtype, std, generator, pending, noises)
    if pending:
        torch._foreach_add_(pending, noises)
    _draw_blocks(blocks, std, add=True)
    if fused:
        fused_add_gaussian_noise_(fused, std, generator=generator)


def gaussian_noise_into_(
    outs: Sequence[torch.Tensor],
    std: float,
    *,
    secure_mode: bool = False,
    generator: Optional[torch.Generator] = None,
) -> None:
    """``out = N(0, std^2)`` in place for each of ``outs``: the very values :func:`add_gaussian_noise_all_` adds
    to zero tensors (the generator moved as far), written without zeroing and adding (correlated noise draws its
    unit noise so). Contiguous float32 or float64 CPU tensors drawn on the CPU are written directly; any other
    case is zeroed and handed to :func:`add_gaussian_noise_all_`."""
    direct = (not secure_mode and not _FUSED_ON_CPU and (generator is None or generator.device.type == "cpu")
              and all(out.device.type == "cpu" and out.dtype in (torch.float32, torch.float64)
                      and out.is_contiguous() for out in outs))
    if not direct:
        for out in outs:
            out.zero_()
        add_gaussian_noise_all_(outs, std, secure_mode=secure_mode, generator=generator)
        return
    blocks: List[tuple] = []
    template = _twister_template()
    for out in outs:
        if out.numel() <= NOISE_CHUNK or template is None:  # torch.normal's values (one stream, see below)
            out.normal_(0.0, std, generator=generator)
        else:
            blocks += _blocks(out.view(-1), generator)  # the key drawn now, in order, as add_gaussian_noise_all_
    _draw_blocks(blocks, std, add=False)


# Small tensors drawn together. Torch's CPU sampler fills a contiguous float32 or float64 tensor of 16 values or more
# by drawing all its uniforms in order and turning each block of 16 into normals (Box-Muller within the block; a
# size not a multiple of 16 has its last 16 values drawn again): so one draw of the total size of several tensors
# whose sizes are multiples of 16 hands each of them, value for value, what a draw of its own would, and moves the
# generator as far (tests/optim/test_noise_runs.py checks it on this torch). A model of many small parameters (the
# deep-narrow model's 66) then draws its noise by a few torch.normal calls, not one per parameter. Were a torch
# release to change its sampler, the values would differ from the per-tensor draws, not their law: the coordinates
# of one draw are independent N(0, std^2) all the same.
_ALIGNED = 16
_RUN_VALUES = 1 << 16  # a run is drawn in pieces of at most this many values (plus one tensor)


def _draw_alone(out: torch.Tensor, std: float, generator, dtype: torch.dtype, pending: List[torch.Tensor],
                noises: List[torch.Tensor]) -> None:
    """The noise of ``out`` drawn in its shape and ``dtype`` (gaussian_noise's draw), appended with ``out`` to
    ``noises`` and ``pending`` for one deferred addition."""
    noise = torch.normal(0.0, std, size=out.shape, generator=generator, dtype=dtype)
    pending.append(out)
    noises.append(noise if out.dtype == dtype else noise.to(out.dtype))


def _draw_run(run: List[tuple], dtype: torch.dtype, std: float, generator, pending: List[torch.Tensor],
              noises: List[torch.Tensor]) -> int:
    """Draw the noise of ``run`` (``[(out, its numel)]``) in ``dtype``, one torch.normal per piece of at most
    :data:`_RUN_VALUES` values, appending each out and its noise (a view of the draw) to ``pending`` and ``noises``;
    returns the values drawn."""
    start, total = 0, 0
    while start < len(run):
        stop, size = start + 1, run[start][1]
        while stop < len(run) and size + run[stop][1] <= _RUN_VALUES:
            size += run[stop][1]
            stop += 1
        part = run[start:stop]
        if len(part) == 1:  # (alone: drawn in its shape, as gaussian_noise draws it)
            _draw_alone(part[0][0], std, generator, dtype, pending, noises)
            total, start = total + size, stop
            continue
        flat = torch.normal(0.0, std, size=(size,), generator=generator, dtype=dtype)
        for (out, _), noise in zip(part, flat.split([numel for _, numel in part])):
            pending.append(out)
            noise = noise if out.dim() == 1 else noise.view(*out.shape)  # (view(torch.Size) costs twice view(*ints))
            noises.append(noise if out.dtype == dtype else noise.to(out.dtype))
        total += size
        start = stop
    return total


# --- Device draws: one flat draw, one fused addition ----------------------------------------------------------
#
# On a GPU, one torch.normal and one add_ per parameter are two kernel launches per parameter, and the launches,
# not the arithmetic, set the time of a model of many small parameters. There the noise of all the parameters is
# drawn by one torch.normal of their total size and added by one torch._foreach_add_ of views of it (one call per
# group of tensors of the same device and dtype, a few launches of torch's fused kernels): values N(0, std^2),
# independent between tensors and steps as the coordinates of one draw are, repeating from a seeded generator. They
# are not the values of one draw per tensor (torch's GPU sampler hands each draw a fresh offset of its stream).
# The flat draw is a second copy of the gradients for a moment, at the step, when the activations are freed;
# more than DEVICE_DRAW_VALUES values are drawn in several flat draws, to bound it.

DEVICE_DRAW_VALUES = 1 << 27  # values of one flat draw at most (512 MiB in float32): GPT-2 small's 124M in one
_FUSED_ON_CPU = False  # tests set it: CPU draws take the device route too (CPU values otherwise never do)


def fused_add_gaussian_noise_(
    outs: Sequence[torch.Tensor],
    std: float,
    *,
    generator: Optional[torch.Generator] = None,
) -> None:
    """``out += N(0, std^2)`` in place for each of ``outs``, from one flat draw and one ``torch._foreach_add_``
    per group of tensors of the same device and dtype (see "Device draws" above); the route of GPU draws, callable
    on CPU tensors (tests do). Drawn on the generator's device (else each group's), in at least float32, in the
    order of the groups' first tensors, a group cut in draws of at most :data:`DEVICE_DRAW_VALUES` values."""
    groups: dict = {}
    for out in outs:
        groups.setdefault((out.device, out.dtype), []).append(out)
    for (device, dtype), group in groups.items():
        draw_dtype = torch.promote_types(dtype, torch.float32)
        draw_device = generator.device if generator is not None else device
        for part in _parts_of_at_most(group, DEVICE_DRAW_VALUES):
            sizes = [out.numel() for out in part]
            flat = torch.normal(0.0, std, size=(sum(sizes),), generator=generator, device=draw_device,
                                dtype=draw_dtype)
            if flat.device != device or flat.dtype != dtype:
                flat = flat.to(device=device, dtype=dtype)
            torch._foreach_add_(part, [view.view(out.shape) for view, out in zip(flat.split(sizes), part)])


def _parts_of_at_most(tensors: List[torch.Tensor], values: int) -> List[List[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``values`` values in all (a larger tensor alone)."""
    parts: List[List[torch.Tensor]] = [[]]
    held = 0
    for t in tensors:
        if parts[-1] and held + t.numel() > values:
            parts.append([])
            held = 0
        parts[-1].append(t)
        held += t.numel()
    return [part for part in parts if part]


# --- Large draws: blocks from generators of their own, in parallel -----------------------------------------
#
# Torch's CPU sampler is one Mersenne Twister (MT19937), drawn on one thread: 16 million values take about
# 55 ms on this project's CPU, 0.3 of a plain GPT-2-4L fine-tuning step there with two threads, whose matrix
# products use both cores. More than NOISE_CHUNK values drawn on the CPU are therefore cut into blocks of up to
# NOISE_BLOCK values, each drawn by a Mersenne Twister of its own, and the blocks are spread over
# torch.get_num_threads() threads. A block's generator does not depend on the number of threads, so neither do
# the values.
#
# A block's generator gets a whole 624-word state (19,968 bits), not a seed: torch seeds a Mersenne Twister
# from 32 bits only, and blocks seeded from 32-bit draws would, over a long training run, meet the same seed
# twice (among a million blocks, about a hundred pairs), adding the same noise to two blocks of gradient, whose
# difference the noise then no longer hides. Each tensor's draw takes a 248-bit key from the caller's
# generator (or torch's default one, so torch.manual_seed still makes a run repeat), and block k's state is the
# k-th 624 words of SHAKE-256's output for the key: distinct blocks get unrelated states unless two keys meet
# (about 2^-124 per pair). Torch takes a whole state only as the bytes of Generator.get_state(); where those
# do not hold the 624 words where this torch keeps them (checked once, by rebuilding a known seed's state and
# comparing draws), every draw is one stream from the caller's generator, on one thread.

# Values up to which a CPU draw is one stream from the caller's generator (a multiple of 16, see _add_in_chunks)
NOISE_CHUNK = 1 << 16
# Values of one block drawn by a generator of its own: making one costs about 17 us, 2% of drawing the block
NOISE_BLOCK = 1 << 18
# Values a block's thread draws and adds at a time: the largest multiple of 16 under torch's grain for splitting
# an elementwise operation across threads (32,768), so that each addition runs on the block's own thread
_BLOCK_CHUNK = (1 << 15) - 16
# Fewer values than this are drawn on the calling thread, block after block (the same values): right after the
# step's matrix products, torch's OpenMP threads keep spinning on the other cores for a while, and a draw this
# small was measured no faster on two threads (about 1.7 times faster with the other core free)
_PARALLEL_FROM = 1 << 21
_TWISTER_WORDS = 624  # MT19937's state: 624 words of 32 bits
_WORDS_AT = 24  # in torch's CPU generator state: after the seed (8 bytes), two ints and `next` (8), as 624 uint64
_UNCHECKED = object()
_TEMPLATE = _UNCHECKED  # a CPU generator state whose words can be replaced; None where they cannot
_POOL: dict = {}  # {"pid": process id, "threads": n, "pool": ThreadPoolExecutor}
_BUFFERS = threading.local()  # per thread: {dtype: buffer of _BLOCK_CHUNK + 15 values}


def _large_cpu_draw(n: int, draw_device: torch.device, draw_dtype: torch.dtype) -> bool:
    """Whether a draw is of more than :data:`NOISE_CHUNK` values of a float32 or float64 on the CPU: drawn in
    blocks, each from a generator of its own (where this torch's generator state is understood)."""
    return n > NOISE_CHUNK and draw_device.type == "cpu" and draw_dtype in (torch.float32, torch.float64)


def _blocks(flat: torch.Tensor, generator: Optional[torch.Generator]) -> List[tuple]:
    """``[(part of flat, its generator), ...]``: ``flat`` cut into blocks of :data:`NOISE_BLOCK` values, block
    k's generator's state the k-th 624 words of the SHAKE-256 output for a key drawn from ``generator`` (torch's
    default CPU generator if None; see the comment above)."""
    key = struct.pack("<4q", *torch.randint(0, 2 ** 62, (4,), generator=generator).tolist())
    starts = range(0, flat.numel(), NOISE_BLOCK)
    digest = hashlib.shake_256(key).digest(4 * _TWISTER_WORDS * len(starts))  # block k: its k-th 624 words
    words = torch.frombuffer(bytearray(digest), dtype=torch.int32).to(torch.int64).view(len(starts), -1) & 0xFFFFFFFF
    words[:, 0] = 0x80000000  # of word 0 only the top bit counts; set, the state is never all zero
    template = _twister_template()
    return [(flat[start:start + NOISE_BLOCK], _generator_from_words(template, w)) for start, w in zip(starts, words)]


def _draw_blocks(blocks: List[tuple], std: float, *, add: bool) -> None:
    """Each block ``+=`` (``add``) or ``=`` N(0, std^2) drawn from its own generator, on up to
    ``torch.get_num_threads()`` threads (from :data:`_PARALLEL_FROM` values on)."""

    def draw(block: tuple) -> None:
        part, generator = block
        if add:
            _add_in_chunks(part, std, generator)
        else:
            part.normal_(0.0, std, generator=generator)

    threads = min(torch.get_num_threads(), len(blocks))
    if threads <= 1 or sum(part.numel() for part, _ in blocks) < _PARALLEL_FROM:
        for block in blocks:
            draw(block)
    else:
        list(_pool(threads).map(draw, blocks))


def _add_in_chunks(flat: torch.Tensor, std: float, generator: Optional[torch.Generator]) -> None:
    """``flat += N(0, std^2)``, drawn :data:`_BLOCK_CHUNK` values at a time into the calling thread's buffer.

    Torch's CPU sampler fills a tensor with uniforms in order and maps them to normals 16 at a time,
    recomputing a tail that is not a multiple of 16 from fresh uniforms: chunks that are multiples of 16, with
    a last chunk of at least 16 values, give the values one draw of ``flat``'s size gives (checked bitwise by
    ``tests/optim/test_private_grads_in_place.py``)."""
    draw_dtype = torch.promote_types(flat.dtype, torch.float32)
    buffer = _chunk_buffer(draw_dtype)
    n, start = flat.numel(), 0
    while start < n:
        left = n - start
        size = left if left < _BLOCK_CHUNK + 16 else _BLOCK_CHUNK  # never leave a tail under 16 values
        part = buffer[:size].normal_(0.0, std, generator=generator)
        flat[start:start + size].add_(part if part.dtype == flat.dtype else part.to(flat.dtype))
        start += size


def _chunk_buffer(dtype: torch.dtype) -> torch.Tensor:
    """The calling thread's buffer for chunks of noise, kept between calls: allocating it afresh for every
    block costs the system calls and page faults of new memory each time (a measurable part of the noise
    draws of a small model; docs/per_sample.md, "Why some code paths look as they do")."""
    buffers = getattr(_BUFFERS, "by_dtype", None)
    if buffers is None:
        buffers = _BUFFERS.by_dtype = {}
    buffer = buffers.get(dtype)
    if buffer is None:
        buffer = buffers[dtype] = torch.empty(_BLOCK_CHUNK + 15, dtype=dtype)
    return buffer


def _pool(threads: int) -> ThreadPoolExecutor:
    """This process's threads for drawing blocks, made again after a fork (whose child has none of them) and when
    torch's number of threads changes (the former pool, no longer referenced, lets its threads go)."""
    if _POOL.get("pid") != os.getpid() or _POOL.get("threads") != threads:
        _POOL.update(pid=os.getpid(), threads=threads,
                     pool=ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fxdp-noise"))
    return _POOL["pool"]


def _generator_from_words(template: torch.Tensor, words: torch.Tensor) -> torch.Generator:
    """A CPU generator whose Mersenne Twister state is ``words`` (624 values in [0, 2^32), int64)."""
    state = template.clone()
    state[_WORDS_AT:_WORDS_AT + 8 * _TWISTER_WORDS].view(torch.int64).copy_(words)
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _twister_init_words(seed: int) -> List[int]:
    """The 624 words MT19937's reference initialisation (init_genrand) makes of a 32-bit seed."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, _TWISTER_WORDS):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


def _twister_template() -> Optional[torch.Tensor]:
    """Torch's CPU generator state, freshly seeded, if its 624 words sit where :data:`_WORDS_AT` says (a state
    rebuilt from a known seed's words must draw what that seed draws); None otherwise. Checked once."""
    global _TEMPLATE
    if _TEMPLATE is _UNCHECKED:
        template, seed = torch.Generator().manual_seed(0).get_state(), 20261204
        _TEMPLATE = None
        if template.dtype == torch.uint8 and template.numel() >= _WORDS_AT + 8 * _TWISTER_WORDS:
            try:
                rebuilt = _generator_from_words(template, torch.tensor(_twister_init_words(seed)))
            except RuntimeError:  # a state this torch refuses
                rebuilt = None
            known = torch.Generator().manual_seed(seed)
            if rebuilt is not None and torch.equal(torch.randn(1000, generator=rebuilt),
                                                   torch.randn(1000, generator=known)):
                _TEMPLATE = template
    return _TEMPLATE


def secure_seed() -> int:
    """A 63-bit seed from the OS's cryptographic source (for generators that must be torch ones)."""
    return int.from_bytes(os.urandom(8), "little") >> 1

"""Large noise draws on the CPU (fxdp/optim/noise.py, "Large draws"): cut into blocks, each drawn by a Mersenne
Twister whose whole state comes from a key the caller's generator gives, the blocks in parallel. What must hold:
the values are N(0, std^2), independent between blocks, tensors and steps; they do not depend on the number of
threads; the caller's generator (or torch.manual_seed) makes them repeat; and where this torch's generator state
is not understood, the draw is one stream from the caller's generator."""

from __future__ import annotations

import math
import multiprocessing
import os
import time

import pytest
import torch

import fxdp.optim.noise as noise
from fxdp.optim.noise import NOISE_BLOCK, NOISE_CHUNK, add_gaussian_noise_, add_gaussian_noise_all_, gaussian_noise

LARGE = 9 * NOISE_BLOCK + 17  # enough values to be drawn on several threads (smaller draws use the calling one)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _draw(n, seed, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return add_gaussian_noise_(torch.zeros(n), 1.0, generator=torch.Generator().manual_seed(seed))
    finally:
        torch.set_num_threads(before)


def test_the_generator_state_of_this_torch_is_understood():
    """The fast path is on: a state rebuilt from a known seed's 624 words draws what that seed draws. If a torch
    release moves its state, this fails (and the draws fall back to one stream, see the last test)."""
    assert noise._twister_template() is not None


@pytest.mark.parametrize("n", [NOISE_CHUNK + 1, 3 * NOISE_BLOCK + 17, LARGE])
def test_the_values_do_not_depend_on_the_number_of_threads(n):
    assert LARGE >= noise._PARALLEL_FROM
    one, two, three = _draw(n, 7, 1), _draw(n, 7, 2), _draw(n, 7, 3)
    assert torch.equal(one, two) and torch.equal(one, three)


def test_the_noise_repeats_from_a_seeded_generator_or_torch_manual_seed(two_threads):
    n = 2 * NOISE_BLOCK + 5
    assert torch.equal(_draw(n, 3, 2), _draw(n, 3, 2))
    assert not torch.equal(_draw(n, 3, 2), _draw(n, 4, 2))
    torch.manual_seed(11)
    first = add_gaussian_noise_(torch.zeros(n), 1.0)
    second = add_gaussian_noise_(torch.zeros(n), 1.0)
    torch.manual_seed(11)
    assert torch.equal(add_gaussian_noise_(torch.zeros(n), 1.0), first)
    assert not torch.equal(first, second)


def test_many_tensors_at_once_get_what_each_in_turn_gets(two_threads):
    """The optimizer adds the noise of all parameters in one call; the values are those of one call per
    parameter in order, small tensors (one stream from the generator) and large ones (blocks) interleaved."""
    sizes = [10, 3 * NOISE_BLOCK + 100, NOISE_CHUNK, NOISE_CHUNK + 16, 7, NOISE_BLOCK, LARGE]
    together = [torch.zeros(n) for n in sizes]
    add_gaussian_noise_all_(together, 0.5, generator=torch.Generator().manual_seed(2))
    generator = torch.Generator().manual_seed(2)
    one_by_one = [add_gaussian_noise_(torch.zeros(n), 0.5, generator=generator) for n in sizes]
    for a, b in zip(together, one_by_one):
        assert torch.equal(a, b)
    later = add_gaussian_noise_(torch.zeros(4), 0.5, generator=generator)  # the generator moved as far as in turn
    follow = torch.Generator().manual_seed(2)
    add_gaussian_noise_all_([torch.zeros(n) for n in sizes], 0.5, generator=follow)
    assert torch.equal(add_gaussian_noise_(torch.zeros(4), 0.5, generator=follow), later)


def test_blocks_are_independent_standard_normals(two_threads):
    """Each block of a draw, and the same block of the next draw, is N(0, 1) by a Kolmogorov-Smirnov bound at
    the 0.1% level (1.95 / sqrt(n)), and the correlation of any two blocks is within 4.5 standard errors of 0
    (1 / sqrt(n) each: 21 pairs, so a false failure has probability under 1e-4)."""
    generator = torch.Generator().manual_seed(0)
    draws = [gaussian_noise(torch.zeros(3 * NOISE_BLOCK), 1.0, generator=generator).double() for _ in range(2)]
    blocks = [b for d in draws for b in d.split(NOISE_BLOCK)]
    n = NOISE_BLOCK
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    for block in blocks:
        cdf = torch.special.ndtr(block.sort().values)
        assert (cdf - grid).abs().max() < 1.95 / math.sqrt(n)
        assert abs(block.mean()) < 4.5 / math.sqrt(n) and abs(block.var() - 1) < 4.5 * math.sqrt(2 / n)
    for i in range(len(blocks)):
        for j in range(i + 1, len(blocks)):
            r = torch.corrcoef(torch.stack([blocks[i], blocks[j]]))[0, 1]
            assert abs(r) < 4.5 / math.sqrt(n), (i, j, float(r))


def test_no_block_repeats_another_or_the_generators_own_stream(two_threads):
    """A block's generator is not a 32-bit seed's (torch seeds from 32 bits, which meet again over a long run):
    its state words do not follow the Mersenne Twister's seeding recurrence, as any seed's do; and no block of 300
    draws starts like another, nor like the caller's generator's own stream."""
    for _, block_generator in noise._blocks(torch.zeros(3 * NOISE_BLOCK), torch.Generator().manual_seed(5)):
        state = block_generator.get_state()
        words = state[noise._WORDS_AT:noise._WORDS_AT + 8 * 624].view(torch.int64).tolist()
        assert words[1:] != noise._twister_init_words(words[0])[1:] and len(set(words)) > 600
    seeded = torch.Generator().manual_seed(1234).get_state()[noise._WORDS_AT:noise._WORDS_AT + 8 * 624]
    assert seeded.view(torch.int64).tolist() == noise._twister_init_words(1234)  # (what the check reads)
    generator = torch.Generator().manual_seed(5)
    own = torch.normal(0.0, 1.0, size=(16,), generator=torch.Generator().manual_seed(5))
    starts = {tuple(own.tolist())}
    for _ in range(300):
        draw = gaussian_noise(torch.zeros(2 * NOISE_BLOCK), 1.0, generator=generator)
        for block in draw.split(NOISE_BLOCK):
            starts.add(tuple(block[:16].tolist()))
    assert len(starts) == 1 + 600


def test_a_child_process_forked_after_a_draw_draws_too(two_threads):
    """The threads that draw blocks do not survive a fork: the child makes its own (else it would wait forever)."""
    add_gaussian_noise_(torch.zeros(LARGE), 1.0)
    assert noise._POOL.get("pid") == os.getpid()  # the parent drew on its threads
    context = multiprocessing.get_context("fork")
    child = context.Process(target=add_gaussian_noise_, args=(torch.zeros(LARGE), 1.0))
    child.start()
    child.join(120)
    assert child.exitcode == 0


def test_a_new_number_of_threads_lets_the_former_threads_go():
    """The pool is made again when torch's number of threads changes; the former ones' threads must not pile up."""
    import threading

    def noise_threads():
        return sum(t.name.startswith("fxdp-noise") for t in threading.enumerate())

    for threads in (2, 3, 2, 3):
        _draw(LARGE, 0, threads)
    deadline = time.monotonic() + 30
    while noise_threads() > 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert noise_threads() <= 3


def test_where_the_generator_state_is_not_understood_the_draw_is_one_stream(monkeypatch):
    monkeypatch.setattr(noise, "_TEMPLATE", None)
    n = NOISE_BLOCK + NOISE_CHUNK + 3
    want = torch.normal(0.0, 0.5, size=(n,), generator=torch.Generator().manual_seed(9))
    got = add_gaussian_noise_(torch.zeros(n), 0.5, generator=torch.Generator().manual_seed(9))
    assert torch.equal(got, want)
    assert torch.equal(gaussian_noise(torch.zeros(n), 0.5, generator=torch.Generator().manual_seed(9)), want)


@pytest.mark.parametrize("understood", [True, False])
def test_noise_written_into_tensors_is_what_would_be_added_to_zeros(monkeypatch, understood, two_threads):
    """gaussian_noise_into_ (correlated noise's unit draws) writes the values add_gaussian_noise_all_ adds to zero
    tensors, and moves the generator as far: small and large tensors, float32 and float64, a non-contiguous one
    (zeroed and added), whatever the tensors held before; also where the generator state is not understood."""
    if not understood:
        monkeypatch.setattr(noise, "_TEMPLATE", None)
    shapes = [(10,), (3 * NOISE_BLOCK + 100,), (NOISE_CHUNK,), (NOISE_CHUNK + 16,), (7, 3), (LARGE,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32, torch.float32]
    for transposed in (False, True):
        zeros = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
        filled = [torch.full(s, 3.0, dtype=d) for s, d in zip(shapes, dtypes)]
        if transposed:  # one non-contiguous tensor: all of them take the zero-and-add route
            filled[4] = torch.full((3, 7), 3.0).t()
        added, written = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        add_gaussian_noise_all_(zeros, 0.5, generator=added)
        noise.gaussian_noise_into_(filled, 0.5, generator=written)
        assert all(torch.equal(a, b) for a, b in zip(zeros, filled))
        assert torch.equal(torch.randn(4, generator=added), torch.randn(4, generator=written))

"""Host copies: one memcpy for small ones, worker threads off the loop for large host reads."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

import mmcache.host_copy as host_copy
from mmcache import FeatureCache
from mmcache.host_copy import PARALLEL_COPY_BYTES, HostCopier, copy_host_bytes

MiB = 1 << 20


class Memmoves:
    """Stands in for the copier's memcpy: records each call's thread and span, and can
    hold every call until released, or fail one."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []  # (thread, dst, src, size)
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_at: int | None = None  # the dst address whose copy raises
        self.real: Callable[[int, int, int], object] = host_copy._memmove

    def __call__(self, dst: int, src: int, size: int) -> object:
        with self.lock:
            self.calls.append((threading.get_ident(), dst, src, size))
        self.started.set()
        self.gate.wait(10)
        if dst == self.fail_at:
            raise OSError("simulated copy failure")
        return self.real(dst, src, size)

    def threads(self) -> set[int]:
        return {thread for thread, *_ in self.calls}


@pytest.fixture
def memmoves(monkeypatch: pytest.MonkeyPatch) -> Iterator[Memmoves]:
    fake = Memmoves()
    monkeypatch.setattr(host_copy, "_memmove", fake)
    yield fake
    fake.gate.set()  # never leave a worker parked


@pytest.fixture(autouse=True)
def sixteen_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces a copy is split into depend on the cores: these tests assume 16 (the H200
    host's), whatever this machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


async def wait_until(done: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


# --- copy_host_bytes --------------------------------------------------------------------


def test_copy_host_bytes_copies_views_exactly() -> None:
    arena = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    src = arena[1024:3072].view(torch.int32)  # a view at an offset, as a block's rows are
    dst = torch.full((512,), -1, dtype=torch.int32)
    copy_host_bytes(dst, src)
    assert torch.equal(dst, torch.arange(256, 768, dtype=torch.int32))
    copy_host_bytes(torch.empty(0), torch.empty(0))  # nothing to copy is no error


BAD_PAIRS = [
    (torch.zeros(8), torch.ones(9), "36 bytes into a 32-byte"),
    (torch.zeros(4, 4), torch.ones(4, 4).t(), "source must be a contiguous host"),
    (torch.empty(8, device="meta"), torch.ones(8), "destination must be a contiguous host"),
]


@pytest.mark.parametrize(("dst", "src", "match"), BAD_PAIRS)
def test_copy_host_bytes_refuses_what_one_memcpy_cannot_copy(
    dst: torch.Tensor, src: torch.Tensor, match: str
) -> None:
    before = dst.clone() if dst.device.type == "cpu" else None
    with pytest.raises(ValueError, match=match):
        copy_host_bytes(dst, src)
    if before is not None:
        assert torch.equal(dst, before)  # refused before a byte moved


# --- HostCopier ---------------------------------------------------------------------------


async def test_a_small_copy_runs_at_once_on_the_calling_thread(memmoves: Memmoves) -> None:
    copier = HostCopier(4)
    src = random_bytes(PARALLEL_COPY_BYTES - 1)
    dst = torch.zeros_like(src)
    assert copier.copy(dst, src) is None
    assert torch.equal(dst, src)
    assert memmoves.threads() == {threading.get_ident()} and len(memmoves.calls) == 1
    copier.close()


async def test_a_large_copy_is_split_over_the_workers_while_the_loop_runs(
    memmoves: Memmoves,
) -> None:
    copier = HostCopier(4)
    src = random_bytes(8 * MiB + 12345, seed=1)  # not a whole number of pages
    dst = torch.zeros_like(src)
    memmoves.gate.clear()
    copying = copier.copy(dst, src)
    assert copying is not None and copier.copies_in_flight == 1
    await asyncio.sleep(0.01)  # the loop runs while the pieces are held
    assert not copying.done()
    memmoves.gate.set()
    await copying
    assert torch.equal(dst, src)
    assert copier.copies_in_flight == 0
    assert threading.get_ident() not in memmoves.threads()
    spans = sorted((d - dst.data_ptr(), s - src.data_ptr(), n) for _, d, s, n in memmoves.calls)
    assert len(spans) == 4
    assert all(d == s and d % 4096 == 0 for d, s, _ in spans)  # same offset, page-aligned
    assert [d for d, _, _ in spans[1:]] == [d + n for d, _, n in spans[:-1]]  # no gap
    assert spans[-1][0] + spans[-1][2] == src.nbytes
    copier.close()


async def test_no_piece_is_smaller_than_a_piece_size(memmoves: Memmoves) -> None:
    copier = HostCopier(8, parallel_bytes=1, piece_bytes=1 * MiB)
    src = random_bytes(3 * MiB, seed=2)
    dst = torch.zeros_like(src)
    copying = copier.copy(dst, src)
    assert copying is not None
    await copying
    assert torch.equal(dst, src)
    assert sorted(n for *_, n in memmoves.calls) == [MiB] * 3  # 3 pieces, not 8
    copier.close()


@pytest.mark.parametrize("closed", [False, True])
async def test_without_workers_a_large_copy_runs_at_once(memmoves: Memmoves, closed: bool) -> None:
    copier = HostCopier(4 if closed else 0)
    if closed:
        copier.close()
    src = random_bytes(PARALLEL_COPY_BYTES, seed=3)
    dst = torch.zeros_like(src)
    assert copier.copy(dst, src) is None
    assert torch.equal(dst, src)
    assert memmoves.threads() == {threading.get_ident()}


async def test_a_failed_piece_fails_the_copy_after_every_piece_ended(memmoves: Memmoves) -> None:
    copier = HostCopier(4)
    src = random_bytes(4 * MiB, seed=4)
    dst = torch.zeros_like(src)
    memmoves.fail_at = dst.data_ptr()  # the first piece
    copying = copier.copy(dst, src)
    assert copying is not None
    with pytest.raises(OSError, match="simulated copy failure"):
        await copying
    assert len(memmoves.calls) == 4  # the others ran, and are not reported as done early
    assert torch.equal(dst[MiB:], src[MiB:]) and copier.copies_in_flight == 0
    copier.close()


@pytest.mark.parametrize(("dst", "src", "match"), BAD_PAIRS)
async def test_the_copier_refuses_bad_pairs_before_a_byte_moves(
    memmoves: Memmoves, dst: torch.Tensor, src: torch.Tensor, match: str
) -> None:
    copier = HostCopier(4, parallel_bytes=1)
    with pytest.raises(ValueError, match=match):
        copier.copy(dst, src)
    assert memmoves.calls == [] and copier.copies_in_flight == 0
    copier.close()


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (4, 3), (16, 4)])
async def test_the_workers_leave_a_core_to_the_loop(
    monkeypatch: pytest.MonkeyPatch, memmoves: Memmoves, cores: int, workers: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    copier = HostCopier(4)
    src = random_bytes(8 * MiB, seed=5)
    dst = torch.zeros_like(src)
    copying = copier.copy(dst, src)
    assert copying is not None  # off the loop even on one core: the loop keeps its turns
    await copying
    assert torch.equal(dst, src)
    assert copier.workers == workers and len(memmoves.calls) == workers
    copier.close()


@pytest.mark.parametrize(("threads", "piece"), [(-1, MiB), (1, 0)])
def test_the_copier_refuses_bad_settings(threads: int, piece: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        HostCopier(threads, piece_bytes=piece)


# --- host reads through the cache -------------------------------------------------------


def large_feature(rig: Rig, seed: int = 0) -> torch.Tensor:
    """A 4 MiB feature (1,024 rows of 4 KiB): a host read of it goes to the workers."""
    return rig.tensor(1024, 1024, dtype=torch.float32, seed=seed)


async def put_on_host(cache: FeatureCache, rig: Rig, key: str) -> torch.Tensor:
    """Put a large feature into a cache without a GPU tier; return a copy to compare with."""
    t = large_feature(rig, seed=7)
    expected = t.cpu().clone()
    assert await cache.put(key, t)
    del t
    await cache.drain()
    assert cache.stats().cpu_entries == 1
    return expected


@pytest.mark.parametrize("rows", [None, slice(0, 700), slice(5, 9)])
async def test_a_large_host_read_is_copied_off_the_loop_and_exact(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves, rows: slice | None
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    memmoves.calls.clear()
    out = await cache.get("k", device="cpu", rows=rows)
    assert_exact(out, expected if rows is None else expected[rows])
    assert out is not None and out.is_pinned() == (rig.kind == "cuda")
    nbytes = out.nbytes
    large = nbytes >= PARALLEL_COPY_BYTES
    assert (threading.get_ident() not in memmoves.threads()) == large
    assert len(memmoves.calls) == (min(4, nbytes // MiB) if large else 1)


async def test_a_read_cancelled_mid_copy_keeps_its_block_until_the_copy_ends(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    await put_on_host(cache, rig, "k")
    used = cache.stats().cpu_bytes
    memmoves.gate.clear()
    memmoves.started.clear()
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    await wait_until(memmoves.started.is_set)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert cache.discard("k")
    await cache.drain()
    # The workers still read the block: it must not go back to the pool, where a put
    # could overwrite it under them.
    assert cache.stats().cpu_bytes == used
    memmoves.gate.set()
    await wait_until(lambda: cache.stats().cpu_bytes == 0)
    assert cache.stats().leaked_bytes == 0


async def test_reads_in_flight_at_close_finish(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    memmoves.gate.clear()
    memmoves.started.clear()
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    await wait_until(memmoves.started.is_set)
    closing = asyncio.create_task(cache.close(timeout=5))
    await asyncio.sleep(0.01)
    memmoves.gate.set()
    await closing
    assert_exact(await reader, expected)

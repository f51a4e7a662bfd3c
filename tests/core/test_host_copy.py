"""Host copies: one memcpy for small host reads, a slice per loop turn for large ones."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from collections.abc import Callable

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

import mmcache.host_copy as host_copy
from mmcache import FeatureCache
from mmcache.host_copy import SLICE_BYTES, copy_host_bytes, copy_host_bytes_in_slices

MiB = 1 << 20


class Copies:
    """Stands in for the memcpy and for torch's parallel copy: records each call's span,
    kind and the loop turns seen so far, runs a hook after a chosen call, and sets how
    many threads a copy may use. Its clock moves by memmove_takes per memcpy call, by
    parallel_takes per parallel one (0 unless a test sets them) and by idle(); copies start
    in a burst that has woken torch's threads: with threads, copies use them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int, int]] = []  # (dst, src, size, turns so far)
        self.kinds: list[str] = []
        self.turns = 0  # advanced by a ticker task while the loop runs other work
        self.after_call: dict[int, Callable[[], object]] = {}
        self.real_memmove: Callable[[int, int, int], object] = host_copy._memmove
        self.real_parallel: Callable[[torch.Tensor, torch.Tensor], None] = host_copy._parallel_copy
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(host_copy, "_memmove", self.memmove)
        monkeypatch.setattr(host_copy, "_parallel_copy", self.parallel)
        self.now = 1000.0
        self.memmove_takes = 0.0
        self.parallel_takes = 0.0
        self.takes_at: dict[int, float] = {}  # the n-th call's time, for a parallel one
        monkeypatch.setattr(host_copy, "_now", lambda: self.now)
        monkeypatch.setattr(host_copy, "_recent", host_copy._Recent())
        host_copy._recent.copy_ended = self.now
        host_copy._recent.burst_bytes = host_copy.BURST_PARALLEL_FROM_BYTES
        host_copy._recent.parallel_ended = self.now
        self.use_threads(1)

    def idle(self, seconds: float) -> None:
        self.now += seconds

    def asleep(self) -> None:
        """No copy for long: torch's threads sleep."""
        host_copy._recent.copy_ended = -math.inf

    def use_threads(self, threads: int) -> None:
        self.monkeypatch.setattr(host_copy, "copy_threads", lambda: threads)

    def memmove(self, dst: int, src: int, size: int) -> object:
        self._record("memmove", dst, src, size)
        self.now += self.memmove_takes
        done = self.real_memmove(dst, src, size)
        self._after()
        return done

    def parallel(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._record("parallel", dst.data_ptr(), src.data_ptr(), src.nbytes)
        self.now += self.takes_at.get(len(self.calls), self.parallel_takes)
        self.real_parallel(dst, src)
        self._after()

    def _record(self, kind: str, dst: int, src: int, size: int) -> None:
        self.calls.append((dst, src, size, self.turns))
        self.kinds.append(kind)

    def kinds_since(self, first: int) -> str:
        return "".join(kind[0].upper() for kind in self.kinds[first:])

    def _after(self) -> None:
        hook = self.after_call.get(len(self.calls))
        if hook is not None:
            hook()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Copies:
    """Copies spied on, by one thread unless a test asks for more."""
    return Copies(monkeypatch)


async def ticking(copies: Copies, stop: asyncio.Event) -> None:
    """Another task of the loop: counts its turns."""
    while not stop.is_set():
        copies.turns += 1
        await asyncio.sleep(0)


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


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


# --- copy_host_bytes_in_slices ------------------------------------------------------------


@pytest.mark.parametrize(
    ("threads", "nbytes", "spans", "kinds"),
    [
        # One thread: a memcpy per slice, the last one short.
        (1, 3 * MiB + 12345, [(0, MiB), (MiB, MiB), (2 * MiB, MiB), (3 * MiB, 12345)], "MMMM"),
        # Four threads: a slice each per turn; a tail too short to wake them is a memcpy.
        (4, 8 * MiB + 1000, [(0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 1000)], "PPM"),
    ],
)
async def test_a_sliced_copy_is_exact_and_lets_the_loop_run_between_slices(
    copies: Copies, threads: int, nbytes: int, spans: list[tuple[int, int]], kinds: str
) -> None:
    copies.use_threads(threads)
    src = random_bytes(nbytes, seed=threads)
    dst = torch.zeros_like(src)
    stop = asyncio.Event()
    ticker = asyncio.create_task(ticking(copies, stop))
    await asyncio.sleep(0)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=MiB)
    stop.set()
    await ticker
    assert torch.equal(dst, src)
    offsets = [(d - dst.data_ptr(), s - src.data_ptr(), n) for d, s, n, _ in copies.calls]
    assert offsets == [(start, start, size) for start, size in spans]
    assert "".join(kind[0].upper() for kind in copies.kinds) == kinds
    turns = [t for *_, t in copies.calls]
    assert all(b > a for a, b in itertools.pairwise(turns))  # a turn between slices


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.complex64]
)
@pytest.mark.parametrize("threads", [1, 3])
async def test_a_sliced_copy_is_exact_for_every_dtype(
    copies: Copies, dtype: torch.dtype, threads: int
) -> None:
    copies.use_threads(threads)
    src = random_bytes(2 * MiB + 128, seed=4).view(dtype).reshape(16, -1)
    dst = torch.empty_like(src)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=512 << 10)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


async def sliced(copies: Copies, mib: int, idle: float = 0.0, seed: int = 8) -> str:
    """Copy mib MiB by slices of 1 MiB after idle seconds; the kinds of its copy calls."""
    copies.idle(idle)
    src = random_bytes(mib * MiB, seed=seed)
    dst = torch.zeros_like(src)
    first = len(copies.kinds)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=MiB)
    assert torch.equal(dst, src)
    return copies.kinds_since(first)


async def test_torchs_threads_copy_once_a_burst_repays_their_wake(
    copies: Copies,
) -> None:
    copies.use_threads(4)
    copies.asleep()
    copies.memmove_takes = 0.0005  # a 4 MiB copy by memcpy takes 2 ms: longer than a burst's gap
    gap = host_copy.BURST_GAP_S
    assert await sliced(copies, 4, idle=10 * gap) == "MMMM"  # lone: memcpy slices
    # Each next copy starts gap/2 after the end of the last: one burst, counted from ends.
    assert await sliced(copies, 4, idle=gap / 2) == "MMMM"
    assert await sliced(copies, 4, idle=gap / 2) == "MMMM"
    assert await sliced(copies, 4, idle=gap / 2) == "P"  # 16 MiB in the burst: wake them
    assert await sliced(copies, 1, idle=gap / 2) == "P"  # still awake
    assert await sliced(copies, 4, idle=gap * 1.5) == "MMMM"  # asleep again, a new burst
    assert await sliced(copies, 16, idle=10 * gap) == "PPPP"  # one copy large enough alone


async def test_copies_in_flight_together_are_one_burst(copies: Copies) -> None:
    copies.use_threads(4)
    copies.asleep()
    copies.idle(1.0)
    await asyncio.gather(*(sliced(copies, 4, seed=seed) for seed in range(4)))
    # The fourth reaches 16 MiB and wakes the threads for its whole copy; the others had
    # started by memcpy and go on so.
    sizes = [n for _, _, n, _ in copies.calls]
    parallel = [n for n, kind in zip(sizes, copies.kinds, strict=True) if kind == "parallel"]
    assert parallel == [4 * MiB] and len(sizes) == 13


@pytest.mark.parametrize(("idle_after", "kinds"), [(0.0, "P"), (1.0, "MMMM")])
async def test_a_cancelled_copy_still_counts_in_its_burst(
    copies: Copies, idle_after: float, kinds: str
) -> None:
    copies.use_threads(4)
    copies.asleep()
    src = random_bytes(12 * MiB, seed=10)
    copying = asyncio.create_task(copy_host_bytes_in_slices(torch.zeros_like(src), src, MiB))
    copies.after_call[1] = copying.cancel
    with pytest.raises(asyncio.CancelledError):
        await copying
    # 12 MiB so far: a 4 MiB copy right after it completes 16 MiB; after an idle second it
    # starts a burst of its own.
    assert await sliced(copies, 4, idle=idle_after) == kinds


async def test_each_thread_has_its_own_burst(copies: Copies) -> None:
    copies.use_threads(4)
    assert await sliced(copies, 1) == "P"  # this thread's burst has woken its threads

    def on_another_thread() -> str:
        return asyncio.run(sliced(copies, 1))

    assert await asyncio.to_thread(on_another_thread) == "M"


async def test_a_stalled_parallel_turn_sends_copies_to_memcpy_for_a_while(
    copies: Copies,
) -> None:
    copies.use_threads(4)  # 4 MiB turns, due in 1.05 ms each
    fast, stalled = 0.0002, 0.0016
    backoff = host_copy.STALL_BACKOFF_S
    copies.parallel_takes = fast
    assert await sliced(copies, 8) == "PP"
    copies.parallel_takes = stalled
    # The first turn stalls: the rest of its copy and the copies that start within the
    # back-off go by memcpy.
    assert await sliced(copies, 8) == "PMMMM"
    assert await sliced(copies, 16, idle=backoff - 0.001) == "M" * 16  # from its end
    # Over: a new burst wakes the threads (slow, but allowed for a wake); its second turn
    # stalls soon after the back-off's end, which doubles it.
    assert await sliced(copies, 16, idle=0.001) == "PP" + "M" * 8
    assert await sliced(copies, 16, idle=1.8 * backoff) == "M" * 16
    copies.parallel_takes = fast
    assert await sliced(copies, 16, idle=0.2 * backoff) == "PPPP"
    # Fast turns in between do not undo it: a stall soon after doubles it again...
    copies.parallel_takes = stalled
    assert await sliced(copies, 4) == "P"
    assert await sliced(copies, 16, idle=3.6 * backoff) == "M" * 16
    # ...and a stall after a stall-free stretch as long as the back-off starts it afresh.
    assert await sliced(copies, 16, idle=4.4 * backoff) == "PP" + "M" * 8
    assert await sliced(copies, 16, idle=1.2 * backoff) == "PP" + "M" * 8


async def test_stalls_each_soon_after_the_last_back_off_double_it_up_to_the_longest(
    copies: Copies,
) -> None:
    copies.use_threads(4)
    copies.parallel_takes = 0.01  # past the wake's allowance too
    recent, longest = host_copy._recent, host_copy.STALL_BACKOFF_MAX_S
    lengths = []
    for _ in range(int(math.log2(longest / host_copy.STALL_BACKOFF_S)) + 3):
        copies.idle(max(0.0, recent.threads_off_until - copies.now))  # the back-off's end
        assert (await sliced(copies, 16))[0] == "P"
        lengths.append(recent.backoff_s)
    assert lengths == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert await sliced(copies, 16, idle=0.99 * longest) == "M" * 16
    assert await sliced(copies, 16, idle=0.02 * longest) == "P" + "M" * 12


async def test_a_stall_sends_the_threads_other_copies_in_flight_to_memcpy(
    copies: Copies,
) -> None:
    copies.use_threads(4)
    copies.takes_at = {2: 0.003}  # the second copy's first turn stalls
    await asyncio.gather(sliced(copies, 8, seed=1), sliced(copies, 8, seed=2))
    assert copies.kinds_since(0) == "PP" + "M" * 8  # the first copy's next turn too


async def stall_once(copies: Copies) -> None:
    """Four copy threads, whose first turn of an 8 MiB copy stalls; fast ones after."""
    copies.use_threads(4)
    copies.parallel_takes = 0.003
    assert await sliced(copies, 8) == "PMMMM"
    copies.parallel_takes = 0.0002


async def test_a_stall_on_one_thread_leaves_another_threads_copies_alone(
    copies: Copies,
) -> None:
    await stall_once(copies)

    def on_another_thread() -> str:
        return asyncio.run(sliced(copies, 16))

    assert await asyncio.to_thread(on_another_thread) == "PPPP"
    assert await sliced(copies, 16) == "M" * 16


async def test_a_burst_that_outlasts_its_back_off_may_wake_the_threads_again(
    copies: Copies,
) -> None:
    await stall_once(copies)
    copies.memmove_takes = 0.001  # 1 MiB reads, each 1 ms after the last: one burst
    while copies.now + 0.001 < host_copy._recent.threads_off_until:
        assert await sliced(copies, 1, idle=0.001) == "M"
    # The threads have not copied since the stall: a slow first turn may be their wake.
    copies.takes_at = {len(copies.calls) + 1: 0.003}
    assert await sliced(copies, 8, idle=0.001) == "PP"


async def test_a_short_slow_turn_is_no_stall(copies: Copies) -> None:
    copies.use_threads(4)
    # Slower than one core's memcpy for 256 KiB, but shorter than the floor.
    copies.parallel_takes = 0.8 * host_copy.STALL_FLOOR_S
    assert copies.parallel_takes > (256 << 10) / host_copy.STALLED_BELOW_BYTES_PER_S
    src = random_bytes(2 * MiB, seed=3)
    dst = torch.zeros_like(src)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=64 << 10)
    assert torch.equal(dst, src) and copies.kinds_since(0) == "P" * 8


@pytest.mark.parametrize(
    ("torch_threads", "cores", "quota", "expected"),
    [
        (8, 16, None, 8),
        (16, 16, None, 16),
        (16, 4, None, 1),  # kept to fewer cores than torch's threads
        (1, 16, None, 1),
        (3, 16, None, 1),  # too few threads to be worth a parallel copy
        (4, 16, None, 4),
        (8, 16, 2.5, 1),  # a container's CPU quota, with every core in the affinity
        (8, 16, 8.0, 8),
    ],
)
def test_copy_threads_are_torchs_unless_the_process_has_fewer_cores(
    monkeypatch: pytest.MonkeyPatch,
    torch_threads: int,
    cores: int,
    quota: float | None,
    expected: int,
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    monkeypatch.setattr(host_copy, "cgroup_cpu_quota", lambda: quota)
    assert host_copy.copy_threads() == expected


@pytest.mark.parametrize(
    ("fields", "cores"),
    [
        (["max", "100000"], None),  # cgroup v2, no quota
        (["400000", "100000"], 4.0),
        (["150000", "100000"], 1.5),
        (["-1", "100000"], None),  # cgroup v1, no quota
        ([], None),
        (["400000", "0"], None),
    ],
)
def test_a_cgroup_quota_reads_as_cores(fields: list[str], cores: float | None) -> None:
    assert host_copy.quota_cores(fields) == cores
    host_copy.cgroup_cpu_quota()  # this machine's, whatever it is: it must not raise


async def test_one_turn_copies_for_at_most_max_threads_per_turn(copies: Copies) -> None:
    copies.use_threads(4 * host_copy.MAX_THREADS_PER_TURN)
    slice_bytes = 64 << 10
    step = host_copy.MAX_THREADS_PER_TURN * slice_bytes
    src = random_bytes(2 * step, seed=5)
    dst = torch.zeros_like(src)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=slice_bytes)
    assert torch.equal(dst, src)
    assert [n for _, _, n, _ in copies.calls] == [step, step]


async def test_a_sliced_copy_refuses_overlapping_ranges(copies: Copies) -> None:
    buffer = random_bytes(4 * MiB, seed=6)
    before = buffer.clone()
    with pytest.raises(ValueError, match="overlapping"):
        await copy_host_bytes_in_slices(buffer[MiB:], buffer[: 3 * MiB], slice_bytes=MiB)
    assert copies.calls == [] and torch.equal(buffer, before)


@pytest.mark.parametrize(("threads", "parallel_copies"), [(1, 0), (4, 1)])
def test_warming_up_runs_one_parallel_copy_where_reads_would(
    copies: Copies, threads: int, parallel_copies: int
) -> None:
    copies.use_threads(threads)
    host_copy.warm_up()
    assert copies.kinds == ["parallel"] * parallel_copies


async def test_a_cancelled_sliced_copy_stops_between_slices(copies: Copies) -> None:
    src = random_bytes(4 * MiB, seed=2)
    dst = torch.zeros_like(src)
    copying = asyncio.create_task(copy_host_bytes_in_slices(dst, src, slice_bytes=MiB))
    copies.after_call[2] = copying.cancel
    with pytest.raises(asyncio.CancelledError):
        await copying
    assert len(copies.calls) == 2
    assert torch.equal(dst[: 2 * MiB], src[: 2 * MiB]) and not dst[2 * MiB :].any()


@pytest.mark.parametrize(("dst", "src", "match"), BAD_PAIRS)
async def test_a_sliced_copy_refuses_bad_pairs_before_a_byte_moves(
    copies: Copies, dst: torch.Tensor, src: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await copy_host_bytes_in_slices(dst, src, slice_bytes=4)
    assert copies.calls == []


async def test_a_slice_must_hold_a_byte() -> None:
    with pytest.raises(ValueError, match="slice_bytes must be > 0"):
        await copy_host_bytes_in_slices(torch.zeros(4), torch.ones(4), slice_bytes=0)


# --- host reads through the cache -------------------------------------------------------


async def put_on_host(cache: FeatureCache, rig: Rig, key: str) -> torch.Tensor:
    """Put a 4 MiB feature into a cache without a GPU tier; return a copy to compare with."""
    t = rig.tensor(1024, 1024, dtype=torch.float32, seed=7)
    expected = t.cpu().clone()
    assert await cache.put(key, t)
    del t
    await cache.drain()
    assert cache.stats().cpu_entries == 1
    return expected


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [None, slice(0, 700), slice(5, 9)])
async def test_a_large_host_read_goes_a_slice_per_loop_turn_and_is_exact(
    rig: Rig, make_cache: CacheFactory, copies: Copies, rows: slice | None, threads: int
) -> None:
    copies.use_threads(threads)
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    copies.calls.clear()
    stop = asyncio.Event()
    ticker = asyncio.create_task(ticking(copies, stop))
    await asyncio.sleep(0)
    out = await cache.get("k", device="cpu", rows=rows)
    stop.set()
    await ticker
    assert_exact(out, expected if rows is None else expected[rows])
    assert out is not None and out.is_pinned() == (rig.kind == "cuda")
    step = threads * SLICE_BYTES
    slices = -(-out.nbytes // step)
    assert [n for _, _, n, _ in copies.calls][:-1] == [step] * (slices - 1)
    turns = [t for *_, t in copies.calls]
    assert all(b > a for a, b in itertools.pairwise(turns))


async def test_a_host_read_whose_turn_stalls_goes_on_by_memcpy_and_is_exact(
    rig: Rig, make_cache: CacheFactory, copies: Copies
) -> None:
    copies.use_threads(2)
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    copies.parallel_takes = 0.003  # 2 MiB turns, due in 0.5 ms
    first = len(copies.kinds)
    assert_exact(await cache.get("k", device="cpu"), expected)
    assert copies.kinds_since(first) == "PMM"
    first = len(copies.kinds)
    assert_exact(await cache.get("k", device="cpu", rows=slice(0, 700)), expected[:700])
    assert copies.kinds_since(first) == "MMM"  # 2.7 MiB, in the back-off


async def test_a_read_cancelled_between_slices_gives_its_block_back(
    rig: Rig, make_cache: CacheFactory, copies: Copies
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    await put_on_host(cache, rig, "k")
    copies.calls.clear()
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    copies.after_call[1] = reader.cancel
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert len(copies.calls) == 1  # nothing reads the block after the cancel
    assert cache.discard("k")
    await cache.drain()
    s = cache.stats()
    assert s.cpu_bytes == 0 and s.leaked_bytes == 0


async def test_a_read_in_flight_at_close_finishes(
    rig: Rig, make_cache: CacheFactory, copies: Copies
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    closing: list[asyncio.Task[None]] = []
    copies.after_call[len(copies.calls) + 1] = lambda: closing.append(
        asyncio.create_task(cache.close(timeout=5))
    )
    assert_exact(await reader, expected)
    await closing[0]

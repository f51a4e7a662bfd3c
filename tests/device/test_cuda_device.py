"""CudaDevice on a real GPU: fences, exact copies, record_stream keep-alive, the pinned arena."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import glob
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import stall
from device_copies import (
    copy_d2d_into,
    copy_d2d_many,
    copy_d2d_new,
    copy_d2h,
    copy_d2h_batch,
    copy_h2d,
    copy_h2d_many,
    host_arena,
    upload_packed_on,
)
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, CacheStats, FeatureCache
from mmcache.device import DONE, cuda_streams
from mmcache.device.cuda import ArenaMethod, CudaDevice, CudaFence
from mmcache.device.cuda_driver import BatchCopier, CudaDriver
from mmcache.device.cuda_streams import OnStream
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    InvalidValueError,
    MMCacheError,
    SettingsError,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

MiB = 1 << 20
HOLD_SECONDS = 0.3  # far longer than queuing the work under test


@pytest.fixture
def device() -> Iterator[CudaDevice]:
    dev = CudaDevice(0)
    yield dev
    dev.close()


def side_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream(0)  # type: ignore[no-untyped-call]


def hold(stream: torch.cuda.Stream, seconds: float = HOLD_SECONDS) -> None:
    """Park stream behind a long kernel so that work queued next cannot start yet."""
    stall(stream, seconds)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values (never zeros: they hide unwritten memory) on the GPU."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    out = t.to("cuda:0")
    # Ready on return: the copies under test run on other streams, unordered with this one.
    torch.cuda.synchronize()
    return out


# --- fences ------------------------------------------------------------------------------


def test_fence_callback_runs_on_waiter_thread_once_done(device: CudaDevice) -> None:
    side = side_stream()
    hold(side)
    fence = device.record(side)
    assert not fence.done()
    called = threading.Event()
    threads: list[str] = []

    def callback() -> None:
        threads.append(threading.current_thread().name)
        called.set()

    fence.add_done_callback(callback)
    assert not called.is_set()
    assert called.wait(30)
    assert fence.done()
    assert fence.exception() is None
    assert threads != [threading.current_thread().name]
    now: list[int] = []
    fence.add_done_callback(lambda: now.append(1))
    assert now == [1]  # already done: called at once, on this thread


def test_fence_wait_with_timeout(device: CudaDevice) -> None:
    side = side_stream()
    hold(side)
    fence = device.record(side)
    assert fence.wait(timeout=0.005) is False
    assert fence.wait() is True
    assert fence.done()


async def test_fence_wakes_the_event_loop(device: CudaDevice) -> None:
    loop = asyncio.get_running_loop()
    side = side_stream()
    hold(side)
    fence = device.record(side)
    woken: asyncio.Future[None] = loop.create_future()
    fence.add_done_callback(lambda: loop.call_soon_threadsafe(woken.set_result, None))
    await asyncio.sleep(0.01)
    assert not woken.done()
    await asyncio.wait_for(woken, 30)
    assert fence.done()


def test_fences_behind_a_long_kernel_cost_the_host_nothing(device: CudaDevice) -> None:
    """Recording many fences on a busy stream never blocks (blocking-sync events do, past
    about 56 pending on one stream), and the waiter thread sleeps until they are done."""
    idle = device.record(side_stream())  # nothing queued there: done at once
    side = side_stream()
    # The collector stays off while timing: freeing pinned memory (an earlier test's arena,
    # collected here) can wait for the whole device, the held stream too. In one
    # whole-suite run on the H200 these records took the full second.
    gc.collect()
    gc.disable()
    try:
        hold(side, 1.0)
        start = time.perf_counter()
        fences = [device.record(side) for _ in range(200)]
        recording = time.perf_counter() - start
    finally:
        gc.enable()
    assert recording < 0.3
    assert not fences[-1].done()
    landed = threading.Event()
    cpu: list[float] = []  # the waiter thread's CPU time before and after its sleep

    def last() -> None:
        cpu.append(time.thread_time())
        landed.set()

    idle.add_done_callback(lambda: cpu.append(time.thread_time()))
    fences[-1].add_done_callback(last)
    assert landed.wait(30)
    assert all(f.done() and f.exception() is None for f in fences)
    assert len(cpu) == 2 and cpu[1] - cpu[0] < 0.1  # asleep in the driver while the kernel ran


def test_fence_sleeper_wakes_after_the_kernel(device: CudaDevice) -> None:
    side = side_stream()
    hold(side)
    fence = device.record(side)
    sleeper = CudaDriver.get().sleeper(0)
    try:
        cpu, start = time.thread_time(), time.perf_counter()
        fence.synchronize(sleeper)
        assert time.perf_counter() - start > HOLD_SECONDS / 2
        assert time.thread_time() - cpu < HOLD_SECONDS / 4
        assert fence.done() and fence.exception() is None
    finally:
        sleeper.close()
    sleeper.close()  # twice is harmless
    with pytest.raises(MMCacheError, match="closed"):
        sleeper.sleep_until(fence.event.cuda_event)


def test_fences_complete_without_a_sleeper(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sleeper(driver: CudaDriver, ordinal: int) -> None:
        raise MMCacheError("cuStreamCreate failed: out of streams")

    monkeypatch.setattr(CudaDriver, "sleeper", no_sleeper)
    device = CudaDevice(0)  # its waiter threads start at the first fence, with the patch
    try:
        side = side_stream()
        hold(side)
        fence = device.record(side)
        landed = threading.Event()
        fence.add_done_callback(landed.set)
        assert landed.wait(30)  # polled instead of slept on
        assert fence.done() and fence.exception() is None
    finally:
        device.close()


def test_callbacks_of_one_stream_run_in_order(device: CudaDevice) -> None:
    side = side_stream()
    order: list[int] = []
    fences = []
    for _ in range(5):
        hold(side, HOLD_SECONDS / 10)
        fences.append(device.record(side))
    for i, fence in enumerate(fences):
        fence.add_done_callback(functools.partial(order.append, i))
    fences[-1].wait()
    deadline = time.monotonic() + 10
    while len(order) < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert order == [0, 1, 2, 3, 4]


def test_a_callback_added_late_does_not_wait_behind_a_later_fence(device: CudaDevice) -> None:
    side = side_stream()
    early = device.record(side)  # nothing ahead of it
    hold(side, 1.0)
    late = device.record(side)
    late.add_done_callback(lambda: None)  # a waiter thread sleeps on it until the hold ends
    seen = threading.Event()
    early.add_done_callback(seen.set)  # so it goes to another thread
    assert seen.wait(0.5) and not late.done()


def test_out_of_order_callbacks_use_a_bounded_number_of_threads(device: CudaDevice) -> None:
    side = side_stream()
    early = [device.record(side) for _ in range(20)]
    hold(side, 0.5)
    late = device.record(side)
    late.add_done_callback(lambda: None)
    done = threading.Semaphore(0)
    for fence in reversed(early):  # each added after a later one
        fence.add_done_callback(done.release)
    for _ in early:
        assert done.acquire(timeout=30)
    assert device._waiters.thread_count <= 8


# --- copies ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("shape", [(1000, 257), (3,), ()])
def test_round_trip_is_bit_exact(
    device: CudaDevice, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    src = random_tensor(shape, dtype, seed=1)
    arena = host_arena(device, 4 * MiB)
    host = arena[: src.nbytes]
    # The H2D must wait for the D2H that fills host: hold the D2H back to prove it does.
    hold(device.d2h_stream)
    down = copy_d2h(device, src, host, [])
    back = device.empty(src.shape, src.dtype)
    up = copy_h2d(device, host, back, [down])
    assert not down.done()
    assert up.wait(30)
    assert torch.equal(host, as_bytes(src).cpu())
    assert back.shape == src.shape and back.dtype == src.dtype
    assert torch.equal(as_bytes(back), as_bytes(src))


def assert_block_kept(n: int, ptr: int) -> None:
    """Allocations of n bytes made while a copy is queued get anything but the block at
    ptr, which the allocator keeps for that copy."""
    newcomers = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    for t in newcomers:
        t.fill_(1)
    assert all(t.data_ptr() != ptr for t in newcomers)


def test_source_survives_release_right_after_queuing(device: CudaDevice) -> None:
    n = 64 * MiB
    # Control: without record_stream the allocator hands a freed block straight back.
    probe = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    probe_ptr = probe.data_ptr()
    del probe
    again = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    assert again.data_ptr() == probe_ptr
    del again

    arena = host_arena(device, n)
    src = torch.full((n,), 7, dtype=torch.uint8, device="cuda:0")
    src_ptr = src.data_ptr()
    side = side_stream()
    hold(side)
    gate = device.record(side)
    fence = copy_d2h(device, src, arena, [gate])
    del src  # the cache releases its alias as soon as the copy is queued
    assert_block_kept(n, src_ptr)
    assert fence.wait(30)
    assert bool((arena == 7).all())


def test_copies_into_held_memory_keep_each_source_block_once(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_d2d_many(dsts_held=True), as the IPC sender writes a batch into its pool: the
    allocator keeps the sources' block (one record_stream for views of one tensor) until
    the copies ran, and nothing is recorded for the destinations the caller keeps."""
    recorded: list[int] = []
    record_stream = torch.Tensor.record_stream

    def counted(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        recorded.append(tensor.untyped_storage().data_ptr())
        record_stream(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", counted)
    n = 64 * MiB
    src = torch.full((4, n // 4), 7, dtype=torch.uint8, device="cuda:0")
    src_ptr = src.data_ptr()
    held = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    side = side_stream()
    hold(side)
    pairs = [(src[i], held[i * (n // 4) : (i + 1) * (n // 4)]) for i in range(4)]
    fence = copy_d2d_many(device, pairs, side, dsts_held=True)
    del pairs, src  # the sender releases its sources as soon as the copies are queued
    assert recorded == [src_ptr]
    assert_block_kept(n, src_ptr)
    assert fence.wait(30)
    assert bool((held == 7).all())


@pytest.mark.parametrize("batch_copies", [True, False], ids=["driver-batch", "torch-copy"])
def test_copies_within_the_gpu_are_exact_and_wait_for_the_stream(
    batch_copies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_d2d_many of dense pairs goes to the driver as one batch where it has batched
    copies, a strided source or a lone pair through torch; either way every byte lands,
    after the work queued on the stream before (a rewrite of the sources behind a hold)."""
    device = CudaDevice(0, batch_copies=batch_copies)
    if batch_copies:
        needs_driver_batches(device)
    copier = device._copies.d2d_batches
    assert (copier is not None) == batch_copies
    batches = counted_batches(monkeypatch, copier)
    specs: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((1000, 4096), torch.bfloat16),  # 8 MB
        ((7,), torch.int8),
        ((), torch.float32),
        ((0, 16), torch.float16),  # no bytes
        ((128, 4096), torch.bfloat16),
    ]
    srcs = [random_tensor(shape, dtype, seed=i) for i, (shape, dtype) in enumerate(specs)]
    held = torch.zeros(sum(s.nbytes for s in srcs) + 8192, dtype=torch.uint8, device="cuda:0")
    dsts, at = [], 0
    for src in srcs:
        dsts.append(held[at : at + src.nbytes].view(src.dtype).view(src.shape))
        at = (at + src.nbytes + 1023) // 512 * 512  # gaps, as a pool slice's alignment leaves
    gate, expected = rewritten_behind_a_hold(device, srcs, seed=50)
    stream = side_stream()
    device.wait_on(stream, gate)
    fence = copy_d2d_many(device, list(zip(srcs, dsts, strict=True)), stream, dsts_held=True)
    assert not fence.done()
    assert fence.wait(30)
    for dst, want in zip(dsts, expected, strict=True):
        assert torch.equal(as_bytes(dst).cpu(), want)
    assert batches == ([4] if batch_copies else [])  # the empty pair needs no range
    # A strided source cannot be copied as bytes: the whole batch goes through torch.
    strided = random_tensor((64, 32), torch.float32, seed=9).t()
    out = [torch.empty((32, 64), dtype=torch.float32, device="cuda:0") for _ in range(2)]
    pairs = [(strided, out[0]), (strided.contiguous(), out[1])]
    assert copy_d2d_many(device, pairs, stream).wait(30)
    assert torch.equal(out[0], strided) and torch.equal(out[1], strided)
    assert len(batches) == (1 if batch_copies else 0)
    device.close()


@pytest.mark.parametrize("on", ["side", "default"], ids=["side-stream", "default-stream"])
@pytest.mark.parametrize("batch_copies", [True, False], ids=["driver-batch", "torch-copy"])
def test_copies_into_a_held_buffer_land_at_their_offsets(batch_copies: bool, on: str) -> None:
    """copy_d2d_into, as the IPC sender writes a request's features into a pool slice:
    dense sources by one driver call naming addresses, strided ones through typed views;
    on torch's default stream (the legacy one, which the driver's batches refuse) too."""
    device = CudaDevice(0, batch_copies=batch_copies)
    if batch_copies:
        needs_driver_batches(device)
    stream = side_stream() if on == "side" else torch.cuda.default_stream()
    srcs = [
        random_tensor((1000, 4096), torch.bfloat16, seed=1),
        random_tensor((7,), torch.int8, seed=2),
        random_tensor((33, 3), torch.float32, seed=3),
    ]
    strided = random_tensor((64, 32), torch.float32, seed=4).t()
    buffer = torch.zeros(sum(s.nbytes for s in srcs) + 3 * 4096, dtype=torch.uint8, device="cuda:0")
    offsets = [0, srcs[0].nbytes + 512, srcs[0].nbytes + 1024]
    expected = copied_into_behind_a_hold(device, srcs, buffer, offsets, stream, seed=70)
    alone = copy_d2d_into(device, srcs[2:], buffer, [0], stream)
    assert alone.wait(30)
    assert torch.equal(buffer[: srcs[2].nbytes].cpu(), expected[2])
    assert device.describe()["batched_copies_within_gpu"] == (
        "cuMemcpyBatchAsync" if batch_copies else "torch copy_"
    )  # no batch was refused
    end = offsets[-1] + srcs[-1].nbytes + 512
    assert copy_d2d_into(device, [strided, srcs[2]], buffer, [end, end + 8192], stream).wait(30)
    got = buffer[end : end + strided.nbytes].view(torch.float32).view(32, 64)
    assert torch.equal(got, strided)
    with pytest.raises(InvalidValueError, match="falls outside"):
        copy_d2d_into(device, srcs[:1], buffer, [buffer.numel() - 8], stream)
    device.close()


@pytest.mark.parametrize("on", ["side", "default"], ids=["side-stream", "default-stream"])
def test_alike_features_back_to_back_are_gathered_by_one_kernel(
    on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copy_d2d_into of a request's features (one dtype and row shape, destined back to
    back) is one torch.cat into a view of the buffer, no driver batch, after the work
    queued on the stream; a conjugate view among them, or a gap, takes the other path."""
    device = CudaDevice(0)
    stream = side_stream() if on == "side" else torch.cuda.default_stream()
    calls: list[str] = []
    cat, copy = torch.cat, BatchCopier.copy

    def counted_cat(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("cat")
        return cat(*args, **kwargs)

    def counted_copy(self: BatchCopier, *args: Any) -> None:
        calls.append("driver")
        copy(self, *args)

    monkeypatch.setattr(torch, "cat", counted_cat)
    monkeypatch.setattr(BatchCopier, "copy", counted_copy)
    srcs = [
        random_tensor((rows, 4096), torch.bfloat16, seed=i) for i, rows in enumerate((1000, 3, 128))
    ]
    offsets = [512]
    for src in srcs[:-1]:
        offsets.append(offsets[-1] + src.nbytes)
    buffer = torch.zeros(offsets[-1] + srcs[-1].nbytes + 512, dtype=torch.uint8, device="cuda:0")
    copied_into_behind_a_hold(device, srcs, buffer, offsets, stream, seed=90)
    assert calls == ["cat"]
    assert torch.count_nonzero(buffer[:512]).item() == 0  # nothing outside their bytes
    assert torch.count_nonzero(buffer[offsets[-1] + srcs[-1].nbytes :]).item() == 0
    # A conjugate view's values are not its bytes; a gap breaks the run: no gather.
    values = torch.complex(
        random_tensor((16, 8), torch.float32, seed=7), random_tensor((16, 8), torch.float32, seed=8)
    )
    twins = [values.conj(), values.clone()]
    calls.clear()
    assert copy_d2d_into(device, twins, buffer, [0, values.nbytes], stream).wait(30)
    assert "cat" not in calls
    got = buffer[: 2 * values.nbytes].view(torch.complex64).view(32, 8)
    assert torch.equal(got, torch.cat([values.conj().resolve_conj(), values]))
    calls.clear()
    assert copy_d2d_into(device, srcs[:2], buffer, [0, srcs[0].nbytes + 256], stream).wait(30)
    assert "cat" not in calls
    assert torch.equal(
        buffer[srcs[0].nbytes + 256 :][: srcs[1].nbytes].cpu(), as_bytes(srcs[1]).cpu()
    )
    device.close()


def test_a_batch_within_the_gpu_the_driver_refuses_goes_through_torch(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_driver_batches(device)
    copier = device._copies.d2d_batches
    assert copier is not None
    refuse_batches(monkeypatch, copier)
    srcs = [random_tensor((256, 1024), torch.bfloat16, seed=i) for i in range(2)]
    dsts = [torch.zeros_like(s) for s in srcs]
    assert copy_d2d_many(device, list(zip(srcs, dsts, strict=True)), side_stream()).wait(30)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    assert device.describe()["batched_copies_within_gpu"] == "torch copy_"  # from then on
    assert device.describe()["batched_copies"] == "cuMemcpyBatchAsync"  # offloads keep theirs
    # The refusal's log record (pytest keeps it) must not keep the sources alive.
    gone = [weakref.ref(src) for src in srcs]
    del srcs, dsts
    assert all(ref() is None for ref in gone)


def test_on_stream_switches_only_to_another_stream_and_back(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    switches: list[int] = []
    set_stream = cuda_streams._set_current_stream
    assert set_stream is not None

    def counted(**stream: int) -> None:
        switches.append(stream["stream_id"])
        set_stream(**stream)

    monkeypatch.setattr(cuda_streams, "_set_current_stream", counted)
    current = torch.cuda.current_stream()
    with OnStream(current):  # the caller's own stream: nothing to switch
        assert torch.cuda.current_stream() == current
    assert switches == []
    side = side_stream()
    with OnStream(side):
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == current
    assert switches == [side.stream_id, current.stream_id]


def test_copy_waits_for_a_producer_on_a_side_stream(device: CudaDevice) -> None:
    n = 8 * MiB
    arena = host_arena(device, n)
    src = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    side = side_stream()
    with torch.cuda.stream(side):
        stall(torch.cuda.current_stream(), HOLD_SECONDS)
        src.fill_(9)  # the producer's kernel is still queued when the copy is
    src.record_stream(side)
    ready = device.record(side)
    fence = copy_d2h(device, src, arena, [ready])
    assert not ready.done()
    assert fence.wait(30)
    assert bool((arena == 9).all())


def test_copy_d2d_new_is_exact_and_ordered_after_its_streams_work(device: CudaDevice) -> None:
    src = torch.zeros(4 * MiB, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    side = side_stream()
    with torch.cuda.stream(side):
        stall(torch.cuda.current_stream(), HOLD_SECONDS)
        src.fill_(9)  # the producer's kernel is still queued when the copy is
    dst, fence = copy_d2d_new(device, src.view(1024, 4096), side)
    assert not fence.done()
    assert fence.wait(30)
    assert (dst.shape, dst.dtype, dst.device) == ((1024, 4096), torch.float32, src.device)
    assert dst.is_contiguous() and dst.data_ptr() != src.data_ptr()
    assert bool((dst == 9).all())
    with pytest.raises(InvalidValueError, match="not cuda"):
        copy_d2d_new(device, torch.zeros(4), side)


def test_consumer_stream_waits_on_an_upload(device: CudaDevice) -> None:
    n = 8 * MiB
    arena = host_arena(device, n)
    arena.copy_(torch.randint(0, 255, (n,), dtype=torch.uint8))
    hold(device.h2d_stream)
    dst = device.empty((n,), torch.uint8)
    fence = copy_h2d(device, arena, dst, [])
    consumer = side_stream()
    device.wait_on(consumer, fence)
    with torch.cuda.stream(consumer):
        seen = dst.clone()
    device.use_on(dst, consumer)
    consumer.synchronize()
    assert torch.equal(seen.cpu(), arena)


def test_use_all_on_keeps_every_block_for_the_readers_queued_work(device: CudaDevice) -> None:
    """A batch's outputs, used on a reader stream and dropped while its work is queued:
    the allocator hands none of their blocks to a newcomer until that work is done."""
    n = 16 * MiB
    outputs = [torch.full((n,), i, dtype=torch.uint8, device="cuda:0") for i in range(3)]
    pointers = [t.data_ptr() for t in outputs]
    reader = side_stream()
    reader.wait_stream(torch.cuda.current_stream())  # after the fills
    hold(reader)
    with torch.cuda.stream(reader):
        sums = [t.sum() for t in outputs]  # queued behind the hold
    device.use_all_on(outputs, reader)
    del outputs
    for ptr in pointers:
        assert_block_kept(n, ptr)
    reader.synchronize()
    assert [int(s) for s in sums] == [i * n for i in range(3)]


@pytest.mark.parametrize("batch_copies", [True, False], ids=["driver-batch", "torch-copy"])
def test_batch_copy_is_exact_in_any_order_and_waits_for_its_producers(
    batch_copies: bool,
) -> None:
    device = CudaDevice(0, batch_copies=batch_copies)
    if batch_copies:
        needs_driver_batches(device)
    else:
        assert device.describe()["batched_copies"] == "torch copy_"
    rng = random.Random(0)
    specs: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((32, 1024), torch.bfloat16),  # 64 KiB
        ((7,), torch.int8),
        ((), torch.float32),
        ((1000, 4096), torch.bfloat16),  # 8 MB: copied on its own
        ((128, 4096), torch.bfloat16),  # 1 MiB: gathered through torch, alone through the driver
        ((33, 3), torch.float32),
        ((32, 1024), torch.bfloat16),  # the same row shape as the first: a run of two
    ] * 6
    srcs = [random_tensor(shape, dtype, seed=i) for i, (shape, dtype) in enumerate(specs)]
    expected = [as_bytes(s).cpu() for s in srcs]
    arena = host_arena(device, sum(s.nbytes for s in srcs) + 64 * MiB)
    offsets: list[int] = []
    offset = 0
    for i, s in enumerate(srcs):
        offset += 4096 if i % 5 == 4 else 0  # some gaps: runs of adjacent blocks, and breaks
        offsets.append(offset)
        offset += s.nbytes
    order = list(range(len(srcs)))
    rng.shuffle(order)
    # Warm the caching allocator, the D2H stream's pool included (the gather buffers): a
    # cudaMalloc after the hold may synchronise the device.
    warm = [torch.empty(e.numel() * 2, dtype=torch.uint8, device="cuda:0") for e in expected]
    del warm
    shuffled = [srcs[i] for i in order]
    at = [offsets[i] for i in order]
    assert copy_d2h_batch(device, shuffled, arena, at, []).wait(30)
    arena.fill_(0)  # so the held batch below must write every byte again
    gate, expected = rewritten_behind_a_hold(device, srcs, seed=100)
    fence = copy_d2h_batch(device, shuffled, arena, at, [gate])
    assert not fence.done()
    assert fence.wait(30)
    for i, want in enumerate(expected):
        assert torch.equal(arena[offsets[i] : offsets[i] + want.numel()], want), specs[i]
    device.close()


def rewritten_behind_a_hold(
    device: CudaDevice, srcs: list[torch.Tensor], seed: int
) -> tuple[CudaFence, list[torch.Tensor]]:
    """The producer rewrites every source on a side stream held behind a long kernel: a
    copy not ordered after the returned fence would copy the old values. Returns the
    fence and the new values' bytes (read before the hold)."""
    rewrites = [random_tensor(tuple(s.shape), s.dtype, seed=seed + i) for i, s in enumerate(srcs)]
    expected = [as_bytes(r).cpu() for r in rewrites]
    torch.cuda.synchronize()  # the rewrites exist before the side stream reads them
    gc.collect()  # an earlier test's arena freed mid-hold (cuMemFreeHost) would synchronise
    side = side_stream()
    hold(side)
    with torch.cuda.stream(side):
        for src, new in zip(srcs, rewrites, strict=True):
            src.copy_(new)
            new.record_stream(side)  # freed on return: not reused before the side stream reads it
    return device.record(side), expected


def copied_into_behind_a_hold(
    device: CudaDevice,
    srcs: list[torch.Tensor],
    buffer: torch.Tensor,
    offsets: list[int],
    stream: torch.cuda.Stream,
    seed: int,
) -> list[torch.Tensor]:
    """copy_d2d_into(srcs, buffer, offsets) on stream, queued while a hold keeps the
    sources' rewrites waiting (see rewritten_behind_a_hold): the copy must wait for them
    and land the new bytes at each offset. Returns the bytes written."""
    gate, expected = rewritten_behind_a_hold(device, srcs, seed=seed)
    device.wait_on(stream, gate)
    fence = copy_d2d_into(device, srcs, buffer, offsets, stream)
    assert not fence.done()
    assert fence.wait(30)
    for at, want in zip(offsets, expected, strict=True):
        assert torch.equal(buffer[at : at + want.numel()].cpu(), want)
    return expected


def assert_copied_in_chunks(
    arena: torch.Tensor,
    srcs: list[torch.Tensor],
    offsets: list[int],
    pieces: list[tuple[int, int]],
    chunk: int,
) -> None:
    """Every source's bytes at its offset, no copied piece across a registered chunk, and
    nothing written outside the ranges (the arena was filled with 0xAB)."""
    assert sum(size for _, size in pieces) == sum(src.nbytes for src in srcs)
    assert all(at // chunk == (at + size - 1) // chunk for at, size in pieces), pieces
    written = torch.zeros(arena.numel(), dtype=torch.bool)
    for src, offset in zip(srcs, offsets, strict=True):
        assert torch.equal(arena[offset : offset + src.nbytes], as_bytes(src).cpu())
        written[offset : offset + src.nbytes] = True
    assert bool((arena[~written] == 0xAB).all()), "bytes outside the ranges were written"


def counted_batches(monkeypatch: pytest.MonkeyPatch, copier: BatchCopier | None) -> list[int]:
    """The sizes of the batches copier is given from now on (each call's copy count)."""
    calls: list[int] = []
    real = BatchCopier.copy

    def counting(self: BatchCopier, *args: Any) -> None:
        if self is copier:
            calls.append(len(args[2]))
        real(self, *args)

    monkeypatch.setattr(BatchCopier, "copy", counting)
    return calls


def refuse_batches(monkeypatch: pytest.MonkeyPatch, copier: BatchCopier | None) -> None:
    """copier's batches are refused from now on (as a driver that cannot take them); the
    other copiers' go through."""
    queue = BatchCopier.copy

    def refuse(self: BatchCopier, *args: Any) -> None:
        if self is copier:
            raise CopyFailedError("cuMemcpyBatchAsync of 2 copies failed: refused for the test")
        queue(self, *args)

    monkeypatch.setattr(BatchCopier, "copy", refuse)


def needs_driver_batches(device: CudaDevice) -> None:
    """Skip unless the driver has cuMemcpyBatchAsync (CUDA 12.8 and later)."""
    if device.describe()["batched_copies"] != "cuMemcpyBatchAsync":
        pytest.skip("the driver has no cuMemcpyBatchAsync (before CUDA 12.8)")


def test_offloads_into_the_arena_take_one_driver_call(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_driver_batches(device)
    calls: list[int] = []
    real = BatchCopier.copy

    def counting(
        copier: BatchCopier, dsts: list[int], srcs: list[int], sizes: list[int], stream: int
    ) -> None:
        calls.append(len(sizes))
        real(copier, dsts, srcs, sizes, stream)

    monkeypatch.setattr(BatchCopier, "copy", counting)
    srcs = [random_tensor((128, 4096), torch.bfloat16, seed=i) for i in range(8)]  # 1 MiB
    srcs += [random_tensor((8, 4096), torch.bfloat16, seed=10 + i) for i in range(4)]  # 64 KiB
    arena = host_arena(device, 16 * MiB)
    offsets = list(itertools.accumulate((s.nbytes for s in srcs[:-1]), initial=0))
    assert copy_d2h_batch(device, srcs, arena, offsets, []).wait(30)
    assert calls == [9]  # eight 1 MiB features one by one, the 64 KiB ones gathered
    for src, offset in zip(srcs, offsets, strict=True):
        assert torch.equal(arena[offset : offset + src.nbytes], as_bytes(src).cpu())
    # One copy, and a host tensor outside the arena (not the cache's), go through torch.
    assert copy_d2h_batch(device, [srcs[1]], arena, [0], []).wait(30)
    assert torch.equal(arena[: srcs[1].nbytes], as_bytes(srcs[1]).cpu())
    outside = torch.zeros(2 * MiB, dtype=torch.uint8, pin_memory=True)
    assert copy_d2h_batch(device, srcs[:2], outside, [0, MiB], []).wait(30)
    assert calls == [9]
    assert torch.equal(outside[:MiB], as_bytes(srcs[0]).cpu())


@contextlib.contextmanager
def gil_wanted_elsewhere() -> Iterator[None]:
    """A thread that runs Python all along: whenever this one lets go of the GIL, that one
    takes it and keeps it until the interpreter's switch interval forces it back."""
    stop = threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.005)

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)


def test_queueing_driver_calls_keep_the_gil(device: CudaDevice) -> None:
    """Batched copies and a sleeper's check of a done fence hold the GIL through the driver.

    Each driver call that let go of it would wait up to a switch interval (5 ms) to get it
    back from the spinning thread: the 400 calls here (a context push, the copy and a pop
    per batch, one query per check) would take seconds.
    """
    needs_driver_batches(device)
    srcs = [random_tensor((8, 4096), torch.bfloat16, seed=i) for i in range(4)]  # 64 KiB
    arena = host_arena(device, MiB)
    offsets = [i * MiB // 4 for i in range(4)]
    done = device.record(side_stream())
    assert done.wait(30)
    sleeper = CudaDriver.get().sleeper(0)
    copier = device._batches.copier
    assert copier is not None
    stream = device.d2h_stream
    dsts = [arena.data_ptr() + offset for offset in offsets]
    ptrs = [src.data_ptr() for src in srcs]
    sizes = [src.nbytes for src in srcs]
    try:
        with gil_wanted_elsewhere():
            start = time.perf_counter()
            for _ in range(100):
                copier.copy(dsts, ptrs, sizes, stream.cuda_stream)
                sleeper.sleep_until(done.event.cuda_event)
            elapsed = time.perf_counter() - start
        stream.synchronize()
    finally:
        sleeper.close()
    assert elapsed < 0.25, f"100 batched copies and checks took {elapsed:.3f} s"
    for src, offset in zip(srcs, offsets, strict=True):
        assert torch.equal(arena[offset : offset + src.nbytes], as_bytes(src).cpu())


def test_a_batch_the_driver_refuses_raises_copy_failed(device: CudaDevice) -> None:
    needs_driver_batches(device)
    copier = device._batches.copier
    assert copier is not None
    with pytest.raises(CopyFailedError, match="cuMemcpyBatchAsync of 0 copies failed"):
        copier.copy([], [], [], device.d2h_stream.cuda_stream)  # an empty batch is invalid


@pytest.mark.parametrize("gathers", [False, True], ids=["1MiB", "with-gathers"])
async def test_a_batch_the_driver_refuses_goes_through_torch_and_loses_nothing(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch, gathers: bool
) -> None:
    needs_driver_batches(device)
    refused: list[int] = []

    def refuse(
        copier: BatchCopier, dsts: list[int], srcs: list[int], sizes: list[int], stream: int
    ) -> None:
        refused.append(len(sizes))
        raise CopyFailedError("cuMemcpyBatchAsync of some copies failed: refused for the test")

    monkeypatch.setattr(BatchCopier, "copy", refuse)
    # Offloading half the tier ahead: batches of several features, one copy per 1 MiB
    # feature; with gathers, pairs of 64 KiB features between them are gathered first.
    s = await offload_and_read_back(
        device, [8 if gathers and i % 3 != 2 else 128 for i in range(60)]
    )
    assert len(refused) == 1 and refused[0] > 1, "no batch of several copies was refused"
    assert device.describe()["batched_copies"] == "torch copy_"  # from then on
    assert (s.copy_failures, s.dropped, s.leaked_bytes) == (0, 0, 0)
    assert s.cpu_entries > refused[0]


async def offload_and_read_back(device: CudaDevice, rows: list[int]) -> CacheStats:
    """Put features of rows x 4096 bf16 through a cache that offloads half its GPU tier
    ahead (batches of several features), drain, and check every read; the stats after
    the drain."""
    settings = CacheSettings(gpu_cache_mb=8, cpu_cache_mb=64, evict_ahead=0.5)
    features = {i: random_tensor((n, 4096), torch.bfloat16, seed=i) for i, n in enumerate(rows)}
    expected = {i: t.cpu() for i, t in features.items()}
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        await cache.wait_host_ready(timeout=30)
        for i in range(len(rows)):
            assert await cache.put(i, features.pop(i))
        await cache.drain()
        stats = cache.stats()
        for i, want in expected.items():
            got = await cache.get(i, device="cpu")
            assert got is not None and torch.equal(got, want), i
    return stats


@pytest.mark.parametrize("on", ["default", "side"])
@pytest.mark.parametrize("batch_copies", [True, False], ids=["driver-batch", "torch-copy"])
def test_uploads_of_a_turn_take_one_driver_call_in_the_readers_order(
    on: str, batch_copies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host hits uploaded for a reader (one buffer, one ordering) and promotions (the H2D
    stream) go to the driver as one batch each, a range across an arena chunk split at
    it; the bytes land after the reader's queued work (the legacy default stream's
    batches run on a side stream between two waits) and before its later work."""
    device = CudaDevice(0, batch_copies=batch_copies, pin_chunk_bytes=4 * MiB)
    if batch_copies:
        needs_driver_batches(device)
    copier = device._copies.h2d_batches
    assert (copier is not None) == batch_copies
    calls = counted_batches(monkeypatch, copier)
    arena = host_arena(device, 12 * MiB)
    arena.copy_(torch.randint(0, 255, (arena.numel(),), dtype=torch.uint8))
    # 1 MiB, 64 KiB, one byte, and 2 MiB across the first chunk boundary.
    spans = [(0, MiB), (MiB + 512, 64 * 1024), (2 * MiB, 1), (3 * MiB, 2 * MiB)]
    srcs = [arena[at : at + n] for at, n in spans]
    offsets, size = [], 0
    for _, n in spans:
        offsets.append(size)
        size += -(-n // 512) * 512 + 512
    reader = torch.cuda.default_stream() if on == "default" else side_stream()
    with torch.cuda.stream(reader):
        earlier = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    hold(reader)
    with torch.cuda.stream(reader):
        earlier.fill_(7)  # queued before the upload: the buffer may be this memory's next use
    del earlier
    buffer, fence = upload_packed_on(device, srcs, offsets, size, reader, [])
    if fence is not None:
        device.wait_on(reader, fence)
    with torch.cuda.stream(reader):
        seen = buffer.clone()  # after the upload in the reader's order
    device.use_on(buffer, reader)
    reader.synchronize()
    for (at, n), offset in zip(spans, offsets, strict=True):
        assert torch.equal(seen[offset : offset + n].cpu(), arena[at : at + n])
    dsts = [torch.empty(n, dtype=torch.uint8, device="cuda:0") for _, n in spans]
    assert copy_h2d_many(device, srcs, dsts, []).wait(30)
    assert all(torch.equal(d.cpu(), s) for d, s in zip(dsts, srcs, strict=True))
    # One call each; the 2 MiB range is two copies (one per registered chunk).
    assert calls == ([5, 5] if batch_copies else [])
    assert device.describe()["batched_uploads"] == (
        "cuMemcpyBatchAsync" if batch_copies else "torch copy_"
    )
    device.close()


def test_an_upload_batch_the_driver_refuses_goes_through_torch(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_driver_batches(device)
    copier = device._copies.h2d_batches
    refuse_batches(monkeypatch, copier)
    arena = host_arena(device, 2 * MiB)
    arena.copy_(torch.randint(0, 255, (arena.numel(),), dtype=torch.uint8))
    srcs = [arena[:MiB], arena[MiB:]]
    buffer, fence = upload_packed_on(device, srcs, [0, MiB], 2 * MiB, side_stream(), [])
    assert fence is None or fence.wait(30)
    torch.cuda.synchronize()
    assert torch.equal(buffer.cpu(), arena)
    assert device.describe()["batched_uploads"] == "torch copy_"  # from then on
    assert device.describe()["batched_copies"] == "cuMemcpyBatchAsync"  # offloads keep theirs


@pytest.mark.parametrize("method", ["register", "hostalloc"])
def test_batched_copies_across_arena_chunks_are_exact(
    method: ArenaMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = CudaDevice(0, arena_method=method, pin_chunk_bytes=4 * MiB)
    needs_driver_batches(device)
    arena = host_arena(device, 14 * MiB)
    arena.fill_(0xAB)
    # 3 MiB at 2.5 MiB crosses the first boundary, 5 MiB at 6 MiB the second, and a run
    # of small ones, gathered, the third.
    srcs = [random_tensor((3 * MiB,), torch.uint8, seed=1)]
    srcs += [random_tensor((5 * MiB,), torch.uint8, seed=2)]
    srcs += [random_tensor((16, 1024), torch.float32, seed=3 + i) for i in range(4)]
    offsets = [MiB * 5 // 2, 6 * MiB, 12 * MiB - 128 * 1024]
    offsets += [offsets[-1] + 64 * 1024 * i for i in range(1, 4)]
    pieces: list[tuple[int, int]] = []
    queue_batch = device._batches.queue_batch

    def recorded(dsts: list[int], srcs: list[int], sizes: list[int], stream: Any) -> None:
        pieces.extend((dst - arena.data_ptr(), size) for dst, size in zip(dsts, sizes, strict=True))
        queue_batch(dsts, srcs, sizes, stream)

    monkeypatch.setattr(device._batches, "queue_batch", recorded)
    assert copy_d2h_batch(device, srcs, arena, offsets, []).wait(30)
    # One call; with registrations of 4 MiB, no copy crosses one (a copy over two
    # registrations is not a copy into one pinned range).
    chunk = 4 * MiB if method == "register" else arena.numel()
    assert_copied_in_chunks(arena, srcs, offsets, pieces, chunk)
    if method == "register":
        assert len(pieces) == 6  # three ranges, each split in two
    device.close()


@pytest.mark.parametrize("method", ["register", "hostalloc"])
def test_owned_batches_go_to_the_driver_as_they_are(
    method: ArenaMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's own sources skip the per-source checks, not the ordering, the chunk
    splits or the bounds; a batch with a source to gather takes the checked path."""
    device = CudaDevice(0, arena_method=method, pin_chunk_bytes=4 * MiB)
    needs_driver_batches(device)
    arena = host_arena(device, 14 * MiB)
    arena.fill_(0xAB)
    srcs = [random_tensor((3 * MiB,), torch.uint8, seed=1)]  # across the first boundary
    srcs += [random_tensor((5 * MiB,), torch.uint8, seed=2)]  # across the second
    srcs += [random_tensor((128, 4096), torch.bfloat16, seed=3)]  # 1 MiB
    offsets = [MiB * 5 // 2, 6 * MiB, 12 * MiB]
    checked: list[int] = []
    pieces: list[tuple[int, int]] = []
    packed_runs, queue_batch = device._batches.packed_runs, device._batches.queue_batch

    def counted(ordered: list[tuple[int, torch.Tensor]]) -> Any:
        checked.append(len(ordered))
        return packed_runs(ordered)

    def recorded(dsts: list[int], srcs: list[int], sizes: list[int], stream: Any) -> None:
        pieces.extend((dst - arena.data_ptr(), size) for dst, size in zip(dsts, sizes, strict=True))
        queue_batch(dsts, srcs, sizes, stream)

    monkeypatch.setattr(device._batches, "packed_runs", counted)
    monkeypatch.setattr(device._batches, "queue_batch", recorded)
    gate, _ = rewritten_behind_a_hold(device, srcs, seed=10)
    fence = copy_d2h_batch(device, srcs, arena, offsets, [gate], owned=True)
    assert not fence.done()
    assert fence.wait(30)
    assert checked == []  # no source checked again
    chunk = 4 * MiB if method == "register" else arena.numel()
    assert_copied_in_chunks(arena, srcs, offsets, pieces, chunk)
    # Bounds are still checked, before anything is queued.
    queued = len(pieces)
    with pytest.raises(InvalidValueError, match="outside"):
        copy_d2h_batch(device, srcs[1:], arena, [0, 14 * MiB - 4096], [], owned=True)
    assert len(pieces) == queued
    # A source small enough to gather with its neighbours: the checked path.
    small = [random_tensor((16, 1024), torch.float32, seed=20 + i) for i in range(2)]
    batch = [srcs[2], *small]
    assert copy_d2h_batch(device, batch, arena, [0, MiB, MiB + 65536], [], owned=True).wait(30)
    assert checked == [3]
    for src, offset in zip([srcs[2], *small], [0, MiB, MiB + 65536], strict=True):
        assert torch.equal(arena[offset : offset + src.nbytes], as_bytes(src).cpu())
    device.close()


async def test_the_cache_offloads_its_own_features_unchecked(
    device: CudaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_driver_batches(device)
    checked: list[int] = []
    unchecked: list[int] = []
    packed_runs, owned_ranges = device._batches.packed_runs, device._batches.owned_ranges

    def counted(ordered: list[tuple[int, torch.Tensor]]) -> Any:
        checked.append(len(ordered))
        return packed_runs(ordered)

    def owned(srcs: list[torch.Tensor], host: torch.Tensor, offsets: list[int]) -> Any:
        ranges = owned_ranges(srcs, host, offsets)
        if ranges is not None:
            unchecked.append(len(srcs))
        return ranges

    monkeypatch.setattr(device._batches, "packed_runs", counted)
    monkeypatch.setattr(device._batches, "owned_ranges", owned)
    s = await offload_and_read_back(device, [128] * 40)  # 1 MiB features
    assert s.cpu_entries >= 30 and (s.copy_failures, s.dropped, s.leaked_bytes) == (0, 0, 0)
    assert unchecked, "no batch went to the driver unchecked"
    assert all(n == 1 for n in checked), checked  # only lone offloads, through torch


def test_release_holds_the_tensor_until_its_fences(device: CudaDevice) -> None:
    side = side_stream()
    t = torch.empty(1024, device="cuda:0")  # before the hold: a cudaMalloc may synchronise
    # Freeing an earlier test's pinned arena (cuMemFreeHost) synchronises the device: let
    # the collector run now, not while the stream is held.
    gc.collect()
    gc.disable()
    try:
        hold(side)
        reader = device.record(side)
        ref = weakref.ref(t)
        device.release(t, [reader, DONE])
        del t
        assert ref() is not None
    finally:
        gc.enable()
    assert reader.wait(30)
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ref() is None


def test_invalid_operands_are_refused(device: CudaDevice) -> None:
    arena = host_arena(device, MiB)
    gpu = torch.zeros(256, dtype=torch.float32, device="cuda:0")
    with pytest.raises(InvalidValueError):
        device.adopt(torch.zeros(4), device.current_stream())
    with pytest.raises(InvalidValueError):
        copy_d2h(device, gpu, arena[:100], [])  # 1024 bytes into 100
    with pytest.raises(InvalidValueError):
        copy_d2h(device, gpu.view(16, 16).t(), arena[:1024], [])  # not contiguous
    with pytest.raises(InvalidValueError):
        copy_h2d(device, arena[:1024], torch.zeros(256), [])  # destination on the host
    device.close()
    with pytest.raises(CacheClosedError):
        copy_d2h(device, gpu, arena[:1024], [])


def test_adopt_returns_an_alias(device: CudaDevice) -> None:
    t = torch.ones(10, device="cuda:0")
    own = device.adopt(t, device.current_stream())
    assert own is not t
    assert own.data_ptr() == t.data_ptr()


# --- the pinned host arena ---------------------------------------------------------------


def pinned_for_the_driver(address: int) -> bool:
    """Whether the CUDA driver takes address as page-locked host memory (cuMemHostGetFlags)."""
    lib = ctypes.CDLL("libcuda.so.1")
    flags = ctypes.c_uint()
    return int(lib.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address))) == 0


@pytest.mark.parametrize("method", ["register", "hostalloc"])
def test_host_arena_is_pinned_and_copies_across_chunks(method: ArenaMethod) -> None:
    dev = CudaDevice(0, arena_method=method, pin_chunk_bytes=4 * MiB)
    n = 10 * MiB + 123
    arena = host_arena(dev, n)
    assert arena.dtype == torch.uint8
    assert arena.numel() == n
    for offset in (0, 4 * MiB - 1, 4 * MiB, 8 * MiB + 5, n - 1):
        # Asked of the driver: torch's is_pinned did not always see registered memory.
        assert pinned_for_the_driver(arena.data_ptr() + offset), offset
    with pytest.raises(MMCacheError):
        host_arena(dev, 1)  # made once
    # 3 MiB .. 9 MiB crosses two 4 MiB registrations.
    src = torch.randint(0, 255, (6 * MiB,), dtype=torch.uint8, device="cuda:0")
    window = arena[3 * MiB : 9 * MiB]
    made = dev.record(dev.current_stream())  # randint's kernel on the default stream
    down = copy_d2h(dev, src, window, [made])
    back = dev.empty((6 * MiB,), torch.uint8)
    assert copy_h2d(dev, window, back, [down]).wait(30)
    assert torch.equal(window, src.cpu())
    assert torch.equal(back, src)
    dev.close()
    if method == "register":
        assert not pinned_for_the_driver(arena.data_ptr())  # unpinned at close ...
    assert torch.equal(window, src.cpu())  # ... and still readable


@pytest.mark.parametrize("method", ["register", "hostalloc"])
def test_one_pinned_range_follows_the_registrations(method: ArenaMethod) -> None:
    dev = CudaDevice(0, arena_method=method, pin_chunk_bytes=4 * MiB)
    arena = host_arena(dev, 12 * MiB)
    inside = [arena[: 4 * MiB], arena[4 * MiB : 8 * MiB], arena[9 * MiB : 10 * MiB]]
    across = [arena[3 * MiB : 5 * MiB], arena[: 12 * MiB]]
    assert all(dev.one_pinned_range(view) for view in inside)
    assert [dev.one_pinned_range(view) for view in across] == [method == "hostalloc"] * 2
    assert dev.one_pinned_range(torch.empty(16 * MiB, dtype=torch.uint8))  # not the arena
    dev.close()


async def test_a_borrowed_feature_across_two_chunks_copies_to_the_gpu() -> None:
    """A 6 MiB feature in an arena of 4 MiB registrations crosses one: the view would be
    refused by a device copy, so borrow lends a copy, which copies to the GPU exactly."""
    device = CudaDevice(0, pin_chunk_bytes=4 * MiB, background_pinning=False)
    settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=16)
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        values = {}
        for key in ("a", "b"):  # "a" takes 0..6 MiB, "b" 6..12 MiB: both cross an edge
            value = torch.randint(0, 255, (6 * MiB,), dtype=torch.uint8, device="cuda:0")
            values[key] = value.clone()
            assert await cache.put(key, value)
        await cache.drain()
        for key, want in values.items():
            async with cache.borrow(key) as lent:
                assert lent is not None
                assert lent.untyped_storage().nbytes() == lent.nbytes  # a copy of its own
                assert torch.equal(lent.to("cuda:0"), want)
    device.close()


async def test_host_arena_pins_in_the_background(device: CudaDevice) -> None:
    future = device.host_arena(64 * MiB)
    arena = await asyncio.wrap_future(future)
    assert arena.numel() == 64 * MiB
    assert pinned_for_the_driver(arena.data_ptr() + arena.numel() - 1)
    assert device.arena_chunk_bytes is None  # the host pool may place blocks anywhere


def test_background_pinning_keeps_kernel_launches_moving() -> None:
    """Pinning holds a driver lock that the process's kernel launches wait for. One
    cuMemHostAlloc of the whole arena held them for all of it (about 0.5 s for 1 GiB on
    the H200 host); pinned in chunks with pauses, a launch waits a few ms at most."""
    device = CudaDevice(0)
    x = torch.zeros(1024, device="cuda:0")
    torch.cuda.synchronize()
    future = device.host_arena(1024 * MiB)
    worst, launches = 0.0, 0
    while not future.done():
        started = time.perf_counter()
        x.add_(1)
        worst = max(worst, time.perf_counter() - started)
        launches += 1
        time.sleep(0.0002)
    assert future.result().numel() == 1024 * MiB
    device.close()
    assert launches > 10  # the pinning took long enough to be watched
    assert worst < 0.05, f"a kernel launch waited {worst * 1e3:.0f} ms for the pinning"


def test_close_stops_a_background_pinning() -> None:
    device = CudaDevice(0)
    future = device.host_arena(8 * 1024 * MiB)  # about 3 s of pinning
    time.sleep(0.05)
    started = time.perf_counter()
    device.close()
    assert time.perf_counter() - started < 1.0
    with pytest.raises(MMCacheError, match="closed while its host arena was pinned"):
        future.result()


def test_fence_type(device: CudaDevice) -> None:
    fence = device.record(device.current_stream())
    assert isinstance(fence, CudaFence)
    assert fence.wait(30)
    assert "gpu" in device.describe()


def test_a_gpu_tier_larger_than_the_gpu_is_refused(device: CudaDevice) -> None:
    total = torch.cuda.get_device_properties(device.name).total_memory
    assert device.memory_bytes == total
    too_much = total // 2**20 + 1
    with pytest.raises(SettingsError, match=r"^a GPU tier of \d+ MB exceeds the memory of cuda:"):
        FeatureCache(CacheSettings(gpu_cache_mb=too_much), device, registry=CollectorRegistry())


# --- warm-up ----------------------------------------------------------------------------

_FIRST_CALLS = """
import json, sys, time, torch
from mmcache.device import CopyPlan, NewCopyPlan
from mmcache.device.cuda import CudaDevice

def first_ms(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3

torch.empty(1, device="cuda")
device = CudaDevice(0, background_pinning=False)
x = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")
y = torch.empty(64, 4096, dtype=torch.float32, device="cuda")
z = torch.empty(4, 16, 64, dtype=torch.bfloat16, device="cuda")
square = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
stream = device.current_stream()

def pack(rows):  # what a put_many of a group does: its rows back to back
    return device.submit(NewCopyPlan("d2d", rows, rows=True, stream=stream))

times = {
    "pack bf16": first_ms(lambda: pack([x[:10], x[10:30]])),
    "pack fp32": first_ms(lambda: pack([y[:10], y[10:30]])),
    "pack 3-D bf16": first_ms(lambda: pack([z[:1], z[1:3], z[3:]])),
    "strided d2d copy": first_ms(
        lambda: device.submit(CopyPlan("d2d", (x[:, :64].t(),), (square,), stream=stream))
    ),
    "record_stream": first_ms(lambda: device.use_on(x, device.d2h_stream)),
    "pinned host tensor": first_ms(lambda: device.empty((16, 4096), torch.bfloat16, host=True)),
    # Not warmed by the device: shows whether this process loads kernels lazily at all.
    "control: cumsum": first_ms(lambda: torch.cumsum(y, dim=0)),
}
device.close()
json.dump(times, sys.stdout)
"""


def test_a_new_device_has_loaded_what_the_first_put_and_get_use() -> None:
    """CUDA loads kernels on first launch: a fresh device must not leave that to the loop."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_CALLS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout)
    control = times.pop("control: cumsum")
    if control < 5:
        pytest.skip(f"kernels are not loaded lazily here (first cumsum: {control:.1f} ms)")
    slow = {name: round(ms, 1) for name, ms in times.items() if ms > 3}
    assert not slow, f"first calls after the warm-up (ms): {slow}; an unwarmed kernel: {control}"


_VIEWS_THROUGH_THE_COPIES = """
import asyncio, ctypes, torch
from mmcache import CacheSettings, FeatureCache
from mmcache.device.cuda import CudaDevice
from prometheus_client import CollectorRegistry
from mmcache.device import CopyPlan

async def main():
    device = CudaDevice(0)
    stream = torch.cuda.Stream()
    values = torch.complex(torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"))
    expected = []
    buffer = torch.zeros(4 * values.nbytes, dtype=torch.uint8, device="cuda")
    for i, view in enumerate((values.conj(), values._neg_view())):
        own = device.empty(tuple(view.shape), view.dtype, stream)
        assert device.submit(CopyPlan("d2d", (view,), (own,), stream=stream)).wait(30)
        assert torch.equal(own, view.resolve_conj().resolve_neg())
        at = [2 * i * values.nbytes, (2 * i + 1) * values.nbytes]
        plan = CopyPlan("d2d", [view, values.clone()], into=buffer, offsets=at, stream=stream)
        assert device.submit(plan).wait(30)
        expected += [view.resolve_conj().resolve_neg(), values]
    assert torch.equal(buffer.view(torch.complex64).view(-1, 64), torch.cat(expected))
    cache = FeatureCache(CacheSettings(gpu_cache_mb=1, cpu_cache_mb=4), device,
                         registry=CollectorRegistry())
    async with cache:
        assert await cache.put("conj", values.conj())
        got = await cache.get("conj", device="cpu")
        assert torch.equal(got, values.conj().resolve_conj().cpu())
    device.close()
    ctypes.CDLL(None).malloc_trim(0)  # walks the heap's free chunks: damage aborts here

asyncio.run(main())
print("intact")
"""


def _checked_malloc() -> str | None:
    """glibc's checking malloc (preloaded, it aborts on the first damaged chunk it meets)."""
    for pattern in ("/lib*/*/libc_malloc_debug.so.0", "/usr/lib*/*/libc_malloc_debug.so.0"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def test_conjugate_and_negative_views_leave_the_host_heap_intact() -> None:
    # record_stream of such a view corrupts the host heap (torch 2.11): the process aborts
    # later, wherever malloc next meets the damage. Under glibc's checking malloc, at once.
    library = _checked_malloc()
    if library is None:
        pytest.skip("glibc's libc_malloc_debug.so.0 is not installed")
    env = {**os.environ, "LD_PRELOAD": library, "MALLOC_CHECK_": "3", "LIBC_FATAL_STDERR_": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _VIEWS_THROUGH_THE_COPIES],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "intact", done.stderr[-3000:]

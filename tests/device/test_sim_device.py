"""The simulator itself must punish what a GPU would: early reuse, early reads, lost fences."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from device_copies import copy_d2d, copy_d2d_into, copy_d2h, copy_h2d, host_arena

from mmcache.device import SimDevice, storage_use_count
from mmcache.device.base import DONE, AllFences, DeferredFence, host_memory_bytes
from mmcache.device.sim import ARENA_PAGE, POISON_BYTE
from mmcache.errors import InvalidValueError, MMCacheError
from mmcache.host_pool import HostPool


def _poisoned(t: torch.Tensor) -> bool:
    return bool((t.reshape(-1).view(torch.uint8) == POISON_BYTE).all())


def test_the_simulator_has_this_machines_memory_unless_told_otherwise() -> None:
    ram = host_memory_bytes()
    assert ram is not None and ram > 0
    for device, expected in ((SimDevice(), ram), (SimDevice(memory_bytes=1 << 20), 1 << 20)):
        try:
            assert device.memory_bytes == expected
            assert device.describe()["memory_bytes"] == expected
        finally:
            device.close()
    with pytest.raises(ValueError, match="memory_bytes must be > 0"):
        SimDevice(memory_bytes=0)


def test_storage_use_count_counts_tensor_objects_not_names() -> None:
    t = torch.ones(4)
    assert storage_use_count(t) == 1
    name = t
    assert storage_use_count(t) == 1
    alias = t.detach()
    view = t[1:]
    assert storage_use_count(t) == 3
    del alias, view, name
    assert storage_use_count(t) == 1


def test_release_without_fence_then_queued_copy_reads_poison() -> None:
    dev = SimDevice()
    src = dev.adopt(torch.arange(1024, dtype=torch.float32), dev.default_stream)
    dst = torch.zeros(1024, dtype=torch.float32)
    with dev.hold():
        fence = copy_d2h(dev, src, dst, after=[])
        dev.release(src, after=[])  # the seed bug: no fence, source recycled at once
        del src
    fence.wait(5)
    assert fence.done()
    assert _poisoned(dst)
    dev.close()


def test_release_after_copy_fence_keeps_data() -> None:
    dev = SimDevice()
    src = dev.adopt(torch.arange(1024, dtype=torch.float32), dev.default_stream)
    dst = torch.zeros(1024, dtype=torch.float32)
    with dev.hold():
        fence = copy_d2h(dev, src, dst, after=[])
        dev.release(src, after=[fence])
        del src
        assert not fence.done()
        assert dev.allocated_bytes == 4096  # kept alive for the fence
    fence.wait(5)
    assert torch.equal(dst, torch.arange(1024, dtype=torch.float32))
    assert dev.allocated_bytes == 0
    dev.close()


def test_memory_held_outside_is_not_recycled_until_dropped() -> None:
    dev = SimDevice()
    own = dev.adopt(torch.full((16,), 7.0), dev.default_stream)
    outside = own.detach()  # a caller's alias (what get() returns)
    dev.release(own, after=[])
    del own
    assert torch.equal(outside, torch.full((16,), 7.0))
    assert dev.allocated_bytes == 64
    del outside
    assert dev.allocated_bytes == 0
    dev.close()


def test_copies_read_their_source_when_they_run_not_when_queued() -> None:
    dev = SimDevice()
    src = dev.adopt(torch.zeros(8), dev.default_stream)
    dst = torch.empty(8)
    with dev.hold():
        fence = copy_d2h(dev, src, dst, after=[])
        src.fill_(3.0)
    fence.wait(5)
    assert torch.equal(dst, torch.full((8,), 3.0))
    dev.close()


def test_stream_order_and_held_copies_block_later_work_on_their_stream() -> None:
    dev = SimDevice()
    a = dev.adopt(torch.ones(4), dev.default_stream)
    b = torch.empty(4)
    with dev.hold():
        first = copy_d2h(dev, a, b, after=[])
    second = copy_d2h(dev, a, torch.empty(4), after=[])  # not held, but queued behind
    other = copy_h2d(dev, torch.ones(4), dev.empty((4,), torch.float32), after=[])
    other.wait(5)
    assert first.done() and second.done()  # the hold ended before these ran
    dev.close()


def test_hold_keeps_copies_pending_until_the_block_exits() -> None:
    dev = SimDevice()
    a = dev.adopt(torch.ones(4), dev.default_stream)
    with dev.hold():
        fence = copy_d2h(dev, a, torch.empty(4), after=[])
        later = copy_d2h(dev, a, torch.empty(4), after=[])
        assert not fence.wait(0.05)
        assert not later.done()
    assert fence.wait(5) and later.wait(5)
    dev.close()


def test_copies_into_a_flat_buffer_land_at_their_offsets_in_stream_order() -> None:
    dev = SimDevice()
    stream = dev.stream("producer")
    srcs = [
        dev.adopt(torch.arange(6, dtype=torch.float32).view(2, 3), stream),
        dev.adopt(torch.arange(10, dtype=torch.int8), stream),
        dev.adopt(torch.arange(8, dtype=torch.float64).view(4, 2).t(), stream),  # strided
    ]
    dst = dev.adopt(torch.zeros(256, dtype=torch.uint8), stream)
    offsets = [0, 64, 128]
    with dev.hold():
        fence = copy_d2d_into(dev, srcs, dst, offsets, stream)
        srcs[0].fill_(7.0)  # the copy reads its source when it runs
    assert fence.wait(5)
    for src, at in zip(srcs, offsets, strict=True):
        got = dst[at : at + src.nbytes].view(src.dtype).view(src.shape)
        assert torch.equal(got, src)
    with pytest.raises(InvalidValueError, match="falls outside the 256-byte destination"):
        copy_d2d_into(dev, srcs[:1], dst, [240], stream)
    with pytest.raises(InvalidValueError, match="flat uint8"):
        copy_d2d_into(dev, srcs[:1], dst.view(torch.float32), [0], stream)
    dev.close()


def test_dependencies_order_copies_across_streams() -> None:
    dev = SimDevice()
    producer = dev.stream("producer")
    out = dev.adopt(torch.zeros(4), producer)
    gate = threading.Event()
    with dev.hold():
        dev.launch(producer, lambda: (gate.wait(5), out.fill_(5.0)))
        ready = dev.record(producer)
    dst = torch.empty(4)
    fence = copy_d2h(dev, out, dst, after=[ready])
    gate.set()
    fence.wait(5)
    assert torch.equal(dst, torch.full((4,), 5.0))
    dev.close()


def test_fresh_arena_blocks_and_fresh_device_memory_are_poisoned() -> None:
    dev = SimDevice()
    arena = host_arena(dev, 3 * ARENA_PAGE)
    arena.zero_()  # what untouched pages read as
    pool = HostPool(dev, arena, alignment=512, defer=lambda fences, fn: fn())
    first = pool.allocate(4096)
    straddling = pool.allocate_run([ARENA_PAGE, ARENA_PAGE])
    assert first is not None and straddling is not None
    assert _poisoned(first.view) and all(_poisoned(b.view) for b in straddling)
    first.view.fill_(7)  # a live block's bytes are not poisoned by a later hand-out nearby
    second = pool.allocate(4096)
    assert second is not None and _poisoned(second.view)
    assert bool((first.view == 7).all())
    t = dev.empty((8, 8), torch.bfloat16)
    assert torch.isnan(t.float()).all()
    dev.close()


def test_an_arena_pins_chunk_by_chunk_and_only_pinned_bytes_are_handed_out() -> None:
    dev = SimDevice(pin_chunk_bytes=ARENA_PAGE, pin_chunk_s=0.05)
    reports: list[int] = []

    def report(arena: torch.Tensor, ready: int) -> bool:
        reports.append(ready)
        return True

    future = dev.host_arena(3 * ARENA_PAGE, report)
    arena = future.result(timeout=5)
    assert reports == [ARENA_PAGE, 2 * ARENA_PAGE, 3 * ARENA_PAGE]
    assert dev.pinned_bytes == 3 * ARENA_PAGE
    dev.close()
    assert dev.pinned_bytes == 0
    del arena

    dev = SimDevice(pin_chunk_bytes=ARENA_PAGE, pin_chunk_s=0.05)
    first = threading.Event()
    seen: list[torch.Tensor] = []

    def pinned(arena: torch.Tensor, ready: int) -> bool:
        seen.append(arena)
        first.set()
        return True

    future = dev.host_arena(64 * ARENA_PAGE, pinned)
    assert first.wait(5)
    arena = seen[0]
    with pytest.raises(RuntimeError, match="pinned"):  # a pool must never get this far
        dev.poison_host(arena, 0, 60 * ARENA_PAGE, unused=True)
    started = time.monotonic()
    dev.close()  # stops at the next chunk and unpins
    assert time.monotonic() - started < 1.0
    with pytest.raises(MMCacheError, match="closed while its host arena was pinned"):
        future.result(timeout=5)
    assert dev.pinned_bytes == 0


@pytest.mark.parametrize("kind", ["copy_fails", "fence_never_completes"])
def test_injected_faults(kind: str) -> None:
    dev = SimDevice()
    src = dev.adopt(torch.ones(4), dev.default_stream)
    dev.inject(kind)  # type: ignore[arg-type]
    fence = copy_d2h(dev, src, torch.empty(4), after=[])
    if kind == "copy_fails":
        assert fence.wait(5) and fence.exception() is not None
    else:
        assert not fence.wait(0.05)
    dev.close()


def test_ok_is_done_without_error_for_every_kind_of_fence() -> None:
    """ok() (one call where a read would ask done() and exception()) agrees with them:
    pending, failed, good; recorded, deferred and already done."""
    dev = SimDevice()
    src = dev.adopt(torch.ones(4), dev.default_stream)
    with dev.hold():
        pending = copy_d2h(dev, src, torch.empty(4), after=[])
        deferred = DeferredFence(dev, dev.d2h_stream)  # behind the held copy
        assert not pending.ok() and not pending.done()
        assert not deferred.ok() and deferred.recorded  # asking records it
    dev.inject("copy_fails")
    failed = copy_d2h(dev, src, torch.empty(4), after=[])
    behind_failed = DeferredFence(dev, dev.d2h_stream)
    for fence in (pending, deferred, failed, behind_failed):
        assert fence.wait(5)
        assert fence.ok() == (fence.done() and fence.exception() is None)
    assert pending.ok() and deferred.ok() and not failed.ok()
    assert DONE.ok() and DONE.done()
    assert AllFences([pending, failed]).ok() is False
    dev.close()


def test_bandwidth_and_latency_slow_copies_down() -> None:
    dev = SimDevice(bandwidth_gbps=0.01, latency_s=0.0)  # 10 MB/s
    src = dev.adopt(torch.ones(256 * 1024, dtype=torch.uint8), dev.default_stream)
    fence = copy_d2h(dev, src, torch.empty(256 * 1024, dtype=torch.uint8), after=[])
    assert not fence.wait(0.005)  # 256 KiB at 10 MB/s takes ~26 ms
    assert fence.wait(5)
    dev.close()


def test_memory_released_while_held_is_recycled_once_dropped_without_polling() -> None:
    """Released memory an outside alias kept alive is recycled by later releases, not leaked."""
    dev = SimDevice()
    for _ in range(50):
        own = dev.adopt(torch.ones(1024), dev.default_stream)
        outside = own.detach()
        dev.release(own, after=[])
        del own, outside
    assert len(dev._allocs) <= 1  # only the latest can still be waiting for a re-check
    assert dev.allocated_bytes == 0
    dev.close()


def test_a_device_dropped_without_close_keeps_no_thread_and_is_collected() -> None:
    # Test suites and short-lived tools drop devices: each one's worker must not outlive it.
    def workers() -> int:
        return sum(t.name == "mmcache-sim" for t in threading.enumerate())

    before = workers()
    device = SimDevice()
    src = torch.arange(16.0)
    dst = torch.empty(16)
    assert copy_d2d(device, src, dst, device.default_stream).wait(5)
    assert workers() == before + 1
    dropped = weakref.ref(device)
    del device
    deadline = time.monotonic() + 5
    while (workers() > before or dropped() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert workers() == before and dropped() is None


def test_a_worker_that_ended_while_idle_is_started_again_by_the_next_copy() -> None:
    device = SimDevice()
    try:
        src = torch.arange(16.0)
        for _ in range(2):
            dst = torch.empty(16)
            assert copy_d2d(device, src, dst, device.default_stream).wait(5)
            assert torch.equal(dst, src)
            time.sleep(1.3)  # past the idle limit: the worker ends
    finally:
        device.close()

"""Producer fences: one record per stream and loop iteration, never a wait too short.

A burst of puts on one stream records a fence at the first put and shares one deferred
fence among the rest, recorded when an offload or a read first needs it or when the
iteration ends. Each scenario checks the bytes every reader sees, so a fence shared too
widely (recorded before a later put's producer work) reads poison or stale memory here.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, stall
from device_copies import copy_d2d

from mmcache import FeatureCache
from mmcache.core.producer_fences import ProducerFences
from mmcache.device import SimDevice
from mmcache.device.base import DeferredFence, Fence, Stream

KIB = 16  # per feature


def count_records(monkeypatch: pytest.MonkeyPatch, rig: Rig) -> collections.Counter[int]:
    """Count the device's fence records per stream (by id) from now on."""
    counts: collections.Counter[int] = collections.Counter()
    record: Callable[[Stream], Fence] = rig.device.record

    def counting(stream: Stream) -> Fence:
        counts[id(stream)] += 1
        return record(stream)

    monkeypatch.setattr(rig.device, "record", counting)
    return counts


def side_stream(rig: Rig) -> Any:
    """A producer stream of the rig's device, not the current one."""
    if isinstance(rig.device, SimDevice):
        return rig.device.stream("encoder")
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def produce(rig: Rig, stream: Any, source: torch.Tensor) -> torch.Tensor:
    """A copy of source (on the device) made by work queued on stream that has not run yet."""
    dev = rig.device
    if isinstance(dev, SimDevice):
        out = dev.empty(tuple(source.shape), source.dtype)  # poison until the "kernel" runs
        dev.launch(stream, lambda: out.copy_(source))
        dev.release(out, after=[])  # empty()'s alias: the cache adopts one of its own
        return out
    with torch.cuda.stream(stream):
        stall(stream, 0.002)  # a misordered reader would read before the copy below
        return source.clone()


async def test_a_burst_of_puts_records_one_fence_and_shares_another(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(gpu_mb=4, cpu_mb=4)
    await cache.start()
    stream = side_stream(rig)
    counts = count_records(monkeypatch, rig)
    for i in range(16):
        assert await cache.put(i, feature(rig, KIB, seed=i), stream=stream)
    assert counts[id(stream)] == 1, "only the first put of the iteration records"
    await asyncio.sleep(0)  # the iteration ends: the fence the other 15 share is recorded
    assert counts[id(stream)] == 2
    assert await cache.put(16, feature(rig, KIB, seed=16), stream=stream)
    assert counts[id(stream)] == 3, "a new iteration's first put records again"
    assert await cache.put(17, feature(rig, KIB, seed=17), stream=stream)
    assert counts[id(stream)] == 3, "shared by a later put of the iteration"
    for i in (0, 1, 15, 16):
        assert_exact(await cache.get(i, device="cpu"), feature(rig, KIB, seed=i))


async def test_producer_fences_share_one_per_stream_and_iteration_on_the_loop_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ProducerFences itself: the fences it hands out, and which of them it records."""
    dev = SimDevice()
    try:
        fences = ProducerFences(dev)
        stream = dev.stream("encoder")
        counts = count_records(monkeypatch, Rig(dev, "sim"))
        assert not isinstance(fences.fence(stream), DeferredFence)  # unbound: records
        fences.bind(asyncio.get_running_loop())
        assert not isinstance(fences.fence(stream), DeferredFence)  # the iteration's first
        shared = fences.fence(stream)
        assert isinstance(shared, DeferredFence) and not shared.recorded
        assert all(fences.fence(stream) is shared for _ in range(14))
        assert counts[id(stream)] == 2
        await asyncio.sleep(0)  # the iteration ends: the shared fence is recorded
        assert shared.recorded and counts[id(stream)] == 3
        assert not isinstance(fences.fence(stream), DeferredFence), "a new iteration records"
        later = fences.fence(stream)
        assert isinstance(later, DeferredFence) and later is not shared
        off_loop = await asyncio.to_thread(fences.fence, stream)
        assert not isinstance(off_loop, DeferredFence), "shared with a thread off the loop"
        fences.unbind()
        assert later.recorded  # unbinding records what is shared
    finally:
        dev.close()


async def put_one(
    cache: FeatureCache, how: str, key: Hashable, value: torch.Tensor, stream: Any
) -> bool:
    """Cache one feature through put, a put_many of it alone, or a put_split of it whole."""
    if how == "put":
        return await cache.put(key, value, stream=stream)
    if how == "put_many":
        return await cache.put_many([(key, value)], stream=stream)
    return await cache.put_split([key], value, [value.shape[0]], stream=stream)


@pytest.mark.parametrize("how", ["put", "put_many", "put_split"])
async def test_each_put_of_a_burst_is_read_after_its_own_producer(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Producer work is queued just before each put, and runs only after the burst.

    Offloading ahead of need records the shared fence in the burst's middle, so the puts
    after that share a new one; reads are queued before any producer work has run. Every
    feature read on the host is its own producer's values: a fence shared too widely
    (the first put's, or one recorded before a later put) lets a copy read first.
    """
    count = 32
    cache = make_cache(gpu_mb=count * KIB / 1024, cpu_mb=1, evict_ahead=0.5)
    await cache.start()
    stream = side_stream(rig)
    sources = [feature(rig, KIB, seed=i) for i in range(count)]
    wants = [s.cpu() for s in sources]
    rig.settle()
    counts = count_records(monkeypatch, rig)
    with rig.hold():
        for i in range(count):
            assert await put_one(cache, how, i, produce(rig, stream, sources[i]), stream)
        evicted = cache.stats().evictions_gpu
        in_burst = counts[id(stream)]
        reads = [asyncio.create_task(cache.get(i, device="cpu")) for i in range(count)]
        await asyncio.sleep(0.02)  # each read queues its copy, or waits for its offload
    # An offload recorded a shared fence in the burst's middle, and the puts after it
    # shared another, recorded only by a read or the iteration's end.
    still_shared = counts[id(stream)] > in_burst
    assert 0 < evicted < count and in_burst >= 2 and still_shared, "no offload mid-burst"
    for i, read in enumerate(reads):
        assert_exact(await read, wants[i])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_shared_fence_is_recorded_when_its_iteration_ends(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work queued on the producer's stream in a later iteration is not the fence's to wait
    for: an offload and a host read of the feature go ahead while that work still runs."""
    cache = make_cache(gpu_mb=2 * KIB / 1024, cpu_mb=1)
    await cache.start()
    stream = side_stream(rig)
    want = feature(rig, KIB, seed=2)
    counts = count_records(monkeypatch, rig)
    assert await cache.put("first", feature(rig, KIB, seed=1), stream=stream)
    assert await cache.put("shared", want.clone(), stream=stream)
    assert counts[id(stream)] == 1  # the second put shares a fence not recorded yet
    await asyncio.sleep(0)
    assert counts[id(stream)] == 2  # recorded as the iteration ends
    dev = rig.device
    if isinstance(dev, SimDevice):  # the stream's next work never completes until unstuck
        dev.inject("fence_never_completes")
        copy_d2d(dev, feature(rig, 1), dev.empty((1, 256), torch.float32), stream)
    else:
        stall(stream, 5.0)

    async def offload_and_read() -> torch.Tensor | None:
        # Two more features need the tier's room: both earlier ones are offloaded.
        for key in ("x", "y"):
            assert await cache.put(key, feature(rig, KIB, seed=3))
        return await cache.get("shared", device="cpu")

    try:
        assert_exact(await asyncio.wait_for(offload_and_read(), 2.0), want)
    finally:
        if isinstance(dev, SimDevice):
            dev.unstick()
        else:
            torch.cuda.synchronize()

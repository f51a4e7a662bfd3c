"""Single gets of host-tier hits, and get_many calls, issued in one loop turn are served as
one batch."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Hashable
from typing import Any

import pytest
import torch
from conftest import CacheFactory, KiB, Rig, assert_exact, put_feature
from tracebacks import tensors_held_by

from mmcache.device import CopyPlan, NewCopyPlan, SimDevice
from mmcache.errors import CopyFailedError, CopyTimeoutError

pytestmark = pytest.mark.usefixtures("no_collection_during_reports")

FEATURE_KIB = 64


def count_uploads(device: SimDevice, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of sources of each host -> device copy submitted from now on."""
    uploads: list[int] = []
    submit = device.submit

    def counted(plan: CopyPlan | NewCopyPlan) -> Any:
        if plan.direction == "h2d":
            uploads.append(len(plan.srcs))
        return submit(plan)

    monkeypatch.setattr(device, "submit", counted)
    return uploads


async def host_resident(rig: Rig, cache: Any, count: int) -> dict[int, torch.Tensor]:
    """count features put and pushed to the host tier by as many more; their values."""
    want = {i: await put_feature(cache, rig, i, FEATURE_KIB, seed=i) for i in range(count)}
    for i in range(count, 2 * count):
        await put_feature(cache, rig, i, FEATURE_KIB, seed=i)
    await cache.drain()
    assert all(_on_host(cache, i) for i in range(count))
    return want


def _on_host(cache: Any, key: int) -> bool:
    return _in_tier(cache, key) == "host"


def _in_tier(cache: Any, key: int) -> str:
    entry = cache._core.state.index[key]  # the tier a feature is in, without reading it
    return str(entry.state.value)


@pytest.mark.parametrize("small_copy_kib", [4096, 0], ids=["reader-stream", "copy-stream"])
async def test_host_hits_of_one_turn_share_one_upload(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch, small_copy_kib: int
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("counts the simulator's submitted copies")
    cache = make_cache(
        gpu_mb=8 * FEATURE_KIB / KiB,
        cpu_mb=4,
        promote_on_hit=False,
        small_copy_bytes=small_copy_kib * KiB,
    )
    want = await host_resident(rig, cache, 8)
    uploads = count_uploads(rig.device, monkeypatch)
    got = await asyncio.gather(*(cache.get(i) for i in range(8)))
    assert uploads == [8], "one copy of all eight, not one each"
    for i, tensor in enumerate(got):
        assert_exact(tensor, want[i])
    assert cache.stats().hits_cpu == 8


async def test_host_hits_of_mixed_dtypes_and_shapes_in_one_turn_are_each_their_own(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """One turn's host hits of several dtypes and shapes (a scalar, odd sizes, rows of a
    group) come out of its upload each exact, contiguous, of its own dtype and shape,
    and apart: each written with its own value, none changes another."""
    cache = make_cache(gpu_mb=0.25, cpu_mb=8, promote_on_hit=False)
    specs: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((8, 64), torch.bfloat16),
        ((7,), torch.int8),
        ((), torch.float32),
        ((3, 5), torch.float64),
        ((2, 3, 4), torch.int16),
        ((1, 1, 3), torch.float16),
        ((5,), torch.bool),
    ]
    want: dict[Hashable, torch.Tensor] = {}
    for i, (shape, dtype) in enumerate(specs):
        count = math.prod(shape)
        value = (rig.tensor(max(1, count), seed=i)[:count] * 50).reshape(shape).to(dtype)
        want[i] = value.cpu().clone()
        assert await cache.put(i, value)
    rows = rig.tensor(6, 16, dtype=torch.float32, seed=20)
    want.update({"r0": rows[:1].cpu(), "r1": rows[1:3].cpu(), "r2": rows[3:].cpu()})
    assert await cache.put_split(["r0", "r1", "r2"], rows, [1, 2, 3])
    del rows
    for k in range(8):  # the GPU tier's room goes to these: every key above to the host
        await put_feature(cache, rig, ("filler", k), 64, seed=100 + k)
    await cache.drain()
    keys = list(want)
    assert all(_on_host(cache, k) for k in range(len(specs)))
    got = await asyncio.gather(*(cache.get(k) for k in keys))
    assert cache.stats().hits_cpu == len(keys)
    for key, tensor in zip(keys, got, strict=True):
        assert tensor is not None and tensor.is_contiguous(), key
        assert_exact(tensor, want[key])
    for n, tensor in enumerate(got):
        assert tensor is not None
        tensor.fill_(n % 2 == 0 if tensor.dtype == torch.bool else n + 1)
    for n, tensor in enumerate(got):
        assert tensor is not None
        mark = n % 2 == 0 if tensor.dtype == torch.bool else n + 1
        assert bool((tensor == mark).all()), f"{keys[n]} was written by another's fill"


async def test_gets_of_one_key_in_one_turn_read_it_once_and_count_each(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("counts the simulator's submitted copies")
    cache = make_cache(gpu_mb=2 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 2)
    uploads = count_uploads(rig.device, monkeypatch)
    before = cache.stats()
    got = await asyncio.gather(*(cache.get(key) for key in (0, 1, 0, 0)))
    assert uploads == [2], "each key copied once"
    for key, tensor in zip((0, 1, 0, 0), got, strict=True):
        assert_exact(tensor, want[key])
    after = cache.stats()
    assert after.hits_cpu - before.hits_cpu == 4  # every get is a lookup
    assert (after.hits_gpu, after.misses) == (before.hits_gpu, before.misses)


async def test_get_many_calls_of_one_turn_share_one_upload_with_its_gets(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler's requests each call get_many: their host hits, and the single gets of
    the same turn, are read by one copy; each call gets its own features, in its order,
    a key it gives twice read once and counted once."""
    if not isinstance(rig.device, SimDevice):
        pytest.skip("counts the simulator's submitted copies")
    cache = make_cache(gpu_mb=8 * FEATURE_KIB / KiB, cpu_mb=4, promote_on_hit=False)
    want = await host_resident(rig, cache, 8)
    resident = await put_feature(cache, rig, "gpu", FEATURE_KIB, seed=99)
    uploads = count_uploads(rig.device, monkeypatch)
    before = cache.stats()
    requests: list[list[Hashable]] = [[0, 1], [2, "gpu", 3, 2], [4, "nope"], [5, 6, 0]]
    single = asyncio.ensure_future(cache.get(7))  # starts in the same turn as the calls
    got = await asyncio.gather(*(cache.get_many(keys) for keys in requests))
    assert uploads == [8], "one copy for the turn, a key read once"
    for keys, tensors in zip(requests, got, strict=True):
        assert len(tensors) == len(keys)
        for key, tensor in zip(keys, tensors, strict=True):
            if key == "nope":
                assert tensor is None
            else:
                assert_exact(tensor, resident if key == "gpu" else want[int(str(key))])
    assert_exact(await single, want[7])
    after = cache.stats()
    # Every call's keys counted once each (2 gets of key 0: two lookups of it).
    assert after.hits_cpu - before.hits_cpu == 2 + 2 + 1 + 3 + 1
    assert (after.hits_gpu - before.hits_gpu, after.misses - before.misses) == (1, 1)


async def test_a_get_many_with_no_host_hit_is_served_at_once_as_get_is(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """Resident features and misses share no copy with the turn's other reads: the call
    ends on its first step, with no wait for the turn's end."""
    cache = make_cache(gpu_mb=4 * FEATURE_KIB / KiB, cpu_mb=1)
    want = {key: await put_feature(cache, rig, key, FEATURE_KIB, seed=key) for key in (0, 1)}
    await cache.drain()
    rig.settle()
    before = cache.stats()
    steps = cache.get_many([0, "nope", 1, 0]).__await__()
    with pytest.raises(StopIteration) as finished:
        steps.send(None)
    got = finished.value.value
    assert got[1] is None
    for key, tensor in zip([0, 1, 0], [got[0], got[2], got[3]], strict=True):
        assert_exact(tensor, want[key])
    assert got[0] is not got[3], "a key given twice gets an alias of its own"
    after = cache.stats()
    # The key given twice is read once and counted once, as in a batch of the turn.
    assert (after.hits_gpu - before.hits_gpu, after.misses - before.misses) == (2, 1)


async def test_a_get_manys_resident_features_are_read_at_once_its_host_hits_with_the_turn(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """Only the host hits of a get_many wait for the turn's copy batch: its resident
    features are looked up, counted and held on its first step, as get's are."""
    cache = make_cache(gpu_mb=2 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 2)  # 0 and 1 on the host tier, 2 and 3 resident
    assert _in_tier(cache, 2) == "gpu"
    resident = await cache.get(2)
    assert resident is not None
    expected = resident.cpu().clone()
    del resident
    before = cache.stats()
    call = asyncio.ensure_future(cache.get_many([2, 0]))
    await asyncio.sleep(0)  # its first step ran; the turn is not served yet
    during = cache.stats()
    assert (during.hits_gpu - before.hits_gpu, during.hits_cpu - before.hits_cpu) == (1, 0)
    assert cache.discard(2)  # after its read: the call holds what it read
    got = await call
    assert_exact(got[0], expected)
    assert_exact(got[1], want[0])
    assert cache.stats().hits_cpu - before.hits_cpu == 1
    del got
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


@pytest.mark.parametrize("how", ["cancelled", "failed"])
async def test_a_get_many_that_fails_waiting_for_its_turn_keeps_nothing_it_read(
    rig: Rig, make_cache: CacheFactory, how: str
) -> None:
    if how == "failed" and not isinstance(rig.device, SimDevice):
        pytest.skip("injects a failed copy into the simulator")
    cache = make_cache(gpu_mb=2 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    await host_resident(rig, cache, 2)  # 0 and 1 on the host tier, 2 and 3 resident
    if how == "failed":
        assert isinstance(rig.device, SimDevice)
        rig.device.inject("copy_fails", 1)
    call = asyncio.ensure_future(cache.get_many([2, 0]))
    await asyncio.sleep(0)  # its resident feature read, its host hit queued for the turn
    if how == "cancelled":
        call.cancel()
    with pytest.raises((asyncio.CancelledError, CopyFailedError)) as raised:
        await call
    assert tensors_held_by(raised.value, chained=True) == []
    del call, raised
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_cancelled_get_many_leaves_the_others_of_its_turn(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=4 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 4)
    calls = [asyncio.ensure_future(cache.get_many(keys)) for keys in ([0, 1], [2], [3, 0])]
    await asyncio.sleep(0)
    calls[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await calls[1]
    first, last = await calls[0], await calls[2]
    for key, tensor in zip([0, 1, 3, 0], [*first, *last], strict=True):
        assert_exact(tensor, want[key])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_host_hit_alone_in_its_turn_is_served(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=FEATURE_KIB / KiB, cpu_mb=1)
    want = await host_resident(rig, cache, 1)
    assert_exact(await cache.get(0), want[0])


async def test_a_key_discarded_before_its_turn_ends_is_a_miss(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=2 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 2)
    first = asyncio.ensure_future(cache.get(0))
    second = asyncio.ensure_future(cache.get(1))
    await asyncio.sleep(0)  # both queued in this turn, not served yet
    assert cache.discard(0)
    assert await first is None
    assert_exact(await second, want[1])
    assert cache.stats().leaked_bytes == 0


async def test_a_cancelled_get_leaves_the_others_of_its_turn(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=3 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 3)
    reads = [asyncio.ensure_future(cache.get(i)) for i in range(3)]
    await asyncio.sleep(0)
    reads[1].cancel()
    with pytest.raises(asyncio.CancelledError):
        await reads[1]
    assert_exact(await reads[0], want[0])
    assert_exact(await reads[2], want[2])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_gets_on_two_streams_are_each_ordered_on_their_own(
    rig: Rig, make_cache: CacheFactory
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("streams of the simulator")
    cache = make_cache(gpu_mb=4 * FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=False)
    want = await host_resident(rig, cache, 4)
    one, two = rig.device.stream("one"), rig.device.stream("two")
    got = await asyncio.gather(*(cache.get(i, stream=one if i % 2 else two) for i in range(4)))
    for i, tensor in enumerate(got):
        assert_exact(tensor, want[i])


async def _a_put_whose_compaction(cache: Any, rig: Rig, key: Hashable, fault: str) -> None:
    """Put a view of a larger tensor, so that the put compacts it by a device copy, and
    make that copy fail or never complete."""
    assert isinstance(rig.device, SimDevice)
    rig.device.inject(fault, 1)  # type: ignore[arg-type]
    larger = rig.tensor(2 * FEATURE_KIB, 256, dtype=torch.float32, seed=99)
    assert await cache.put(key, larger[:FEATURE_KIB])


async def test_a_failed_feature_fails_only_the_calls_that_asked_for_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("injects a failed copy into the simulator")
    cache = make_cache(gpu_mb=3 * FEATURE_KIB / KiB, cpu_mb=4, promote_on_hit=False)
    want = await host_resident(rig, cache, 3)
    cache.discard(5)  # room on the GPU tier for the failing one
    with rig.hold():
        await _a_put_whose_compaction(cache, rig, "bad", "copy_fails")
        # One loop turn: a get_many naming the failed feature, and gets of other features.
        many = asyncio.ensure_future(cache.get_many([1, "bad"]))
        one = asyncio.ensure_future(cache.get(0))
        other = asyncio.ensure_future(cache.get_many([2, 1]))
        await asyncio.sleep(0.05)
    with pytest.raises(CopyFailedError):
        await many
    assert_exact(await one, want[0])
    for key, tensor in zip([2, 1], await other, strict=True):
        assert_exact(tensor, want[key])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


@pytest.mark.parametrize("stream_ordered", [False, True], ids=["watched", "stream-ordered"])
async def test_a_feature_already_failed_fails_only_the_calls_that_asked_for_it(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch, stream_ordered: bool
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("injects a failed copy into the simulator")
    # stream-ordered: the turn is served as on CUDA, ordered on the stream at once (the
    # simulator's copies are then waited for below before the values are compared).
    monkeypatch.setattr(rig.device, "stream_ordered_reads", stream_ordered)
    cache = make_cache(gpu_mb=5 * FEATURE_KIB / KiB, cpu_mb=4, small_copy_bytes=0)
    want = await host_resident(rig, cache, 5)
    cache.discard(9)  # room for one promotion
    rig.device.inject("copy_fails", 1)
    with contextlib.suppress(CopyFailedError):  # stream-ordered: served before it fails
        await cache.get(4)  # promoted; its upload fails, which its readers are told
    rig.device.synchronize()
    assert _in_tier(cache, 4) == "gpu"  # failed, not dropped yet
    # The next turn looks 4 up with its fence failed already.
    many = asyncio.ensure_future(cache.get_many([1, 4]))
    one = asyncio.ensure_future(cache.get(0))
    with pytest.raises(CopyFailedError):
        await many
    served = await one
    rig.device.synchronize()
    assert_exact(served, want[0])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_copy_that_never_completes_times_out_only_the_calls_that_read_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    if not isinstance(rig.device, SimDevice):
        pytest.skip("injects a hung copy into the simulator")
    # Uploads on the copy stream: one on the reader's stream would be ordered behind the
    # hung copy, which the put queued there.
    cache = make_cache(
        gpu_mb=3 * FEATURE_KIB / KiB,
        cpu_mb=4,
        promote_on_hit=False,
        copy_timeout_s=0.3,
        small_copy_bytes=0,
    )
    want = await host_resident(rig, cache, 3)
    cache.discard(5)
    await _a_put_whose_compaction(cache, rig, "stuck", "fence_never_completes")
    try:
        many = asyncio.ensure_future(cache.get_many([1, "stuck"]))
        one = asyncio.ensure_future(cache.get(2))
        with pytest.raises(CopyTimeoutError):
            await many
        assert_exact(await one, want[2])
    finally:
        rig.device.unstick()
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_failed_upload_fails_only_the_calls_that_read_behind_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """One turn's host hits go behind two fences (the small ones copied on the reader's
    stream, the larger ones on the copy stream): a copy that fails behind one of them
    fails the calls that read behind it, not those served by the other."""
    if not isinstance(rig.device, SimDevice):
        pytest.skip("injects a failed copy into the simulator")
    cache = make_cache(
        gpu_mb=2 * FEATURE_KIB / KiB,
        cpu_mb=4,
        promote_on_hit=False,
        small_copy_bytes=FEATURE_KIB * KiB + 1,  # 0 and 1 below it, "large" above
    )
    await host_resident(rig, cache, 2)
    large_value = await put_feature(cache, rig, "large", 2 * FEATURE_KIB, seed=7)
    for i in (2, 3):
        await put_feature(cache, rig, i, FEATURE_KIB, seed=i)  # pushes "large" to the host
    await cache.drain()
    assert _on_host(cache, "large")  # type: ignore[arg-type]
    rig.device.inject("copy_fails", 1)  # the reader stream's copy, queued first
    small = asyncio.ensure_future(cache.get(0))
    large = asyncio.ensure_future(cache.get("large"))
    with pytest.raises(CopyFailedError):
        await small
    assert_exact(await large, large_value)
    await cache.drain()
    assert cache.stats().leaked_bytes == 0

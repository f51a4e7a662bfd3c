"""put_split: an encoder's batch output cached under one key per item, by row ranges.

The batch is cached as it is (no copy) when it owns its storage and one host block can
take it; larger batches are cut into runs of features, each copied into storage of its
own. Every scenario reads every key back bit for bit and checks the ledger.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import pytest
import torch
from conftest import (
    CacheFactory,
    Rig,
    assert_exact,
    feature,
    live_members,
    live_units,
    served_from,
    stall,
)
from device_copies import copy_d2d
from test_groups import assert_clean, assert_reads, offload_copies, simulator

from mmcache import FeatureCache, InvalidKeyError, InvalidValueError, ValueTooLargeError
from mmcache.device import SimDevice
from mmcache.waiting import FenceWatcher

KiB = 1024


def split(tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """tensor.split(rows) (typed): each item's rows, as views."""
    starts = [0, *itertools.accumulate(rows)]
    return [tensor[a:b] for a, b in itertools.pairwise(starts)]


def encoder_output(rig: Rig, rows: list[int], seed: int = 0) -> tuple[torch.Tensor, list[Any]]:
    """One float32 batch of sum(rows) rows of 1 KiB, and each item's rows as host clones."""
    batch = rig.tensor(sum(rows), 256, dtype=torch.float32, seed=seed)
    return batch, [part.cpu().clone() for part in split(batch, rows)]


async def put_batch(
    cache: FeatureCache, rig: Rig, name: str, rows: list[int], seed: int = 0
) -> list[torch.Tensor]:
    """put_split a fresh batch under (name, i), dropping our reference; return clones."""
    batch, want = encoder_output(rig, rows, seed)
    assert await cache.put_split([(name, i) for i in range(len(rows))], batch, rows)
    del batch
    return want


async def test_a_batch_is_cached_as_it_is_and_every_key_reads_exactly(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    rows = [8, 16, 1, 39]
    batch, want = encoder_output(rig, rows)
    assert await cache.put_split([("img", i) for i in range(4)], batch, rows)
    for i, part in enumerate(split(batch, rows)):  # no copy: each key reads its rows in place
        got = await cache.get(("img", i))
        assert got is not None and (got.data_ptr(), got.shape) == (part.data_ptr(), part.shape)
    del batch, part, got
    s = cache.stats()
    assert (len(cache), s.gpu_entries, s.gpu_bytes) == (4, 4, 64 * KiB)
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("img", i)), expected)
        assert_exact(await cache.get(("img", i), device="cpu"), expected)
        assert_exact(await cache.get(("img", i), rows=slice(-1, None)), expected[-1:])
    await assert_clean(rig, cache)


async def test_a_batch_reads_the_same_as_put_many_of_its_split(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    rows = [3, 5, 7]
    batch, want = encoder_output(rig, rows, seed=5)
    assert await cache.put_many(((("many", i), p) for i, p in enumerate(split(batch, rows))))
    assert await cache.put_split([("split", i) for i in range(3)], batch, rows)
    del batch
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("split", i)), expected)
        many = await cache.get(("many", i))
        assert many is not None
        assert_exact(await cache.get(("split", i)), many)
    await assert_clean(rig, cache)


async def test_one_key_is_an_entry_of_its_own(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    want = await put_batch(cache, rig, "one", [12])
    assert (len(live_units()), live_members()) == (1, 0)  # not a group of one
    await assert_reads(cache, lambda i: ("one", i), want)
    await assert_clean(rig, cache)


async def test_a_batch_leaves_the_gpu_by_one_copy_and_reads_back_from_the_host(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.5, cpu_mb=4)
    want = await put_batch(cache, rig, "a", [100, 100, 56])  # 256 KiB: half the GPU tier
    await put_batch(cache, rig, "b", [128, 128], seed=1)
    await put_batch(cache, rig, "c", [64] * 4, seed=2)  # makes room: batch a goes
    await cache.drain()
    s = cache.stats()
    assert (offload_copies(cache), s.evictions_gpu, s.cpu_entries) == (1, 3, 3)
    assert await served_from(cache, ("a", 0)) == "cpu"
    await assert_reads(cache, lambda i: ("a", i), want, device="cpu")
    assert_exact(await cache.get(("a", 2), rows=slice(50, 56)), want[2][50:56])
    await assert_clean(rig, cache)


async def test_a_batch_larger_than_a_host_block_is_cut_into_runs_of_its_features(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=4, cpu_mb=1)  # the host tier takes 1 MB at most
    rows = [64] * 20 + [1500, 40]  # 64 KiB features, one of 1.5 MB, one of 40 KiB
    base = rig.allocated_bytes()
    batch, want = encoder_output(rig, rows, seed=7)
    keys = [("big", i) for i in range(len(rows))]
    assert await cache.put_split(keys, batch, rows)
    del batch
    # Runs of 16 and 4 features (≤ 1 MB a run), the 1.5 MB one and the last alone
    # (test_groups checks the cut itself).
    assert (len(live_units()), live_members()) == (4, 20)
    assert cache.stats().gpu_bytes == sum(rows) * KiB
    rig.settle()
    assert rig.allocated_bytes() - base == sum(rows) * KiB  # the batch itself is let go
    await assert_reads(cache, lambda i: keys[i], want)
    # The host tier cannot take the 1.5 MB feature: evicted, it is dropped; runs land.
    await put_batch(cache, rig, "next", [1024] * 3, seed=8)
    await cache.drain()
    assert keys[20] not in cache and any(key in cache for key in keys[:20])
    for key, expected in zip(keys, want, strict=True):
        if key in cache:
            assert_exact(await cache.get(key), expected)
    await assert_clean(rig, cache)


async def test_a_strided_batch_is_compacted_once(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    wide = rig.tensor(48, 512, dtype=torch.float32, seed=9)
    batch = wide[:, ::2]  # 48 rows of 1 KiB, every other column
    rows = [16, 32]
    want = [part.cpu().clone() for part in split(batch, rows)]
    assert await cache.put_split(["x", "y"], batch, rows)
    x, y = await cache.get("x"), await cache.get("y")
    assert x is not None and y is not None and x.is_contiguous() and y.is_contiguous()
    assert y.data_ptr() == x.data_ptr() + 16 * KiB  # one contiguous copy of the batch
    del x, y
    assert cache.stats().gpu_bytes == 48 * KiB
    del wide, batch
    await assert_reads(cache, lambda i: "xy"[i], want)
    await assert_clean(rig, cache)


async def test_reads_wait_for_a_producer_still_running_when_the_batch_is_put(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    rows = [10, 20, 30]
    if rig.kind == "sim":
        sim = simulator(rig)
        # A stream of its own, run after the copy streams: reads are ordered after it
        # only by the fence put_split records, not by the simulator's run order.
        producer = sim.stream("producer")
        source = rig.tensor(60, 256, dtype=torch.float32, seed=9)
        with rig.hold():
            batch = sim.empty((60, 256), torch.float32, producer)  # poison until written
            copy_d2d(sim, source, batch, producer)  # the producer's work, held back
            assert await cache.put_split(["a", "b", "c"], batch, rows, stream=producer)
            del batch
            host_read = asyncio.ensure_future(cache.get("b", device="cpu"))
            await asyncio.sleep(0.05)
            assert not host_read.done()
        assert_exact(await host_read, split(source, rows)[1])
        assert_exact(await cache.get("c"), split(source, rows)[2])
        await assert_clean(rig, cache)
        return
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    base = rig.tensor(60, 256, dtype=torch.float32, seed=9)
    with torch.cuda.stream(side):
        stall(side, 0.2)  # the producer is still running when put_split returns
        batch = base * 2
    assert await cache.put_split(["a", "b", "c"], batch, rows, stream=side)
    del batch
    doubled = split((base * 2).cpu(), rows)
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(consumer):
        got = await cache.get("b")
        on_host = await cache.get("c", device="cpu")
    consumer.synchronize()
    assert_exact(got, doubled[1])
    assert_exact(on_host, doubled[2])
    await assert_clean(rig, cache)


async def test_a_batch_straight_to_the_host_tier(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    want = await put_batch(cache, rig, "h", [100, 28])
    await cache.drain()
    assert await served_from(cache, ("h", 1)) == "cpu"
    assert cache.stats().cpu_entries == 2
    await assert_reads(cache, lambda i: ("h", i), want)
    await assert_clean(rig, cache)


async def test_no_room_now_rejects_the_whole_batch(rig: Rig, make_cache: CacheFactory) -> None:
    sim = simulator(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=0.25)
    with sim.hold():
        want = await put_batch(cache, rig, "kept", [128, 64])
        # Room for this batch needs kept's offload, held back: refused without waiting.
        batch, _ = encoder_output(rig, [32, 40], seed=1)
        assert not await cache.put_split(["p", "q"], batch, [32, 40], wait=False)
    assert "p" not in cache and "q" not in cache and cache.stats().rejected == 2
    await assert_reads(cache, lambda i: ("kept", i), want)
    await assert_clean(rig, cache)


async def test_a_batch_replaces_keys_held_alone_and_in_groups(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    await put_batch(cache, rig, "k", [4, 4, 4], seed=1)
    assert await cache.put(("k", 3), rig.tensor(4, 256, dtype=torch.float32, seed=2))
    want = await put_batch(cache, rig, "k", [2, 6, 1, 3], seed=3)
    assert len(cache) == 4
    await assert_reads(cache, lambda i: ("k", i), want)
    await cache.drain()
    assert cache.stats().gpu_bytes == 12 * KiB  # the old group went with its last member
    await assert_clean(rig, cache)


async def test_discarding_every_member_frees_the_batch(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    base = rig.allocated_bytes()
    await put_batch(cache, rig, "d", [16, 16])
    assert cache.discard(("d", 0))
    assert cache.stats().gpu_bytes == 32 * KiB  # its rows stay charged with the group
    assert cache.discard(("d", 1))
    await cache.drain()
    rig.settle()
    assert cache.stats().gpu_bytes == 0 and rig.allocated_bytes() == base
    await assert_clean(rig, cache)


@pytest.mark.parametrize(
    ("keys", "rows", "error", "says"),
    [
        (["a", "b"], [8], InvalidValueError, "2 keys and 1 split sizes"),
        (["a", "b"], [8, 8], InvalidValueError, "add up to 16 rows; the tensor has 24"),
        (["a", "b"], [24, 0], InvalidValueError, "positive"),
        (["a", "b"], [25, -1], InvalidValueError, "positive"),
        (["a", "b"], [True, 23], InvalidValueError, "positive ints"),
        (["a", "b"], [12.0, 12.0], InvalidValueError, "sequence of ints"),
        (["a", "a"], [12, 12], InvalidKeyError, "same key twice"),
        (["a", ["b"]], [12, 12], InvalidKeyError, "not list"),
        ("ab", [12, 12], InvalidKeyError, "a sequence of keys"),
    ],
)
async def test_bad_arguments_are_refused_and_lose_nothing(
    rig: Rig, make_cache: CacheFactory, keys: Any, rows: Any, error: type, says: str
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    want = await put_batch(cache, rig, "a", [24])
    batch, _ = encoder_output(rig, [24], seed=4)
    before = batch.cpu().clone()
    with pytest.raises(error, match=says):
        await cache.put_split(keys, batch, rows)
    assert len(cache) == 1 and "b" not in cache
    assert_exact(await cache.get(("a", 0)), want[0])
    assert_exact(batch, before)
    await assert_clean(rig, cache)


async def test_bad_tensors_are_refused(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    with pytest.raises(InvalidValueError, match="0-dim"):
        await cache.put_split(["s"], rig.tensor(1).reshape(()), [1])
    with pytest.raises(InvalidValueError, match="empty"):
        await cache.put_split(["e"], rig.tensor(4, 0), [4])
    with pytest.raises(InvalidValueError):
        await cache.put_split(["n"], [[1.0]], [1])  # type: ignore[arg-type]
    if not isinstance(rig.device, SimDevice):
        with pytest.raises(InvalidValueError, match=r"put_split\(\) needs a tensor on cuda"):
            await cache.put_split(["c", "d"], torch.ones(2, 4), [1, 1])
    batch, _ = encoder_output(rig, [200, 200])
    with pytest.raises(ValueTooLargeError, match="smaller groups"):
        await cache.put_split(["x", "y"], batch, [200, 200])
    assert len(cache) == 0
    await assert_clean(rig, cache)


async def test_reads_wait_for_the_compaction_of_a_strided_batch(
    rig: Rig, make_cache: CacheFactory
) -> None:
    sim = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    wide = rig.tensor(8, 512, dtype=torch.float32, seed=11)
    want = [p.clone() for p in split(wide[:, :256], [3, 5])]
    with sim.hold():
        assert await cache.put_split(["u", "v"], wide[:, :256], [3, 5])
        read = asyncio.ensure_future(cache.get("u", device="cpu"))
        await asyncio.sleep(0.02)
        assert not read.done()  # the compacting copy is held back, and the read after it
    assert_exact(await read, want[0])
    await assert_reads(cache, lambda i: "uv"[i], want)
    await assert_clean(rig, cache)


async def test_a_batch_larger_than_the_host_tier_with_the_gpu_tier_off_is_refused(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    batch, _ = encoder_output(rig, [256] * 6)  # 1.5 MB of 256 KiB features
    with pytest.raises(ValueTooLargeError, match="host tier"):
        await cache.put_split(list(range(6)), batch, [256] * 6)
    with pytest.raises(ValueTooLargeError, match="host tier"):
        await cache.put_many(enumerate(split(batch, [256] * 6)))
    with pytest.raises(ValueTooLargeError, match=re.escape("CacheSettings(gpu_cache_mb=...)")):
        await make_cache(gpu_mb=0.5, cpu_mb=1).put_split(["x", "y"], batch, [1024, 512])
    assert len(cache) == 0
    await assert_clean(rig, cache)


@pytest.mark.parametrize("how", ["put", "put_split"])
async def test_a_compaction_that_failed_while_the_put_waited_loses_its_keys(
    rig: Rig, make_cache: CacheFactory, how: str
) -> None:
    sim = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    for i in range(16):  # fills the GPU tier: the puts below wait for an offload to land
        assert await cache.put(i, feature(rig, 64, i))
    wide = rig.tensor(48, 512, dtype=torch.float32, seed=9)
    sim.inject("copy_fails", 1)  # the compaction of the strided value
    with sim.hold():
        if how == "put":
            put = asyncio.create_task(cache.put("x", wide[:, :256]))
        else:
            put = asyncio.create_task(cache.put_split(["x", "y"], wide[:, :256], [16, 32]))
        await asyncio.sleep(0.02)
        assert not put.done(), "the put found room while every copy was held"
        assert cache.stats().pending_copies > 0  # the offload it waits for
    assert await asyncio.wait_for(put, 5)
    await cache.drain()
    s = cache.stats()
    assert "x" not in cache and "y" not in cache and await cache.get("x") is None
    assert (s.copy_failures, s.dropped) == (1, 1 if how == "put" else 2)
    await assert_clean(rig, cache)


async def test_a_compaction_failing_as_the_batch_is_indexed_leaves_the_ledger_exact(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulator(rig)
    when_done = FenceWatcher.when_done
    armed = [True]

    def finishing(self: FenceWatcher, fences: Any, callback: Any, **kwargs: Any) -> None:
        for fence in fences if armed[0] else ():  # the copy ends (and fails) as the cache asks
            fence.wait()
        when_done(self, fences, callback, **kwargs)

    # Before the cache is made: its parts are handed the watcher's verb then.
    monkeypatch.setattr(FenceWatcher, "when_done", finishing)
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    await cache.start()
    wide = rig.tensor(48, 512, dtype=torch.float32, seed=9)
    sim.inject("copy_fails", 1)
    assert await cache.put_split(["x", "y"], wide[:, :256], [16, 32])
    armed[0] = False
    s = cache.stats()  # nothing of the lost batch is left to evict: the GPU tier is empty
    assert ("x" in cache, "y" in cache, s.gpu_entries, s.gpu_bytes) == (False, False, 0, 0)
    want = [await put_batch(cache, rig, f"next{i}", [150], seed=i) for i in range(3)]
    for i, expected in enumerate(want):  # room made by offloads, none of a lost entry
        assert_exact(await cache.get((f"next{i}", 0)), expected[0])
    await assert_clean(rig, cache)


@pytest.mark.parametrize("how", ["put", "put_split"])
async def test_with_the_gpu_tier_off_a_put_waiting_for_room_is_woken_by_a_landing(
    rig: Rig, make_cache: CacheFactory, how: str
) -> None:
    sim = simulator(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    first, _ = encoder_output(rig, [384, 384])
    second, want = encoder_output(rig, [256, 256], seed=1)
    with sim.hold():
        if how == "put":
            assert await cache.put("a", first)
            waiting = asyncio.ensure_future(cache.put("b", second))
        else:
            assert await cache.put_split(["a", "a2"], first, [384, 384])
            waiting = asyncio.ensure_future(cache.put_split(["b", "b2"], second, [256, 256]))
        del first, second
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the host tier is full of a copy still in flight
    assert await asyncio.wait_for(waiting, 5)  # the landing made "a" evictable: room
    assert "a" not in cache
    if how == "put":
        assert_exact(await cache.get("b"), torch.cat(want))
    else:
        await assert_reads(cache, lambda i: "b" if i == 0 else "b2", want)
    await assert_clean(rig, cache)


async def test_with_the_gpu_tier_off_a_batch_takes_its_host_blocks_all_at_once(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """Blocks taken one by one could fragment the arena: 200 KiB placed after a 300 KiB
    entry leaves no 1,800 KiB range even once that entry is evicted."""
    host_only = make_cache(gpu_mb=0, cpu_mb=2)
    await put_batch(host_only, rig, "e", [300])
    await host_only.drain()
    small = rig.tensor(200, 256, dtype=torch.float32, seed=1)
    large = rig.tensor(1800, 256, dtype=torch.float32, seed=2)
    want = [small.cpu().clone(), large.cpu().clone()]
    assert await asyncio.wait_for(host_only.put_many([("p", small), ("q", large)]), 5)
    del small, large
    await assert_reads(host_only, lambda i: "pq"[i], want)
    assert ("e", 0) not in host_only and host_only.stats().evictions_cpu == 1
    await assert_clean(rig, host_only)

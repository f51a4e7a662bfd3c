"""put_many groups: small features of one call packed into one entry, read per key.

A group is one entry for the tiers (one recency slot, one host block, one copy, one
landing); its members are row ranges of it. Each scenario checks every member bit for
bit, the ledger (no leaked bytes, entry counts in features), and what a member's
departure leaves charged.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from conftest import (
    CacheFactory,
    Rig,
    assert_exact,
    feature,
    live_units,
    metric,
    needs_hold,
    served_from,
    stall,
)
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, CopyFailedError, DeviceOutOfMemoryError, FeatureCache
from mmcache.core.packing import BATCH_BYTES, group_spans, runs
from mmcache.device import Fence, SimDevice, Stream

KiB = 1024


def features(rig: Rig, n: int, kib: int, seed: int = 0) -> list[torch.Tensor]:
    return [feature(rig, kib, seed + i) for i in range(n)]


async def put_group(
    cache: FeatureCache, rig: Rig, name: str, n: int, kib: int = 8, seed: int = 0
) -> list[torch.Tensor]:
    """put_many n alike features under (name, i); return host clones to compare with."""
    values = features(rig, n, kib, seed)
    want = [v.cpu().clone() for v in values]
    assert await cache.put_many(((name, i), v) for i, v in enumerate(values))
    return want


def simulator(rig: Rig) -> SimDevice:
    """The rig's simulator, where faults can be injected (skips on a GPU)."""
    needs_hold(rig)
    assert isinstance(rig.device, SimDevice)
    return rig.device


async def assert_reads(
    cache: FeatureCache, key: Any, want: list[torch.Tensor], device: str | None = None
) -> None:
    """Every feature key(i) (i indexing want) reads back exactly."""
    for i, expected in enumerate(want):
        assert_exact(await cache.get(key(i), device=device), expected)


async def assert_clean(rig: Rig, cache: FeatureCache) -> None:
    rig.settle()
    await cache.drain()
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0
    # A promoted feature keeps its host copy: it counts in both tiers (inclusive).
    assert max(s.gpu_entries, s.cpu_entries) <= len(cache) <= s.gpu_entries + s.cpu_entries


def offload_copies(cache: FeatureCache) -> int:
    """The offload copies that have landed so far (one per copy, whatever it moved)."""
    return int(metric(cache, "mmcache_copy_duration_seconds_count", direction="d2h"))


# --- which features are grouped -------------------------------------------------------


def _items(*specs: tuple[int, torch.dtype, tuple[int, ...]]) -> tuple[list[Any], list[int]]:
    items = [(i, torch.empty(shape, dtype=dtype)) for i, (_, dtype, shape) in enumerate(specs)]
    return items, [nbytes for nbytes, _, _ in specs]


def test_runs_of_alike_small_features_are_grouped_and_the_rest_stand_alone() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    items, sizes = _items(
        (4 * KiB, f32, (4, 256)),
        (8 * KiB, f32, (8, 256)),  # same dtype and row shape: same group
        (2 * KiB, bf16, (4, 256)),  # another dtype: a new run
        (2 * KiB, bf16, (4, 256)),
        (2 * KiB, bf16, (2, 512)),  # another row shape: a run of one
        (64 * KiB, bf16, (64, 512)),  # not small: alone
        (64 * KiB, bf16, (64, 512)),
        (4, f32, ()),  # a scalar has no rows: alone
        (4 * KiB, f32, (4, 256)),
    )
    spans = group_spans(items, sizes, small_bytes=32 * KiB, host_limit=1 << 30)
    assert spans == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]


def test_a_group_is_cut_at_the_batch_size_and_at_what_one_host_block_takes() -> None:
    items, sizes = _items(*[(KiB, torch.float32, (1, 256))] * 10)
    assert group_spans(items, sizes, 1 << 20, host_limit=4 * KiB) == [(0, 4), (4, 8), (8, 10)]
    # put_split's runs: alike by definition, cut only by size (one too large stands alone).
    sizes = [64 * KiB] * 20 + [1500 * KiB, 40 * KiB]
    assert runs(sizes, None, 1024 * KiB) == [(0, 16), (16, 20), (20, 21), (21, 22)]
    big = BATCH_BYTES // 4
    items, sizes = _items(*[(big, torch.uint8, (big,))] * 6)
    assert group_spans(items, sizes, 1 << 30, host_limit=1 << 30) == [(0, 4), (4, 6)]


# --- a group on the GPU and on the host ----------------------------------------------


async def test_a_batch_of_alike_features_is_one_entry_and_every_key_reads_exactly(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    want = await put_group(cache, rig, "img", 16)
    assert len(live_units()) == 1  # one entry for the tiers
    s = cache.stats()
    assert (len(cache), s.gpu_entries, s.gpu_bytes) == (16, 16, 16 * 8 * KiB)
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("img", i)), expected)
        assert_exact(await cache.get(("img", i), device="cpu"), expected)
        assert_exact(await cache.get(("img", i), rows=slice(2, 5)), expected[2:5])
        assert_exact(await cache.get(("img", i), rows=slice(-1, None), device="cpu"), expected[-1:])
    await assert_clean(rig, cache)


async def test_views_of_one_batch_output_are_packed_into_one_tensor(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """An encoder's output for several images, split per image: one copy keeps them all."""
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    batch = rig.tensor(40, 256, dtype=torch.float32, seed=3)
    parts = [batch[:8], batch[8:24], batch[24:]]  # views, as torch.split makes them
    want = [part.cpu().clone() for part in parts]
    base = rig.allocated_bytes()
    assert await cache.put_many(enumerate(parts))
    del parts
    del batch
    rig.settle()
    await cache.drain()
    assert cache.stats().gpu_bytes == 40 * KiB
    if isinstance(rig.device, SimDevice):
        assert rig.allocated_bytes() == base + 40 * KiB  # one packed tensor, nothing else
    await assert_reads(cache, lambda i: i, want)
    await assert_clean(rig, cache)


async def test_a_group_leaves_the_gpu_whole_by_one_copy_and_reads_back_from_the_host(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.5, cpu_mb=4)
    want = await put_group(cache, rig, "a", 32)  # 256 KiB: half the GPU tier
    await put_group(cache, rig, "b", 32, seed=100)
    await put_group(cache, rig, "c", 32, seed=200)  # makes room: group a goes
    await cache.drain()
    assert offload_copies(cache) == 1  # one copy for 32 features
    assert len(live_units()) == 3  # a, b and c: one entry each
    assert await served_from(cache, ("a", 5)) == "cpu"
    s = cache.stats()
    assert (s.evictions_gpu, s.cpu_entries, s.gpu_entries, s.dropped) == (32, 32, 64, 0)
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("a", i), device="cpu"), expected)
        assert_exact(await cache.get(("a", i), rows=slice(3, 7)), expected[3:7])
    await assert_clean(rig, cache)


async def test_the_host_tier_evicts_a_group_whole_and_counts_its_features(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=0.25)
    for g in range(4):  # 128 KiB each: either tier holds two groups
        await put_group(cache, rig, f"g{g}", 16, seed=100 * g)
    await cache.drain()
    want = await put_group(cache, rig, "last", 16, seed=999)
    await cache.drain()
    s = cache.stats()
    assert s.evictions_cpu % 16 == 0 and s.evictions_cpu >= 16
    gone = [g for g in range(4) if (f"g{g}", 0) not in cache]
    assert gone and all((f"g{g}", i) not in cache for g in gone for i in range(16))
    await assert_reads(cache, lambda i: ("last", i), want)
    await assert_clean(rig, cache)


# --- members that go before their group ------------------------------------------------


async def test_a_discarded_member_stays_charged_until_its_group_goes(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    want = await put_group(cache, rig, "v", 4)
    for i in range(3):
        assert cache.discard(("v", i))
        assert not cache.discard(("v", i))
    s = cache.stats()
    assert (len(cache), s.gpu_entries, s.gpu_bytes) == (1, 1, 4 * 8 * KiB)
    assert await cache.get(("v", 0)) is None
    assert_exact(await cache.get(("v", 3)), want[3])
    assert cache.discard(("v", 3))
    await assert_clean(rig, cache)
    assert cache.stats().gpu_bytes == 0 and rig.allocated_bytes() >= 0


async def test_members_leaving_a_group_on_the_host_free_its_block_with_the_last(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.5, cpu_mb=4)
    want = await put_group(cache, rig, "h", 16)  # 128 KiB
    await put_group(cache, rig, "push", 49, seed=50)  # 392 KiB: h goes to the host
    await cache.drain()
    s = cache.stats()
    assert (s.cpu_entries, s.cpu_bytes) == (16, 16 * 8 * KiB)  # h on the host, whole
    assert await cache.put(("h", 1), feature(rig, 8, 77))  # replaced: on the GPU
    await cache.drain()
    before = cache.stats()
    assert before.cpu_bytes == 16 * 8 * KiB and before.cpu_entries == 15
    for i in range(2, 15):
        assert cache.discard(("h", i))
    after = cache.stats()
    assert (after.cpu_bytes, after.cpu_entries) == (before.cpu_bytes, 2)
    assert_exact(await cache.get(("h", 15), device="cpu"), want[15])
    assert_exact(await cache.get(("h", 1), device="cpu"), feature(rig, 8, 77).cpu())
    cache.discard(("h", 0))
    cache.discard(("h", 15))
    await assert_clean(rig, cache)
    assert cache.stats().cpu_bytes == 0


async def test_a_host_hit_promotes_the_member_alone(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    want = await put_group(cache, rig, "p", 16)
    await put_group(cache, rig, "push", 16, seed=50)
    await put_group(cache, rig, "push2", 8, seed=80)  # p goes to the host: 64 KiB free
    await cache.drain()
    before = cache.stats()
    assert (before.cpu_entries, before.cpu_bytes, before.gpu_entries) == (16, 128 * KiB, 24)
    got = await cache.get(("p", 4))
    assert_exact(got, want[4])
    del got
    # On the GPU in an entry of its own (its 8 KiB); its rows stay charged to the group.
    after = cache.stats()
    assert (after.promotions, after.cpu_entries, after.cpu_bytes) == (1, 15, 128 * KiB)
    assert (after.gpu_entries, after.gpu_bytes) == (25, before.gpu_bytes + 8 * KiB)
    assert await served_from(cache, ("p", 4)) == "gpu"
    await assert_reads(cache, lambda i: ("p", i), want, device="cpu")
    await assert_clean(rig, cache)


async def test_replacing_and_discarding_members_while_their_group_is_offloading(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    await put_group(cache, rig, "a", 16)  # 128 KiB
    want_b = await put_group(cache, rig, "b", 15, seed=100)  # 120 KiB: 8 KiB left
    new = feature(rig, 8, 555)
    want_new = new.cpu().clone()
    with rig.hold():
        # No room without waiting for a copy: refused, but a's offload has started (held).
        values = features(rig, 16, 8, 200)
        assert not await cache.put_many(enumerate(values), wait=False)
        del values
        s = cache.stats()  # a is being offloaded: counted in both tiers until it lands
        assert (s.pending_copies, s.cpu_entries, s.gpu_entries) == (16, 16, 31)
        assert await cache.put(("a", 0), new)
        del new
        for i in range(1, 16):
            cache.discard(("a", i))
        # The group holds no feature now; only its copy keeps it (and its bytes) alive.
        s = cache.stats()
        assert (len(cache), s.cpu_entries, s.gpu_entries, s.pending_copies) == (16, 0, 16, 16)
        assert s.leaked_bytes == 0
    await cache.drain()
    assert_exact(await cache.get(("a", 0), device="cpu"), want_new)
    await assert_reads(cache, lambda i: ("b", i), want_b, device="cpu")
    await assert_clean(rig, cache)
    assert cache.stats().cpu_bytes == 0  # the group's block went with its copy


# --- the packing copy ------------------------------------------------------------------


async def test_the_values_of_a_group_are_let_go_once_packed(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """The cache holds a group's values only until its packing copy has read them, also
    when nothing else happens: the loop looks again a few ms later."""
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    values = features(rig, 8, 8)
    want = [v.cpu().clone() for v in values]
    refs = [weakref.ref(v) for v in values]
    assert await cache.put_many(enumerate(values))
    del values
    rig.settle()
    for _ in range(200):
        if all(ref() is None for ref in refs):
            break
        await asyncio.sleep(0.005)
    assert all(ref() is None for ref in refs), "values kept after their packing copy"
    await assert_reads(cache, lambda i: i, want)
    await assert_clean(rig, cache)


async def test_reads_wait_for_a_producer_still_running_when_the_group_is_put(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """The packing copy runs after the producer's work on its stream, never before."""
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    if rig.kind == "sim":
        with rig.hold():
            want = await put_group(cache, rig, "r", 8)
            host_read = asyncio.ensure_future(cache.get(("r", 3), device="cpu"))
            await asyncio.sleep(0.05)
            assert not host_read.done()  # the packing copy is held back
        assert_exact(await host_read, want[3])
        return
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    base = rig.tensor(8, 8, 256, dtype=torch.float32, seed=9)
    with torch.cuda.stream(side):
        stall(side, 0.2)  # the producer is still running when put_many returns
        values = [base[i] * 2 for i in range(8)]
    assert await cache.put_many(enumerate(values), stream=side)
    del values
    doubled = (base * 2).cpu()
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(consumer):
        got = await cache.get(5)
        on_host = await cache.get(6, device="cpu")
    consumer.synchronize()
    assert_exact(got, doubled[5])
    assert_exact(on_host, doubled[6])
    await assert_clean(rig, cache)


async def test_a_failed_packing_copy_loses_the_group_and_never_serves_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    dev = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    keep = await put_group(cache, rig, "keep", 4, seed=7)
    with rig.hold():  # the copy fails only once the group is in the index
        dev.inject("copy_fails")
        await put_group(cache, rig, "bad", 4)
    rig.settle()
    await cache.drain()
    for i in range(4):
        try:
            got = await cache.get(("bad", i), device="cpu")
        except CopyFailedError:
            continue
        assert got is None, "a member of a failed packing copy was served"
    s = cache.stats()
    assert s.copy_failures == 1 and s.dropped == 4
    assert all(("bad", i) not in cache for i in range(4))
    await assert_reads(cache, lambda i: ("keep", i), keep)
    await assert_clean(rig, cache)


async def test_no_memory_to_pack_a_group_refuses_the_batch_and_keeps_the_old_values(
    rig: Rig, make_cache: CacheFactory
) -> None:
    dev = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    old = await put_group(cache, rig, "k", 4)
    dev.inject("alloc_fails")
    with pytest.raises(DeviceOutOfMemoryError):
        await cache.put_many((("k", i), v) for i, v in enumerate(features(rig, 4, 8, 40)))
    assert cache.stats().alloc_failures == 1
    await assert_reads(cache, lambda i: ("k", i), old)
    await assert_clean(rig, cache)


async def test_a_scalar_beside_a_group_is_cached_alone(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    scalar = rig.tensor(1, dtype=torch.float32, seed=5)[0]  # 0-dim: no rows to pack
    want_scalar = scalar.cpu().clone()
    values = features(rig, 3, 8)
    want = [v.cpu().clone() for v in values]
    assert await cache.put_many([("s", scalar), *((i, v) for i, v in enumerate(values))])
    del scalar, values
    assert_exact(await cache.get("s"), want_scalar)
    await assert_reads(cache, lambda i: i, want)
    assert len(live_units()) == 2  # the scalar, and one group for the rest
    await assert_clean(rig, cache)


async def test_alike_features_in_channels_last_layout_are_packed_contiguous(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """torch.cat keeps channels_last: the packed group must still be one contiguous block."""
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    values = [
        rig.tensor(1, 16, 16, 32, dtype=torch.float32, seed=i).contiguous(
            memory_format=torch.channels_last
        )
        for i in range(8)
    ]
    want = [v.cpu().clone() for v in values]
    assert await cache.put_many(enumerate(values))
    del values
    await put_group(cache, rig, "push", 32, seed=50)  # the group goes to the host tier
    await cache.drain()
    assert cache.stats().dropped == 0
    await assert_reads(cache, lambda i: i, want, device="cpu")
    await assert_reads(cache, lambda i: i, want)
    await assert_clean(rig, cache)


async def test_a_group_keeps_no_autograd_graph(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    weight = rig.tensor(8, 256, dtype=torch.float32).requires_grad_()
    values = [weight * (i + 1) for i in range(4)]  # an encoder's outputs, grad attached
    want = [v.detach().cpu().clone() for v in values]
    assert await cache.put_many(enumerate(values))
    del values
    got = await cache.get(2)
    assert got is not None and not got.requires_grad and got.grad_fn is None
    assert_exact(got, want[2])
    await assert_clean(rig, cache)


class _PackWithoutHolding(SimDevice):
    """Packs at once but does not keep the sources referenced: the cache must."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[weakref.ref[torch.Tensor]] = []

    def _pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        first = srcs[0]
        packed = self.empty((sum(s.shape[0] for s in srcs), *first.shape[1:]), first.dtype)
        torch.cat(list(srcs), out=packed)
        self.sources = [weakref.ref(src) for src in srcs]
        # The fence of a no-op queued on stream: held back inside hold(), as a copy would be.
        return packed, self.launch(self._as_sim_stream(stream), lambda: None)


async def test_the_cache_holds_a_groups_values_until_the_packing_copy_is_done() -> None:
    dev = _PackWithoutHolding()
    settings = CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1, evict_ahead=0)
    try:
        async with FeatureCache(settings, dev, registry=CollectorRegistry()) as cache:
            with dev.hold():
                values = [dev_value(dev, i) for i in range(4)]
                assert await cache.put_many(enumerate(values))
                del values
                await asyncio.sleep(0.02)  # past the loop's second look
                assert all(ref() is not None for ref in dev.sources), "values let go early"
            dev.synchronize()
            await cache.drain()
            assert all(ref() is None for ref in dev.sources), "values kept after packing"
    finally:
        dev.close()


def dev_value(dev: SimDevice, seed: int) -> torch.Tensor:
    return torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))


async def test_packings_finishing_out_of_order_let_go_of_their_values(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """A packing stuck on one stream keeps no other stream's values (that it does not poll
    is tests/core/test_packing.py's)."""
    dev = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=4, copy_timeout_s=0.2)
    stuck_stream, other = dev.stream("encoder-a"), dev.stream("encoder-b")
    dev.inject("fence_never_completes")
    stuck = features(rig, 4, 8)
    stuck_refs = [weakref.ref(v) for v in stuck]
    assert await cache.put_many(enumerate(stuck), stream=stuck_stream)
    del stuck
    values = features(rig, 4, 8, 20)
    refs = [weakref.ref(v) for v in values]
    assert await cache.put_many((("b", i), v) for i, v in enumerate(values)), other
    del values
    for _ in range(100):
        if all(ref() is None for ref in refs):
            break
        await asyncio.sleep(0.005)
    assert all(ref() is None for ref in refs), "stream b's values kept behind stream a's"
    assert all(ref() is not None for ref in stuck_refs), "values let go before their packing"
    dev.unstick()
    await cache.drain()
    assert all(ref() is None for ref in stuck_refs), "values kept after their packing"
    await assert_clean(rig, cache)


async def test_close_returns_while_a_packing_copy_never_finishes(
    rig: Rig, make_cache: CacheFactory
) -> None:
    dev = simulator(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=4, copy_timeout_s=0.2)
    dev.inject("fence_never_completes")
    assert await cache.put_many(enumerate(features(rig, 4, 8)))
    closing = asyncio.ensure_future(cache.close(timeout=0.2))
    done, _ = await asyncio.wait({closing}, timeout=5)
    dev.unstick()
    assert done, "close() hung on a stuck packing copy"
    await closing


async def test_a_refused_offload_straight_to_the_host_tier_leaves_the_ledger_exact(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU tier off: nothing was charged to it, so dropping the batch must not uncharge it."""
    dev = simulator(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=4)

    def refused(*args: Any, **kwargs: Any) -> Fence:
        raise DeviceOutOfMemoryError("simulated: no memory for the staging buffer")

    monkeypatch.setattr(dev, "_copy_d2h_batch", refused)
    assert await cache.put_many(enumerate(features(rig, 4, 8)))
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_bytes, s.gpu_entries, s.cpu_entries, s.dropped) == (0, 0, 0, 4)
    assert len(cache) == 0
    await assert_clean(rig, cache)

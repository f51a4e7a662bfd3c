"""The core's parts wired together (Tiers), driven through their own interfaces: what the
facade's tests cannot reach without reaching inside it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings
from mmcache.core import room as room_module
from mmcache.core.entry import State
from mmcache.core.state import EvictionPlan
from mmcache.core.tiers import Tiers
from mmcache.device import Fence, SimDevice, Stream
from mmcache.metrics import CacheMetrics
from mmcache.waiting import FenceWatcher

KiB = 1024


class Core:
    """One cache's Tiers on a simulator, bound to the running loop as FeatureCache binds them."""

    def __init__(self, device: SimDevice, **settings: Any) -> None:
        settings.setdefault("evict_ahead", 0)
        self.device = device
        self.registry = CollectorRegistry()
        self.tiers = Tiers(
            CacheSettings(**settings),
            device,
            CacheMetrics("core", self.registry),
            when_done=self.when_done,
            when_done_lazily=self.when_done_lazily,
            changed=lambda: None,
        )
        self._watcher: FenceWatcher | None = None

    def when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        assert self._watcher is not None
        self._watcher.when_done(fences, callback, fresh=fresh)

    def when_done_lazily(
        self, fence: Fence, callback: Callable[[], None], stream: Stream | None
    ) -> None:
        assert self._watcher is not None
        self._watcher.when_done_lazily(fence, callback, stream)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        tiers = self.tiers
        self._watcher = FenceWatcher(loop)
        tiers.producers.bind(loop)
        tiers.packings.bind(loop)
        tiers.pipeline.bind(loop, self._watcher)
        arena = tiers.host.start(loop, self.when_done, lambda capacity, ready: None)
        if arena is not None:
            assert await tiers.host.wait_ready(5)

    async def close(self) -> None:
        tiers = self.tiers
        tiers.closing()
        tiers.producers.unbind()
        tiers.fail_waiting()
        for found in list(tiers.index.values()):
            tiers.remove(found)
        await tiers.pipeline.all_landed()
        await tiers.packings.wait_all(5)

    async def put(self, key: Hashable, kib: int, *, wait: bool = True) -> bool:
        """put of a fresh feature of kib KiB, as FeatureCache.put hands a new key on."""
        value = torch.ones(kib, 256)  # rows of 1 KiB
        stream = self.device.current_stream()
        if key in self.tiers.index:
            return await self.tiers.puts.put_batch([(key, value)], stream, wait)
        return await self.tiers.puts.put_new(key, [value], stream, wait)

    def state(self, key: Hashable) -> State:
        return self.tiers.index.holder(key).state


@pytest.fixture
async def core_of() -> AsyncIterator[Callable[..., Any]]:
    """Build started Cores on simulators; closes them (and the simulators) after."""
    made: list[Core] = []

    async def build(**settings: Any) -> Core:
        core = Core(SimDevice(), **settings)
        made.append(core)
        await core.start()
        return core

    yield build
    for core in made:
        await core.close()
        assert core.tiers.audit() == {"gpu": 0, "cpu": 0}
        core.device.close()


def batch_keys(plan: EvictionPlan) -> list[list[Hashable]]:
    """The keys of each offload batch an eviction plan queued, in order."""
    return [[entry.key for entry, _ in items] for items in plan.batches]


async def test_a_top_up_stops_at_a_large_victim_and_at_the_slack(
    core_of: Callable[..., Any],
) -> None:
    core: Core = await core_of(gpu_cache_mb=1, cpu_cache_mb=4, small_copy_bytes=32 * KiB)
    for key, kib in (("s1", 16), ("s2", 16), ("large", 64), ("s3", 16), ("s4", 16), ("s5", 16)):
        assert await core.put(key, kib)
    evictor, ledger = core.tiers.evictor, core.tiers.state.ledger

    def room_for(kib: int) -> int:  # bytes needed free or on their way for kib more
        return ledger.free() + ledger.releasing + kib * KiB

    plan = evictor.evict_for(room_for(16), slack=1024 * KiB)
    assert batch_keys(plan) == [["s1", "s2"]]  # topped up with s2, not the large one after
    assert plan.evicted == 2 and not plan.releases
    plan = evictor.evict_for(room_for(16), slack=1024 * KiB)
    assert batch_keys(plan) == [["large"]]  # a large victim alone, nothing to top up
    plan = evictor.evict_for(room_for(16), slack=16 * KiB)
    assert batch_keys(plan) == [["s3", "s4"]]  # s4 fills the slack exactly; s5 would exceed
    await core.tiers.pipeline.all_landed()
    assert [core.state(key) for key in ("s1", "s2", "large", "s3", "s4", "s5")] == [
        *[State.HOST] * 5,
        State.GPU,
    ]


async def test_large_victims_go_in_batches_only_when_offloaded_ahead(
    core_of: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Room for later puts: large victims share a copy and a fence, up to LARGE_BATCH_BYTES,
    in the policy's order around small ones. Room a put needs now: each alone, so that
    each comes back as soon as it lands."""
    monkeypatch.setattr(room_module, "LARGE_BATCH_BYTES", 192 * KiB)
    # 512 KiB offloaded ahead: batches of up to half of it would allow 256 KiB.
    core: Core = await core_of(
        gpu_cache_mb=2, cpu_cache_mb=8, small_copy_bytes=32 * KiB, evict_ahead=0.25
    )
    keys = [f"L{i}" for i in range(5)] + ["s1"] + [f"M{i}" for i in range(3)]
    for key in keys:
        assert await core.put(key, 16 if key.startswith("s") else 64)
    evictor, ledger = core.tiers.evictor, core.tiers.state.ledger
    room = ledger.free() + ledger.releasing
    plan = evictor.evict_for(room + 5 * 64 * KiB + 16 * KiB, ahead=True)
    # Three of 64 KiB fill a batch; the small one ends the next, older, batch early.
    assert batch_keys(plan) == [["L0", "L1", "L2"], ["L3", "L4"], ["s1"]]
    plan = evictor.evict_for(ledger.free() + ledger.releasing + 2 * 64 * KiB)
    assert batch_keys(plan) == [["M0"], ["M1"]]
    await core.tiers.pipeline.all_landed()
    assert [core.state(key) for key in keys] == [*[State.HOST] * 8, State.GPU]


async def test_large_victims_offloaded_ahead_leave_a_second_batch_queued(
    core_of: Callable[..., Any],
) -> None:
    """A batch of large victims holds at most half the room offloaded ahead: while one
    lands, the copy engine has the next (one batch of it all would idle the engine while
    the puts use the room it returns)."""
    core: Core = await core_of(
        gpu_cache_mb=2, cpu_cache_mb=8, small_copy_bytes=32 * KiB, evict_ahead=0.125
    )
    keys = [f"L{i}" for i in range(6)]
    for key in keys:
        assert await core.put(key, 64)
    evictor, ledger = core.tiers.evictor, core.tiers.state.ledger
    plan = evictor.evict_for(ledger.free() + ledger.releasing + 6 * 64 * KiB, ahead=True)
    assert batch_keys(plan) == [["L0", "L1"], ["L2", "L3"], ["L4", "L5"]]
    await core.tiers.pipeline.all_landed()
    assert [core.state(key) for key in keys] == [State.HOST] * 6


@pytest.mark.parametrize("replacing", [False, True], ids=["new-key", "replacing"])
async def test_a_put_whose_reservation_raises_gives_its_value_back(
    core_of: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, replacing: bool
) -> None:
    core: Core = await core_of(gpu_cache_mb=1, cpu_cache_mb=1)
    if replacing:  # a put that replaces a key takes the general path
        assert await core.put("k", 4)
    before = core.device.allocated_bytes

    def failing(nbytes: int) -> bool:
        raise RuntimeError("the eviction failed")

    monkeypatch.setattr(core.tiers.evictor, "room_for", failing)
    with pytest.raises(RuntimeError, match="the eviction failed"):
        await core.put("k", 4)
    monkeypatch.undo()
    await core.tiers.pipeline.all_landed()
    core.device.synchronize()
    # The value was adopted and is released again; a replaced entry is gone.
    assert core.device.allocated_bytes == (before - 4 * KiB if replacing else before)
    assert "k" not in core.tiers.index
    assert core.tiers.state.ledger.granted == 0  # given back, not only out of the audit's sight
    assert core.tiers.audit() == {"gpu": 0, "cpu": 0}


async def test_a_host_block_no_entry_owns_is_leaked_in_the_audit_stats_and_gauge(
    core_of: Callable[..., Any],
) -> None:
    core: Core = await core_of(gpu_cache_mb=1, cpu_cache_mb=1)
    assert await core.put("a", 32)

    def leaked_gauge() -> float | None:
        labels = {"cache": "core", "tier": "cpu"}
        return core.registry.get_sample_value("mmcache_leaked_bytes", labels)

    assert core.tiers.stats().leaked_bytes == 0
    pool = core.tiers.host.pool
    assert pool is not None
    stray = pool.allocate(4096)  # a block no entry owns: what a forgotten free looks like
    assert stray is not None
    assert core.tiers.audit() == {"gpu": 0, "cpu": 4096}
    assert (core.tiers.stats().leaked_bytes, leaked_gauge()) == (4096, 4096)
    pool.free(stray)
    assert (core.tiers.stats().leaked_bytes, leaked_gauge()) == (0, 0)

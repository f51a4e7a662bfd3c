"""The admission filter (core/admission.py): a count-min sketch of uses that ages, and TinyLFU's
rule as TierState.plan_promotions applies it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from prometheus_client import CollectorRegistry

from mmcache.core.admission import (
    COUNTER_MAX,
    MIN_ENTRIES,
    SAMPLES_PER_ENTRY,
    FrequencySketch,
    TinyLfu,
)
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, GroupKey, Member, State
from mmcache.core.state import TierState
from mmcache.device import DONE, Fence, SimDevice
from mmcache.host_pool import HostBlock, HostPool
from mmcache.metrics import CacheMetrics


def test_a_sketch_counts_uses_per_key_and_saturates() -> None:
    sketch = FrequencySketch(1024)
    assert sketch.estimate("a") == 0
    assert sketch.add("a") == 1
    assert sketch.add("a", 3) == 4
    assert sketch.estimate("a") == 4
    for i in range(200):  # other keys: a count-min sketch never counts a key low
        sketch.add(("img", i))
    assert sketch.estimate("a") >= 4
    assert sketch.add("a", 100) == COUNTER_MAX
    assert sketch.estimate("a") == COUNTER_MAX


def test_a_sketch_is_accurate_for_fewer_keys_than_counters() -> None:
    sketch = FrequencySketch(4096)
    for i in range(500):
        sketch.add(i, 1 + i % 5)
    wrong = sum(sketch.estimate(i) != 1 + i % 5 for i in range(500))
    assert wrong <= 5  # collisions in all four rows at once are rare


def test_halving_ages_every_count() -> None:
    sketch = FrequencySketch(1024)
    sketch.add("hot", 13)
    sketch.add("warm", 3)
    sketch.add("once")
    sketch.halve()
    assert (sketch.estimate("hot"), sketch.estimate("warm"), sketch.estimate("once")) == (6, 1, 0)


def test_a_sketch_refuses_a_width_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        FrequencySketch(1000)


def test_keep_up_halves_once_per_sample_and_widens_for_the_keys() -> None:
    lfu = TinyLfu(1024)
    lfu.sketch.add("k", 8)
    period = SAMPLES_PER_ENTRY * 100
    lfu.keep_up(period - 1, 100, 10)
    assert lfu.sketch.estimate("k") == 8
    lfu.keep_up(period, 100, 10)
    assert lfu.sketch.estimate("k") == 4
    lfu.keep_up(period + 1, 3, 10)  # few GPU entries: reckoned as MIN_ENTRIES
    assert lfu.sketch.estimate("k") == 4
    lfu.keep_up(period + SAMPLES_PER_ENTRY * MIN_ENTRIES, 3, 10)
    assert lfu.sketch.estimate("k") == 2
    lfu.keep_up(period * 100, 100, 10)  # long idle: a few halvings, not a hundred
    assert lfu.sketch.estimate("k") == 0
    lfu.keep_up(period * 100, 100, 5000)
    assert lfu.sketch.width == 16384


def _entry(key: str, nbytes: int = 64) -> Entry:
    return Entry(
        key, (nbytes // 4,), torch.float32, nbytes, State.GPU, torch.zeros(nbytes // 4), DONE
    )


def test_an_entrys_uses_are_folded_in_when_it_is_compared() -> None:
    lfu = TinyLfu()
    entry = _entry("e")
    assert entry.hits == 1  # the use that made it (a miss, then its put)
    entry.hits += 4  # reads, counted with no call
    assert lfu.frequency(entry) == 5
    assert entry.hits == 0
    assert lfu.frequency(entry) == 5
    assert lfu.used(entry) == 6


def test_a_group_members_use_is_counted_under_its_key() -> None:
    lfu = TinyLfu()
    group = Entry(GroupKey("a", 2), (2, 4), torch.float32, 32, State.HOST, None, DONE, count=2)
    member = Member(("a", group, 0, 1))
    assert lfu.used(member) == 1
    assert lfu.used(member) == 2
    assert lfu.frequency(member) == 2
    assert lfu.sketch.estimate("a") == 2


def _run_now(fences: Sequence[Fence], callback: Callable[[], None]) -> None:
    callback()


def _state(capacity: int, admission: bool = True, host_bytes: int = 1 << 16) -> TierState:
    state = TierState(
        gpu_capacity=capacity,
        policy="lru",
        counters=Counters(CacheMetrics("t", CollectorRegistry())),
        done_fence=DONE,
        mark=lambda stream: DONE,
        evict_ahead=0,
        small_copy_bytes=1 << 20,
        admission=admission,
    )
    arena = torch.zeros(host_bytes, dtype=torch.uint8)
    state.attach_pool(HostPool(SimDevice(), arena, alignment=64, defer=_run_now))
    return state


def _resident(state: TierState, key: str, nbytes: int = 64, uses: int = 1) -> Entry:
    entry = _entry(key, nbytes)
    entry.hits = uses
    state.admit(entry)
    return entry


def _on_host(state: TierState, key: str, nbytes: int = 64) -> Entry:
    assert state.pool is not None
    block = state.pool.allocate(nbytes)
    assert block is not None
    assert state.index_host(key, block, (nbytes // 4,), torch.float32, nbytes)
    found = state.index[key]
    assert isinstance(found, Entry)
    return found


def test_a_promotion_into_free_room_evicts_nothing() -> None:
    state = _state(128)
    _resident(state, "a", uses=5)
    host = _on_host(state, "h")
    assert state.plan_promotions([(host, 64)]).promote == [True]
    other = _on_host(state, "o")
    decided = state.plan_promotions([(host, 64), (other, 64)])  # the first takes the room
    assert decided.promote == [True, False] and decided.eviction is None


def test_a_promotion_is_refused_over_victims_used_as_often() -> None:
    state = _state(128)
    _resident(state, "a", uses=3)
    _resident(state, "b", uses=2)
    host = _on_host(state, "h")  # used once (landed) + this hit = 2
    assert state.plan_promotions([(host, 64)]).promote == [False]
    assert state.ledger.gpu_entries == 2 and [e.key for e in state.gpu_order.peek(8)] == ["a", "b"]


def test_a_promotion_takes_the_least_used_victims_room_with_a_host_copy_first() -> None:
    state = _state(192)
    cold = _resident(state, "cold", uses=1)  # the LRU, no host copy
    warm = _resident(state, "warm", uses=2)
    hot = _resident(state, "hot", uses=9)
    # warm is offloaded, lands, and is promoted back: it keeps its host copy.
    assert state.gpu_order.pop("warm", None) is warm
    block = state.allocate_host(64, [])
    assert block is not None
    landing = state.offload_landed(
        state.offload_queued([(warm, block)], DONE, 0.0, charged_gpu=True)
    )
    assert landing.lost == [] and warm.state is State.HOST
    state.promote([(warm, torch.zeros(16))], DONE)
    assert (warm.state, warm.block) == (State.GPU, block)
    warm.hits = 2
    host = _on_host(state, "h")
    host.hits = 4  # + this hit: 5, hotter than cold and warm, not than hot
    decision = state.plan_promotions([(host, 64)])
    assert decision.promote == [True]
    plan = decision.eviction
    assert plan is not None
    assert plan.batches == [] and plan.releases == [] and plan.evicted == 1
    assert [r.tensor.numel() for r in plan.demoted] == [16]  # warm's: a ledger move
    assert warm.state is State.HOST and warm.block is block
    assert cold.state is State.GPU and hot.state is State.GPU
    assert state.ledger.free() == 64  # at once: warm had no reader
    state.promote([(host, torch.zeros(16))], DONE)
    assert state.ledger.free() == 0
    pool = state.pool
    assert pool is not None
    held = pool.used_bytes - pool.freeing_bytes
    assert state.ledger.leaked(state.index.held(), state.in_flight(), held, (0, 0)) == {
        "gpu": 0,
        "cpu": 0,
    }


def test_without_admission_a_full_tier_promotes_nothing() -> None:
    state = _state(64, admission=False)
    _resident(state, "a", uses=0)
    host = _on_host(state, "h")
    host.hits = 10
    assert state.plan_promotions([(host, 64)]).promote == [False]


def test_the_victims_of_a_turns_promotions_never_take_the_host_room_of_its_hits() -> None:
    """Hits of one turn promoted into a full GPU tier evict colder entries, which need host
    room: the host tier gives up other entries for it, never the turn's hits, whose
    uploads read their blocks (a victim with no room left is dropped instead)."""
    state = _state(128, host_bytes=128)  # two blocks: both hold the turn's hits
    cold = [_resident(state, "a"), _resident(state, "b")]
    hits = [_on_host(state, "h1"), _on_host(state, "h2")]
    blocks = [hit.block for hit in hits]
    for hit in hits:
        hit.hits = 5
    decided = state.plan_promotions([(hits[0], 64), (hits[1], 64)])
    assert decided.promote == [True, True]
    plan = decided.eviction
    assert plan is not None and plan.evicted == 2 and plan.batches == []
    assert [entry.state for entry in cold] == [State.GONE, State.GONE]  # no room: dropped
    assert [hit.block for hit in hits] == blocks and all(b is not None for b in blocks)
    assert [hit.state for hit in hits] == [State.HOST, State.HOST]
    assert [e.key for e in state.host_order.peek(8)] == ["h1", "h2"]  # back in the order
    state.promote([(hits[0], torch.zeros(16)), (hits[1], torch.zeros(16))], DONE)
    assert state.ledger.free() == 0 and state.ledger.gpu_entries == 2


def test_a_promotion_plan_that_raises_leaves_no_hit_set_aside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hits set aside from the host order while a turn's victims take host room go back
    even if the plan raises: none is left out of the host tier's order (never evicted)."""
    state = _state(128, host_bytes=128)
    _resident(state, "a")
    _resident(state, "b")
    hits = [_on_host(state, "h1"), _on_host(state, "h2")]
    for hit in hits:
        hit.hits = 5
    pool = state.pool
    assert pool is not None
    allocate = pool.allocate
    calls = [0]

    def fails_second(nbytes: int) -> HostBlock | None:
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("allocator broke")
        return allocate(nbytes)

    monkeypatch.setattr(pool, "allocate", fails_second)
    with pytest.raises(RuntimeError, match="allocator broke"):
        state.plan_promotions([(hits[0], 64), (hits[1], 64)])
    assert {e.key for e in state.host_order.peek(8)} == {"h1", "h2"}

"""Room in the tiers: which GPU entries leave, for a put or for host hits promoted into a
full GPU tier, and which host blocks the leavers are copied into.

Part of the tier state (core/state.py): Room reads and changes the TierState's ledger,
orders and entries, and only the TierState calls it. It decides and returns plans as
values (EvictionPlan, Promotions); carrying them out (copies, releases) is the async
side's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, final

from mmcache.core.admission import TinyLfu
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member
from mmcache.core.packing import BATCH_BYTES, LARGE_BATCH_BYTES
from mmcache.host_pool import HostBlock

if TYPE_CHECKING:
    from mmcache.core.release import Release
    from mmcache.core.state import TierState

__all__ = ["PROMOTION_VICTIMS", "EvictionPlan", "OffloadItems", "Promotions", "Room"]

#: victims going to the host tier behind one copy: each with the block it is copied into
OffloadItems = list[tuple[Entry, HostBlock]]

#: GPU victims a host hit is compared with (the next ones in the GPU order, not yet taken
#: by the hits before it) when it wants their room: the least used go first (a sampled
#: LFU within TinyLFU's rule)
PROMOTION_VICTIMS: Final = 8


@final
@dataclass(slots=True, eq=False)
class EvictionPlan:
    """What an eviction decided: the offload copies to queue, in order (each one copy
    behind one fence), what to release for the entries dropped on the way, the device
    tensors of the victims demoted (they kept a host copy: no copy, only their device
    memory to release after its readers), and how many features left the GPU tier."""

    batches: list[OffloadItems] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    demoted: list[Release] = field(default_factory=list)
    evicted: int = 0


@final
@dataclass(slots=True, eq=False)
class Promotions:
    """What plan_promotions decided for a loop turn's host hits: per hit, whether it is
    promoted (its upload becomes the GPU entry, charged by TierState.promote
    in the same loop turn), and the one eviction made for them all, to carry out (None:
    none)."""

    promote: list[bool]
    eviction: EvictionPlan | None = None


#: a victim compared with: (its uses lately, its place in the order, the entry)
_Victim = tuple[int, int, Entry]
#: a colder victim: (its room not free at once, uses lately, place in the order, the entry)
_Candidate = tuple[bool, int, int, Entry]


@final
class Room:
    """Plans room in the GPU tier (evictions for puts, promotions of host hits) and in the
    host tier (blocks for the victims, host entries dropped for them)."""

    def __init__(
        self,
        state: TierState,
        *,
        counters: Counters,
        evict_ahead: int,
        small_copy_bytes: int,
        admission: TinyLfu | None,
    ) -> None:
        self._state = state
        self._ledger = state.ledger
        self._gpu_order = state.gpu_order
        self._host_order = state.host_order
        self._counters = counters
        # Offloading a little ahead keeps the copy engine busy while the next puts run.
        self._ahead = evict_ahead
        self._small = small_copy_bytes
        self.admission = admission
        self._promoting = False  # planning a promotion's eviction (see _let_go_enough)
        # While a turn's promotions are planned: the ids of its hits' entries, which the
        # host tier does not drop, and those of them set aside out of its order meanwhile.
        self._held: set[int] = set()
        self._set_aside: list[Entry] = []

    # --- the host tier's room ---------------------------------------------------

    def allocate_host(self, nbytes: int, releases: list[Release]) -> HostBlock | None:
        """A host block now, dropping host entries in the policy's order if needed (their
        releases appended to releases); None if no room can be made."""
        pool = self._state.pool
        if pool is None or nbytes > pool.ready_block_bytes:
            return None  # dropping entries would make no room that fits it
        let_go = 0
        while True:
            block = pool.allocate(nbytes)
            if block is not None or not self._host_order or self._let_go_enough(let_go, nbytes):
                return block
            let_go += self._host_victim_bytes()
            releases.extend(self._evict_host())

    def allocate_host_all(
        self, sizes: Sequence[int], releases: list[Release]
    ) -> list[HostBlock] | None:
        """A host block for each size now, or none (dropping host entries as
        allocate_host does). One by one first; if that fails, as one run, which an emptied
        arena always takes. None while the arena is not pinned yet."""
        pool = self._state.pool
        if pool is None:
            return None
        taken: list[HostBlock] = []
        for nbytes in sizes:
            block = self.allocate_host(nbytes, releases)
            if block is None:
                break
            taken.append(block)
        else:
            return taken
        for block in taken:
            pool.free(block)
        if len(sizes) == 1 or sum(sizes) > pool.ready_block_bytes:
            return None  # no run could take them: evicting more would be for nothing
        let_go = 0
        while True:
            run = pool.allocate_run(sizes)
            if run is not None or not self._host_order or self._let_go_enough(let_go, sum(sizes)):
                return run
            let_go += self._host_victim_bytes()
            releases.extend(self._evict_host())

    def _let_go_enough(self, let_go: int, nbytes: int) -> bool:
        """Whether a node's shared host tier (host_share="node") has had enough of this
        rank's host entries for nbytes: another rank may hold the blocks it lets go, which
        come back only once every rank has (the others evict in their own turn), so it
        gives up nbytes of them, not its whole tier, before it drops the victim. A
        promotion's victims take none: with most of the node's blocks another rank's,
        the host entries being read would be next."""
        pool = self._state.pool
        if pool is None or not pool.shared:
            return False
        return self._promoting or let_go >= nbytes

    def _evict_host(self) -> Sequence[Release]:
        """The host tier's next victim dropped for room (TierState.evict_host), or, where
        it is a hit of the turn whose promotions are being planned, set aside (out of the
        order until the plan ends): its upload reads its block."""
        held = self._held
        if held:
            victim = self._host_order.next_victim()
            if victim is not None and id(victim) in held:
                self._host_order.pop(victim.key, None)
                self._set_aside.append(victim)
                return ()
        return self._state.evict_host()

    def _host_victim_bytes(self) -> int:
        victim = self._host_order.next_victim()
        return 0 if victim is None else victim.nbytes

    # --- the GPU tier's room: eviction ----------------------------------------

    def plan_eviction(self, needed: int, *, slack: int = 0, ahead: bool = False) -> EvictionPlan:
        """Choose GPU victims until needed bytes are free or on their way, with their host
        blocks; victims the host tier cannot take are dropped at once.

        Features below small_copy_bytes go in batches of about BATCH_BYTES behind one
        fence: per-copy work (an enqueue, an event, a wake-up on landing) would otherwise
        cap small features far below the copy engine's bandwidth. Up to slack bytes more
        may go to top up a last batch left part full with the next small victims. Larger
        ones go alone, so that the room each makes comes back as soon as it lands; when
        the room is for later puts (ahead), in batches of up to LARGE_BATCH_BYTES and of
        up to half of evict_ahead, so that the copy engine has a second batch queued while
        the first lands.

        The victims stay GPU entries, out of the GPU order, until offload_queued (or
        offload_refused) is told of their copy: nothing may run in between.
        """
        state = self._state
        if state.before_plan_pending:  # a deque's truth: no call while nothing waits
            state.before_plan()
        plan = EvictionPlan()
        order = self._gpu_order
        ledger = self._ledger
        small_limit = self._small
        large_limit = min(LARGE_BATCH_BYTES, self._ahead // 2) if ahead else 0
        limit = needed + slack
        batch: list[Entry] = []
        large: list[Entry] = []
        batched = large_bytes = planned = 0
        while order:
            # Free, on its way, or planned: drops change the ledger as they are planned.
            have = ledger.capacity - ledger.used + ledger.releasing + planned
            have += batched + large_bytes
            if have >= needed:
                if not batch:
                    break
                oldest = order.next_victim()
                if oldest is None or oldest.nbytes >= small_limit or have + oldest.nbytes > limit:
                    break
            entry = order.evict()
            plan.evicted += entry.count
            if entry.block is not None:
                # It kept its host copy (inclusive tiers): a ledger move, no copy. Its
                # bytes come back at once, or after its readers (counted as releasing).
                plan.demoted.append(state.demote(entry))
                continue
            if entry.nbytes < small_limit:
                if large:  # older victims get their host room first, in the policy's order
                    planned += self._plan_batch(large, large_bytes, plan)
                    large, large_bytes = [], 0
                batch.append(entry)
                batched += entry.nbytes
                if batched >= BATCH_BYTES:
                    # One fence frees a whole batch: bounded, so room comes back in steps.
                    planned += self._plan_batch(batch, batched, plan)
                    batch, batched = [], 0
            else:
                if batch:
                    planned += self._plan_batch(batch, batched, plan)
                    batch, batched = [], 0
                if large and large_bytes + entry.nbytes > large_limit:
                    planned += self._plan_batch(large, large_bytes, plan)
                    large, large_bytes = [], 0
                large.append(entry)
                large_bytes += entry.nbytes
        if large:
            self._plan_batch(large, large_bytes, plan)
        if batch:
            self._plan_batch(batch, batched, plan)
        if plan.evicted:
            self._counters.evicted_gpu(plan.evicted)
        return plan

    def _plan_batch(self, entries: list[Entry], nbytes: int, plan: EvictionPlan) -> int:
        """Host blocks for a batch of victims of nbytes in all (one run where one free
        range takes them all, else one by one), dropping those the host tier cannot take;
        the bytes planned."""
        run = None
        pool = self._state.pool
        if pool is not None and pool.shared:  # the node's host tier may hold some already
            entries, nbytes = self._keep_node_copies(entries, nbytes, plan)
        if len(entries) > 1 and pool is not None:
            sizes = []
            for entry in entries:
                sizes.append(entry.nbytes)
            run = pool.allocate_run(sizes)
        if run is not None:
            plan.batches.append(list(zip(entries, run, strict=True)))
            return nbytes
        items: OffloadItems = []
        for entry in entries:
            block = self.allocate_host(entry.nbytes, plan.releases)
            if block is None:
                nbytes -= entry.nbytes
                plan.releases.extend(self._state.drop(entry))
            else:
                items.append((entry, block))
        if items:
            plan.batches.append(items)
        return nbytes

    def _keep_node_copies(
        self, entries: list[Entry], nbytes: int, plan: EvictionPlan
    ) -> tuple[list[Entry], int]:
        """Victims whose bytes the node's shared host tier holds already (another rank's
        copy, host_share="node") take a reference to them and are demoted, no copy; the
        others, and their bytes, are left to offload."""
        state = self._state
        pool = state.pool
        assert pool is not None
        left: list[Entry] = []
        for entry in entries:
            block = None
            if entry.members is None:
                block = pool.adopt(entry.key, entry.shape, entry.dtype, entry.nbytes)
            if block is None:
                left.append(entry)
                continue
            plan.demoted.append(state.keep_node_copy(entry, block))
            nbytes -= entry.nbytes
        return left, nbytes

    # --- the GPU tier's room: promotion ----------------------------------------

    def plan_promotions(self, hits: Sequence[tuple[Entry | Member, int]]) -> Promotions:
        """Which of a loop turn's host hits (each found, and its bytes to the device) are
        promoted, in order: the first ones take the room.

        Into free room, always. Into a full GPU tier, with an admission filter
        (promote_policy="tinylfu"), only into the room of GPU entries used less often
        lately than the hit (TinyLFU's rule, core/admission.py): of the PROMOTION_VICTIMS
        next victims in the GPU order, the least used first, those that kept a host copy
        (demoted now: a ledger move, no copy) before those that did not (offloaded: copies
        to queue, whose room comes when they land). A hit is promoted if its room is free
        now. The victims are read once for the whole turn: one scan of the order, each
        victim's uses read once. The caller checked that no put waits for room (a
        promotion never jumps their line).
        """
        ledger = self._ledger
        admission = self.admission
        decisions: list[bool] = []
        reserved = 0  # bytes promised to the hits promoted before
        window: dict[int, _Victim] | None = None  # victims compared with, once read
        coldest: int | None = None  # the fewest uses among them (None: no victim)
        free_at_once: dict[int, bool] = {}  # victim's id -> whether its room is free now
        plan: EvictionPlan | None = None
        try:
            for found, nbytes in hits:
                free = ledger.capacity - ledger.used - reserved
                if free >= nbytes:
                    if admission is not None:
                        if isinstance(found, Entry):
                            found.hits += 1  # a use, counted with no call: folded in when compared
                        else:
                            admission.sketch.add(found.key)
                    decisions.append(True)
                    reserved += nbytes
                    continue
                if admission is None or nbytes > ledger.capacity - reserved:
                    decisions.append(False)
                    continue
                if window is None:
                    counters = self._counters
                    admission.keep_up(
                        counters.hits_gpu + counters.hits_cpu + counters.misses,
                        ledger.gpu_entries,
                        len(self._state.index),
                    )
                    window, coldest = self._victims({})
                sketch = admission.sketch
                if isinstance(found, Entry):  # TinyLfu.used, inline: one call, not two
                    uses = found.hits + 1
                    found.hits = 0
                    wanted = found.frequency = sketch.add(found.key, uses)
                    found.frequency_epoch = sketch.epoch
                else:
                    wanted = sketch.add(found.key)
                if coldest is None or wanted <= coldest:  # no victim is colder: the usual case
                    decisions.append(False)
                    continue
                # The colder victims: those whose room is free at once (a host copy, no
                # reader) first, then the least used, then by the order.
                colder: list[_Candidate] = []
                for used, place, victim in window.values():
                    if used < wanted:
                        at_once = free_at_once.get(id(victim))
                        if at_once is None:  # asked once a turn: fence queries are device calls
                            at_once = free_at_once[id(victim)] = (
                                victim.block is not None
                                and victim.ready.done()
                                and not (victim.device_readers and victim.device_readers_pending())
                            )
                        colder.append((not at_once, used, place, victim))
                colder.sort()
                chosen: list[Entry] = []
                room = nbytes - free  # still to make
                for _, _, _, victim in colder:
                    chosen.append(victim)
                    room -= victim.nbytes
                    if room <= 0:
                        break
                else:
                    decisions.append(False)  # too little room in colder entries: none goes
                    continue
                if plan is None:
                    plan = EvictionPlan()
                    self._hold(hits)
                self._promoting = True  # its victims take no host room from host entries
                try:
                    self._evict_chosen(chosen, plan)
                finally:
                    self._promoting = False
                for victim in chosen:
                    del window[id(victim)]
                window, coldest = self._victims(window)
                promote = ledger.capacity - ledger.used - reserved >= nbytes
                if promote:
                    reserved += nbytes
                decisions.append(promote)
        finally:
            if plan is not None:  # however it ends: no hit stays set aside
                host_order = self._host_order
                for entry in self._set_aside:  # back, most recently used: read this turn
                    host_order[entry.key] = entry
                self._set_aside.clear()
                self._held.clear()
        if plan is not None and plan.evicted:
            self._counters.evicted_gpu(plan.evicted)
        return Promotions(decisions, plan)

    def _hold(self, hits: Sequence[tuple[Entry | Member, int]]) -> None:
        """While victims are given host room for this turn's promotions, the host tier
        drops none of hits' entries for it (their uploads read their blocks)."""
        held = self._held
        for found, _ in hits:
            held.add(id(found if isinstance(found, Entry) else found.group))

    def _victims(self, known: dict[int, _Victim]) -> tuple[dict[int, _Victim], int | None]:
        """The next PROMOTION_VICTIMS victims in the GPU order by id: their uses lately
        (those in known as they were read, the others read now) and places; and the
        fewest uses among them (None: no victim)."""
        sketch = self.admission.sketch if self.admission is not None else None
        assert sketch is not None
        epoch = sketch.epoch
        out: dict[int, _Victim] = {}
        least: int | None = None
        for place, victim in enumerate(self._gpu_order.peek(PROMOTION_VICTIMS)):
            old = known.get(id(victim))
            if old is not None:
                used = old[0]
            # TinyLfu.frequency, inline: one call at most, none for a victim read before.
            elif hits := victim.hits:
                victim.hits = 0
                used = victim.frequency = sketch.add(victim.key, hits)
                victim.frequency_epoch = epoch
            elif victim.frequency_epoch >= 0:
                used = victim.frequency >> (epoch - victim.frequency_epoch)
            else:
                used = victim.frequency = sketch.estimate(victim.key)
                victim.frequency_epoch = epoch
            out[id(victim)] = (used, place, victim)
            if least is None or used < least:
                least = used
        return out, least

    def _evict_chosen(self, victims: list[Entry], plan: EvictionPlan) -> None:
        """Take victims (GPU entries) out of the GPU tier into plan: those with a host
        copy demoted, the others to offload (small ones in one batch, large ones alone)."""
        order = self._gpu_order
        state = self._state
        small: list[Entry] = []
        small_bytes = 0
        for victim in victims:
            if order.next_victim() is victim:
                order.evict()  # as an eviction (the cost policy's clock rises to it)
            else:
                order.pop(victim.key, None)
            plan.evicted += victim.count
            if victim.block is not None:
                plan.demoted.append(state.demote(victim))
            elif victim.nbytes < self._small:
                small.append(victim)
                small_bytes += victim.nbytes
            else:
                self._plan_batch([victim], victim.nbytes, plan)
        if small:
            self._plan_batch(small, small_bytes, plan)

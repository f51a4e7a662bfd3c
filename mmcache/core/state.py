"""TierState: the index, both tiers' ledgers and orders, and every entry transition."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence, Sized
from typing import Final, final

import torch

from mmcache.core.admission import TinyLfu
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State
from mmcache.core.grants import Grant
from mmcache.core.in_flight import InFlight, Landing, Offload
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.core.policy import EvictionPolicy, make_policy
from mmcache.core.quarantine import Quarantine
from mmcache.core.release import DeviceRelease, Release
from mmcache.core.room import EvictionPlan, OffloadItems, Promotions, Room
from mmcache.device.base import Fence, Stream
from mmcache.host_pool import HostBlock, HostPool

__all__ = [
    "DeviceRelease",
    "EvictionPlan",
    "Landing",
    "Offload",
    "OffloadItems",
    "Promotions",
    "Release",
    "TierState",
]


#: the empty result of a verb that releases nothing (shared: most of them)
NOTHING: Final[tuple[Release, ...]] = ()


def _nothing() -> None:
    pass


@final
class TierState:
    """The one owner of the tier state: key index, GPU ledger, host pool, both orders of
    victims, offloads in flight and quarantined ones.

    Synchronous: it never awaits, and of the device it holds only `mark`, a fence
    recorded on a stream (on a host block's free, after the copies that readers queued
    on their own streams). Each verb makes the transitions of a decision at once and
    returns what is left to the device as values (copies to queue, device memory to
    release after fences): the async side carries them out and reports completions back
    through the verbs here. Host blocks are the state's own: freed here, reused by the
    pool only after the fences of their readers.
    """

    def __init__(
        self,
        *,
        gpu_capacity: int,
        policy: str,
        counters: Counters,
        done_fence: Fence,
        mark: Callable[[Stream], Fence],
        evict_ahead: int,
        small_copy_bytes: int,
        admission: bool = False,
    ) -> None:
        self.ledger = TierLedger(gpu_capacity)
        self.index = KeyIndex()
        #: the order of GPU victims; the byte ledger is ours
        self.gpu_order: EvictionPolicy = make_policy(policy)
        #: the order in which host entries are dropped for room
        self.host_order: EvictionPolicy = make_policy(policy)
        #: the pinned arena's allocator, once its first chunk is pinned
        self.pool: HostPool | None = None
        self.quarantine = Quarantine()
        ledger = self.ledger
        #: a grant for a put starting now (close_grant() it when the put ends, however)
        self.open_grant = ledger.open_grant
        #: a put has ended: what its grant still holds is held by nobody (the audit's)
        self.close_grant = ledger.close_grant
        #: features below this go to the host tier in batches behind one fence
        self.small_copy_bytes = small_copy_bytes
        self._counters = counters
        self._done = done_fence  # a finished fence: a host entry's stands for its copies'
        self._mark = mark
        #: told of each entry the host tier drops for room, before it goes
        self.on_host_evict: Callable[[Entry], None] | None = None
        #: run before each eviction plan while before_plan_pending holds anything
        #: (run_before_plans)
        self.before_plan: Callable[[], None] = _nothing
        self.before_plan_pending: Sized = ()
        # Which entries leave for room: the planner. With an admission filter
        # (promote_policy="tinylfu") host hits may take GPU entries' room, else free room.
        room = Room(
            self,
            counters=counters,
            evict_ahead=evict_ahead,
            small_copy_bytes=small_copy_bytes,
            admission=TinyLfu() if admission else None,
        )
        self.admission = room.admission
        # The planner's verbs are the state's, bound here (no call more on a hot path):
        # see Room.allocate_host, allocate_host_all, plan_eviction, plan_promotions.
        self.allocate_host = room.allocate_host
        self.allocate_host_all = room.allocate_host_all
        self.plan_eviction = room.plan_eviction
        self.plan_promotions = room.plan_promotions
        # The offloads in flight, from queueing to landing or quarantine: see InFlight.
        flight = self._flight = InFlight(self, counters=counters, done_fence=done_fence)
        self.offload_queued = flight.offload_queued
        self.offload_refused = flight.offload_refused
        self.offload_landed = flight.offload_landed
        self.quarantine_offload = flight.quarantine_offload

    # --- reading the state ---------------------------------------------------

    def charged(self, entry: Entry) -> bool:
        """Whether entry's offload in flight is charged to the GPU tier."""
        return self._flight.entries.get(entry, False)

    def in_flight(self) -> Mapping[Entry, bool]:
        """Every entry with an offload in flight -> whether it is GPU-charged (the audit's)."""
        return self._flight.entries

    def offloading(self, entry: Entry) -> bool:
        """Whether entry's offload is in flight (its entry may be discarded already)."""
        return entry in self._flight.entries

    def tell_host_evictions(self, on_evict: Callable[[Entry], None]) -> None:
        """Call on_evict(entry) for each entry the host tier drops for room, before it goes."""
        self.on_host_evict = on_evict

    def run_before_plans(self, apply: Callable[[], None], pending: Sized) -> None:
        """Call apply() before each eviction plan while pending holds anything: it applies
        the recency of hits served off the loop (core/thread_hits.py), so that victims are
        chosen by it."""
        self.before_plan = apply
        self.before_plan_pending = pending

    def attach_pool(self, pool: HostPool) -> None:
        """The host arena's allocator: host blocks come from it from now on."""
        self.pool = pool

    # --- puts ------------------------------------------------------------------

    def take_if_free(self, want: tuple[int, Grant]) -> Grant | None:
        """Grant want's bytes into its grant if they are free now (a FifoBudget's take)."""
        return self.ledger.take_if_free(want)

    def grant(self, grant: Grant, nbytes: int) -> None:
        """Reserve nbytes of the GPU tier for grant's put (the caller checked free())."""
        self.ledger.grant(grant, nbytes)

    def return_grant(self, grant: Grant) -> None:
        """grant's put will not insert what it holds: give it all back."""
        self.ledger.return_grant(grant)

    def admit(self, entry: Entry) -> None:
        """A new GPU entry of one feature under its key (absent now), in bytes that are
        free now (Evictor.admit checked)."""
        self.ledger.admit(entry.nbytes)
        key = entry.key
        self.index[key] = entry
        self.gpu_order[key] = entry

    def index_entry(self, entry: Entry, to_gpu: bool) -> None:
        """A new entry (one feature) under its key, absent now; in the GPU order if to_gpu."""
        self.index[entry.key] = entry
        if to_gpu:
            self.gpu_order[entry.key] = entry

    def index_group(
        self,
        keys: list[Hashable],
        rows: list[int],
        packed: torch.Tensor,
        ready: Fence,
        nbytes: int,
        to_gpu: bool,
    ) -> Entry:
        """A packed group of features (keys absent now): one entry, one member per key."""
        group = self.index.add_group(keys, rows, packed, ready, nbytes)
        if to_gpu:
            self.gpu_order[group.key] = group
        return group

    def inserted(self, grant: Grant, nbytes: int, features: int) -> None:
        """nbytes of grant's budget became GPU entries holding features."""
        self.ledger.insert(grant, nbytes, features)

    def unindex(self, made: list[Entry]) -> None:
        """Take a failed put's entries out again; its caller gives back their memory."""
        for entry in made:
            self.index.forget(entry)
            self.gpu_order.pop(entry.key, None)
            entry.discard()

    def remove_keys(self, keys: Sequence[Hashable]) -> list[Release]:
        """Remove what the index holds under keys (a put replacing them)."""
        index = self.index
        if index.keys().isdisjoint(keys):
            return []
        releases: list[Release] = []
        for key in keys:
            old = index.get(key)
            if old is not None:
                releases.extend(self.remove(old))
        return releases

    def index_host(
        self,
        key: Hashable,
        block: HostBlock,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        nbytes: int,
    ) -> bool:
        """A host entry for key from a block filled on the host (a remote hit); False
        (block freed) if key was put meanwhile."""
        if key in self.index:
            self.free_block(block)  # a local put is newer than what the server had
            return False
        done = self._done
        entry = Entry(
            key, shape, dtype, nbytes, State.HOST, None, done, block=block, copy_fence=done
        )
        self.index[key] = entry
        self.host_order[key] = entry
        self.ledger.host_entered(1)
        return True

    # --- leaving ---------------------------------------------------------------

    def remove(self, found: Entry | Member) -> Sequence[Release]:
        """Remove a key's feature: its entry, or its place in a group."""
        if isinstance(found, Member):
            return self._leave_group(found)
        return self._unlink(found)

    def drop(self, entry: Entry) -> Sequence[Release]:
        """Lose an entry (a GPU one the host tier cannot take now, or a destroyed one)."""
        self._counters.lost(entry.count)
        return self._unlink(entry)

    def drop_if_failed(self, entry: Entry, ready: Fence) -> Sequence[Release]:
        """A put whose producing copy (a compaction) failed must not serve poison: drop it."""
        if ready.exception() is None or entry.ready is not ready:
            return NOTHING
        self._counters.copy_failed("compaction", entry.key, ready.exception())
        if entry.state is State.GONE:
            return NOTHING
        return self.drop(entry)

    def upload_failed(self, entries: Sequence[Entry], fence: Fence) -> list[Release]:
        """An upload copy failed: entries promoted from it hold no data; drop them."""
        releases: list[Release] = []
        for entry in entries:
            self._counters.copy_failed("upload", entry.key, fence.exception())
            if entry.state is State.GPU and entry.ready is fence:
                releases.extend(self.drop(entry))
        return releases

    def released(self, nbytes: int) -> None:
        """Device bytes of a DeviceRelease with `later` whose fences are done."""
        self.ledger.released(nbytes)

    def _leave_group(self, member: Member) -> Sequence[Release]:
        """Remove a member from the index; its group goes with its last member.

        Its rows stay charged to the group's tier until then: a group is one block of
        memory on either side, and slicing it would cost the copies it saves.
        """
        if not self.index.leave(member):
            return NOTHING
        group = member.group
        state = group.state
        ledger = self.ledger
        if state is State.GPU:
            ledger.gpu_left(1)
            if group.block is not None:  # and its host copy's
                ledger.host_left(1)
        elif state is State.HOST:
            ledger.host_left(1)
        elif state is State.D2H:  # counted in the host tier since queued, in the GPU one if charged
            ledger.host_left(1)
            if self._flight.entries.get(group, False):
                ledger.gpu_left(1)
        if group.count == 0:
            return self._unlink(group)
        return NOTHING

    def _unlink(self, entry: Entry) -> Sequence[Release]:
        """Remove entry from the index; what it holds is released after its fences."""
        self.index.forget(entry)
        state = entry.state
        tensor = entry.discard()
        if state is State.GPU:
            self.gpu_order.pop(entry.key, None)
            self.ledger.gpu_left(entry.count)
            assert tensor is not None
            if entry.block is not None:  # promoted, it kept its host copy: both go
                self.host_order.pop(entry.key, None)
                self.take_block(entry)
            return (
                self.release_charged(
                    tensor, entry.nbytes, [entry.ready, *entry.device_readers_pending()]
                ),
            )
        if state is State.HOST:
            self.host_order.pop(entry.key, None)
            return self.take_block(entry)
        return NOTHING  # State.D2H: its landing releases both sides once the copy ends

    def release_charged(
        self, tensor: torch.Tensor, nbytes: int, after: Sequence[Fence]
    ) -> DeviceRelease:
        """Release a device tensor charged to the GPU tier once after's fences are done."""
        pending = [f for f in after if not f.done()]
        if not pending:
            self.ledger.release(nbytes)
            return DeviceRelease(tensor, pending)
        self.ledger.release_later(nbytes)
        return DeviceRelease(tensor, pending, nbytes)

    def take_block(self, entry: Entry) -> Sequence[Release]:
        """Free entry's host block, if any, after its readers; it leaves the tier's count."""
        streams = entry.host_streams
        block = entry.take_block()
        if block is not None and self.pool is not None:
            self.ledger.host_left(entry.count)
            after = entry.readers_pending()
            if streams:  # their copies were queued before these fences: covered by them
                after.extend(map(self._mark, streams))
            self.pool.free(block, after=after)
        return NOTHING

    def free_block(self, block: HostBlock, after: Sequence[Fence] = ()) -> None:
        """Give back a block no entry holds (reused only after the fences given)."""
        assert self.pool is not None
        self.pool.free(block, after=after)

    def evict_host(self) -> Sequence[Release]:
        """Drop the host entry the policy gives up first (a host-tier eviction)."""
        victim = self.host_order.evict()
        self._counters.evicted_cpu(victim.count)
        if victim.state is State.GPU:
            # A promoted entry's host copy: the feature stays on the GPU tier, which
            # offloads it again (a copy) if it evicts it. Only the block goes.
            return self.take_block(victim)
        if self.on_host_evict is not None:
            self.on_host_evict(victim)
        return self._unlink(victim)

    def keep_node_copy(self, entry: Entry, block: HostBlock) -> DeviceRelease:
        """A GPU victim whose bytes the node's shared host tier holds (block, another
        rank's copy) takes them as its host copy and is demoted, no copy."""
        entry.keep_copy(block, self._done)
        self.ledger.host_entered(entry.count)
        self.host_order[entry.key] = entry
        return self.demote(entry)

    def demote(self, entry: Entry) -> DeviceRelease:
        """A GPU entry that kept its host copy leaves the GPU tier (out of the GPU order
        already): its device tensor is released after its producer and readers; it stays
        in the host tier (and order)."""
        after = [entry.ready, *entry.device_readers_pending()]
        tensor = entry.demote()
        self.ledger.gpu_left(entry.count)
        return self.release_charged(tensor, entry.nbytes, after)

    # --- reads ------------------------------------------------------------------

    def promote(
        self, uploaded: Sequence[tuple[Entry | Member, torch.Tensor]], fence: Fence
    ) -> tuple[list[Entry], list[Release]]:
        """Host hits whose uploads (behind fence) become GPU entries again, charged to the
        GPU tier, most recently used: the entries that now hold them, and what to release.

        Inclusive tiers: a host entry keeps its host block, still counted in the host tier
        and still in the host order, where it ages (GPU hits do not touch it). A host-tier
        eviction may take that block back (the entry then is GPU-only, and leaving the GPU
        tier costs a copy again); a GPU-tier eviction demotes it with no copy. A group
        member leaves its group as an entry of its own, from its uploaded rows.
        """
        entries: list[Entry] = []
        releases: list[Release] = []
        order = self.gpu_order
        nbytes = 0
        for found, tensor in uploaded:
            if isinstance(found, Member):
                entry = Entry(
                    found.key,
                    found.shape,
                    found.group.dtype,
                    found.nbytes,
                    State.GPU,
                    tensor,
                    fence,
                    hits=0,  # this hit's use went into the admission sketch under its key
                )
                releases.extend(self._leave_group(found))
                self.index[entry.key] = entry
            else:
                entry = found
                entry.promote(tensor, fence)
            order[entry.key] = entry
            nbytes += entry.nbytes
            entries.append(entry)
        self.ledger.promote(nbytes, len(entries))
        self._counters.promoted(len(entries))
        return entries, releases

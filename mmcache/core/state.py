"""TierState: the index, both tiers' ledgers and orders, and every entry transition."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, final

import torch

from mmcache.core.admission import TinyLfu
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State
from mmcache.core.grants import Grant
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.core.packing import BATCH_BYTES, LARGE_BATCH_BYTES
from mmcache.core.policy import EvictionPolicy, make_policy
from mmcache.core.quarantine import Quarantine
from mmcache.device.base import Fence, Stream
from mmcache.host_pool import HostBlock, HostPool

__all__ = [
    "DeviceRelease",
    "EvictionPlan",
    "Landing",
    "Offload",
    "Promotion",
    "Release",
    "TierState",
]


@final
@dataclass(slots=True, eq=False)
class DeviceRelease:
    """A device tensor no entry holds any more: release it after `after`. Where `later` is
    not 0, those bytes stay in the GPU ledger until then: report them with released()."""

    tensor: torch.Tensor
    after: Sequence[Fence]
    later: int = 0


Release = DeviceRelease

#: the empty result of a verb that releases nothing (shared: most of them)
NOTHING: Final[tuple[Release, ...]] = ()

#: victims going to the host tier behind one copy: each with the block it is copied into
OffloadItems = list[tuple[Entry, HostBlock]]


@final
@dataclass(slots=True, eq=False)
class EvictionPlan:
    """What plan_eviction decided: the offload copies to queue, in order (each one copy
    behind one fence), what to release for the entries dropped on the way, the device
    tensors of the victims demoted (they kept a host copy: no copy, only their device
    memory to release after its readers), and how many features left the GPU tier."""

    batches: list[OffloadItems] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    demoted: list[Release] = field(default_factory=list)
    evicted: int = 0


@final
@dataclass(slots=True, eq=False)
class Promotion:
    """What plan_promotion decided for a host hit: whether to promote it (its upload
    becomes the GPU entry, charged by promote_entry / promote_member in the same loop
    turn), and the eviction made for it, to carry out (None: none)."""

    promote: bool
    eviction: EvictionPlan | None = None


#: the decisions that evict nothing (shared)
PROMOTE: Final = Promotion(True)
SKIP: Final = Promotion(False)

#: GPU victims a host hit is compared with (the next ones in the GPU order) when it wants
#: their room: the least used of them go first (a sampled LFU within TinyLFU's rule)
PROMOTION_VICTIMS: Final = 8


@final
@dataclass(slots=True, eq=False)
class Offload:
    """One offload copy queued: its fence, the entries it moves, whether its device bytes
    are the GPU tier's (not a put straight to the host tier), its bytes and features."""

    fence: Fence
    batch: list[Entry]
    started: float
    charged_gpu: bool
    nbytes: int
    features: int


@final
@dataclass(slots=True, eq=False)
class Landing:
    """What an offload's landing leaves to do: releases, and the entries whose copy failed
    (lost) with the error."""

    releases: list[Release]
    lost: list[Entry]
    failed: BaseException | None


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
        # Offloading a little ahead keeps the copy engine busy while the next puts run.
        self._ahead = evict_ahead
        self._small = small_copy_bytes
        # Every offload in flight (linked or already discarded) -> whether GPU-charged.
        self._offloading: dict[Entry, bool] = {}
        #: told of each entry the host tier drops for room, before it goes
        self.on_host_evict: Callable[[Entry], None] | None = None
        #: run before each eviction plan: applies the recency of hits served off the loop
        #: (core/thread_hits.py), so that victims are chosen by it
        self.before_plan: Callable[[], None] | None = None
        #: which host hits may take GPU entries' room (promote_policy="tinylfu"); None:
        #: host hits are promoted only into free room
        self.admission: TinyLfu | None = TinyLfu() if admission else None
        self._promoting = False  # planning a promotion's eviction (see _let_go_enough)

    # --- reading the state ---------------------------------------------------

    def charged(self, entry: Entry) -> bool:
        """Whether entry's offload in flight is charged to the GPU tier."""
        return self._offloading.get(entry, False)

    def in_flight(self) -> Mapping[Entry, bool]:
        """Every entry with an offload in flight -> whether it is GPU-charged (the audit's)."""
        return self._offloading

    def offloading(self, entry: Entry) -> bool:
        """Whether entry's offload is in flight (its entry may be discarded already)."""
        return entry in self._offloading

    def tell_host_evictions(self, on_evict: Callable[[Entry], None]) -> None:
        """Call on_evict(entry) for each entry the host tier drops for room, before it goes."""
        self.on_host_evict = on_evict

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
            if self._offloading.get(group, False):
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
                self._take_block(entry)
            return (
                self._release_charged(
                    tensor, entry.nbytes, [entry.ready, *entry.device_readers_pending()]
                ),
            )
        if state is State.HOST:
            self.host_order.pop(entry.key, None)
            return self._take_block(entry)
        return NOTHING  # State.D2H: its landing releases both sides once the copy ends

    def _release_charged(
        self, tensor: torch.Tensor, nbytes: int, after: Sequence[Fence]
    ) -> DeviceRelease:
        """Release a device tensor charged to the GPU tier once after's fences are done."""
        pending = [f for f in after if not f.done()]
        if not pending:
            self.ledger.release(nbytes)
            return DeviceRelease(tensor, pending)
        self.ledger.release_later(nbytes)
        return DeviceRelease(tensor, pending, nbytes)

    def _take_block(self, entry: Entry) -> Sequence[Release]:
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

    # --- the host tier's room ---------------------------------------------------

    def allocate_host(self, nbytes: int, releases: list[Release]) -> HostBlock | None:
        """A host block now, dropping host entries in the policy's order if needed (their
        releases appended to releases); None if no room can be made."""
        pool = self.pool
        if pool is None or nbytes > pool.ready_block_bytes:
            return None  # dropping entries would make no room that fits it
        let_go = 0
        while True:
            block = pool.allocate(nbytes)
            if block is not None or not self.host_order or self._let_go_enough(let_go, nbytes):
                return block
            let_go += self._host_victim_bytes()
            releases.extend(self._evict_host())

    def allocate_host_all(
        self, sizes: Sequence[int], releases: list[Release]
    ) -> list[HostBlock] | None:
        """A host block for each size now, or none (dropping host entries as
        allocate_host does). One by one first; if that fails, as one run, which an emptied
        arena always takes. None while the arena is not pinned yet."""
        pool = self.pool
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
            if run is not None or not self.host_order or self._let_go_enough(let_go, sum(sizes)):
                return run
            let_go += self._host_victim_bytes()
            releases.extend(self._evict_host())

    def _let_go_enough(self, let_go: int, nbytes: int) -> bool:
        """Whether a node's shared host tier (host_share="node") has had enough of this
        rank's host entries for nbytes: another rank may hold the blocks it lets go, which
        come back only once every rank has (the others evict in their own turn), so it
        gives up nbytes of them, not its whole tier, before it drops the victim. A
        promotion's victims take none: the hits being read are host entries too, and with
        most of the node's blocks another rank's they would be next."""
        pool = self.pool
        if pool is None or not pool.shared:
            return False
        return self._promoting or let_go >= nbytes

    def _host_victim_bytes(self) -> int:
        victim = self.host_order.next_victim()
        return 0 if victim is None else victim.nbytes

    def _evict_host(self) -> Sequence[Release]:
        """Drop the host entry the policy gives up first (a host-tier eviction)."""
        victim = self.host_order.evict()
        self._counters.evicted_cpu(victim.count)
        if victim.state is State.GPU:
            # A promoted entry's host copy: the feature stays on the GPU tier, which
            # offloads it again (a copy) if it evicts it. Only the block goes.
            return self._take_block(victim)
        if self.on_host_evict is not None:
            self.on_host_evict(victim)
        return self._unlink(victim)

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
        if self.before_plan is not None:
            self.before_plan()
        plan = EvictionPlan()
        order = self.gpu_order
        ledger = self.ledger
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
                plan.demoted.append(self._demote(entry))
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

    def _demote(self, entry: Entry) -> DeviceRelease:
        """A GPU entry that kept its host copy leaves the GPU tier: its device tensor is
        released after its producer and readers; it stays in the host tier (and order)."""
        after = [entry.ready, *entry.device_readers_pending()]
        tensor = entry.demote()
        self.ledger.gpu_left(entry.count)
        return self._release_charged(tensor, entry.nbytes, after)

    def _plan_batch(self, entries: list[Entry], nbytes: int, plan: EvictionPlan) -> int:
        """Host blocks for a batch of victims of nbytes in all (one run where one free
        range takes them all, else one by one), dropping those the host tier cannot take;
        the bytes planned."""
        run = None
        pool = self.pool
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
                plan.releases.extend(self.drop(entry))
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
        pool = self.pool
        assert pool is not None
        left: list[Entry] = []
        for entry in entries:
            block = None
            if entry.members is None:
                block = pool.adopt(entry.key, entry.shape, entry.dtype, entry.nbytes)
            if block is None:
                left.append(entry)
                continue
            entry.keep_copy(block, self._done)
            self.ledger.host_entered(entry.count)
            self.host_order[entry.key] = entry
            plan.demoted.append(self._demote(entry))
            nbytes -= entry.nbytes
        return left, nbytes

    def _share_landed(self, entry: Entry) -> None:
        """A host copy just landed in the node's shared host tier: offer it to the other
        ranks, or, where one of them wrote the feature first, hold theirs and free ours."""
        pool = self.pool
        block = entry.block
        if pool is None or block is None or entry.members is not None:
            return
        if entry.readers_pending() or entry.host_streams:
            return  # read already: it keeps its own block (a copy the node holds twice)
        theirs = pool.publish(block, entry.key, entry.shape, entry.dtype)
        if theirs is not None:
            pool.free(entry.move_block(theirs))

    # --- offloads ----------------------------------------------------------------

    def offload_queued(
        self, items: OffloadItems, fence: Fence, started: float, *, charged_gpu: bool
    ) -> Offload:
        """Entries whose copies into blocks were queued behind fence: D2H until it lands."""
        offloading = self._offloading
        batch = []
        features = nbytes = 0
        for entry, block in items:
            entry.begin_offload(block, fence)
            offloading[entry] = charged_gpu
            features += entry.count
            nbytes += entry.nbytes
            batch.append(entry)
        self.ledger.offloading(nbytes, features, charged_gpu)
        return Offload(fence, batch, started, charged_gpu, nbytes, features)

    def offload_refused(self, items: OffloadItems, *, charged_gpu: bool) -> list[Release]:
        """The device refused the copy of items at enqueue (nothing was queued): their
        blocks go back and the entries are lost."""
        releases: list[Release] = []
        for entry, block in items:
            self.free_block(block)
            if charged_gpu:
                releases.extend(self.drop(entry))
            else:  # a put straight to the host tier: nothing was charged to the GPU tier
                self._counters.lost(self.index.forget(entry))
                tensor = entry.discard()
                assert tensor is not None
                releases.append(DeviceRelease(tensor, [entry.ready]))
        return releases

    def offload_landed(self, offload: Offload) -> Landing:
        """An offload copy has finished: its entries become host-resident, or are lost.

        Once per copy for all its features; the ledger moves once per batch.
        """
        charged_gpu = offload.charged_gpu
        failed = offload.fence.exception()  # asked once: it may be many fences (simulator)
        offloading = self._offloading
        quarantined = self.quarantine if self.quarantine else None
        host_order = self.host_order
        done = self._done
        releases: list[Release] = []
        lost: list[Entry] = []
        released = features = 0  # features still counted: members may have left since
        shared = self.pool is not None and self.pool.shared  # host_share="node"
        for entry in offload.batch:
            del offloading[entry]
            features += entry.count
            if quarantined is not None:
                quarantined.release(entry)  # a late fence: its bytes come back now
            landed = entry.state is State.D2H and failed is None
            # Landed, both copies are done and good: a shared finished fence stands in for
            # them, so a host entry keeps no CUDA event (nor the batch's fence) alive.
            tensor = entry.land(done) if landed else entry.end_offload()
            # A host get's download may still read the device tensor.
            readers = entry.device_readers_pending() if entry.device_readers else None
            if readers and charged_gpu:
                releases.append(self._release_charged(tensor, entry.nbytes, readers))
            else:
                releases.append(DeviceRelease(tensor, readers or ()))
                released += entry.nbytes
            if landed:
                host_order[entry.key] = entry
                if shared:
                    self._share_landed(entry)
            else:
                lost.append(entry)
                if entry.state is State.D2H:  # the copy failed: the feature is lost
                    self._counters.copy_failed("offload", entry.key, failed)
                    self._counters.lost(self.index.forget(entry))
                    entry.discard()
                releases.extend(self._take_block(entry))
        if charged_gpu:
            self.ledger.offloaded(offload.nbytes, features, released)
        return Landing(releases, lost, failed)

    def quarantine_offload(self, entry: Entry, fence: Fence) -> bool:
        """An offload past copy_timeout_s: drop its entry, keep its bytes reserved as
        leaked (the copy may still read the tensor or write the block); False if it is
        done, gone or held already. Its landing releases both if the fence ever completes."""
        if fence.done() or entry not in self._offloading or entry in self.quarantine:
            return False
        block = entry.block
        self.quarantine.hold(
            entry,
            entry.nbytes if self._offloading[entry] else 0,
            block.nbytes if block is not None else 0,
        )
        self._counters.quarantined()
        lost = self.index.forget(entry)
        if lost:
            self._counters.lost(lost)
        entry.discard()
        return True

    # --- reads ------------------------------------------------------------------

    def plan_promotion(self, found: Entry | Member, nbytes: int, reserved: int = 0) -> Promotion:
        """Whether a host hit of found (nbytes to the device) is promoted, reserved bytes
        being promised to hits before it in the same loop turn (get_many's).

        Into free room, always. Into a full GPU tier, with an admission filter
        (promote_policy="tinylfu"), only into the room of GPU entries used less often
        lately than found (TinyLFU's rule, core/admission.py): of the PROMOTION_VICTIMS
        next victims in the GPU order, the least used first, those that kept a host copy
        (demoted now: a ledger move, no copy) before those that did not (offloaded: copies
        to queue, whose room comes when they land). The hit is promoted if the room is
        free now. The caller checked that no put waits for room (a promotion never jumps
        their line).
        """
        ledger = self.ledger
        free = ledger.capacity - ledger.used - reserved
        admission = self.admission
        if admission is None:
            return PROMOTE if free >= nbytes else SKIP
        if free >= nbytes:
            if isinstance(found, Entry):
                found.hits += 1  # a use, counted with no call: folded in when compared
            else:
                admission.used(found)
            return PROMOTE
        if nbytes > ledger.capacity - reserved:
            return SKIP
        counters = self._counters
        admission.keep_up(
            counters.hits_gpu + counters.hits_cpu + counters.misses,
            ledger.gpu_entries,
            len(self.index),
        )
        wanted = admission.used(found)
        need = nbytes - free
        # The colder victims, least used first (ties: in the order's), those whose room
        # is free at once (a host copy, no reader) before the others.
        colder: list[tuple[bool, int, int, Entry]] = []
        sketch = admission.sketch
        for place, victim in enumerate(self.gpu_order.peek(PROMOTION_VICTIMS)):
            hits = victim.hits  # admission.frequency(victim), inline: one call, not two
            if hits:
                victim.hits = 0
                used = sketch.add(victim.key, hits)
            else:
                used = sketch.estimate(victim.key)
            if used < wanted:
                at_once = (
                    victim.block is not None
                    and victim.ready.done()
                    and not (victim.device_readers and victim.device_readers_pending())
                )
                colder.append((not at_once, used, place, victim))
        colder.sort()  # those free at once, then the least used, then by the order
        chosen: list[Entry] = []
        room = 0
        for _, _, _, victim in colder:
            chosen.append(victim)
            room += victim.nbytes
            if room >= need:
                break
        else:
            return SKIP  # too little room in colder entries: none of them goes
        self._promoting = True  # its victims take no host room from host entries being read
        try:
            plan = self._evict_chosen(chosen)
        finally:
            self._promoting = False
        return Promotion(ledger.capacity - ledger.used - reserved >= nbytes, plan)

    def _evict_chosen(self, victims: list[Entry]) -> EvictionPlan:
        """Take victims (GPU entries) out of the GPU tier: those with a host copy demoted,
        the others to offload (small ones in one batch, large ones alone)."""
        plan = EvictionPlan()
        order = self.gpu_order
        small: list[Entry] = []
        small_bytes = 0
        for victim in victims:
            if order.next_victim() is victim:
                order.evict()  # as an eviction (the cost policy's clock rises to it)
            else:
                order.pop(victim.key, None)
            plan.evicted += victim.count
            if victim.block is not None:
                plan.demoted.append(self._demote(victim))
            elif victim.nbytes < self._small:
                small.append(victim)
                small_bytes += victim.nbytes
            else:
                self._plan_batch([victim], victim.nbytes, plan)
        if small:
            self._plan_batch(small, small_bytes, plan)
        self._counters.evicted_gpu(plan.evicted)
        return plan

    def promote_member(
        self, member: Member, tensor: torch.Tensor, fence: Fence
    ) -> tuple[Entry, Sequence[Release]]:
        """A GPU-resident entry of its own for a group member, from its uploaded rows."""
        group = member.group
        entry = Entry(
            member.key,
            member.shape,
            group.dtype,
            member.nbytes,
            State.GPU,
            tensor,
            fence,
            hits=0,  # this hit's use went into the admission sketch under the member's key
        )
        releases = self._leave_group(member)
        self.index[entry.key] = entry
        self._promoted(entry)
        return entry, releases

    def promote_entry(self, entry: Entry, tensor: torch.Tensor, fence: Fence) -> Sequence[Release]:
        """Make a host entry GPU-resident again, charged to the GPU tier.

        Inclusive tiers: the entry keeps its host block, still counted in the host tier
        and still in the host order, where it ages (GPU hits do not touch it). A host-tier
        eviction may take that block back (the entry then is GPU-only, and leaving the GPU
        tier costs a copy again); a GPU-tier eviction demotes it with no copy.
        """
        entry.promote(tensor, fence)
        self._promoted(entry)
        return NOTHING

    def _promoted(self, entry: Entry) -> None:
        """Charge a promoted GPU-state entry to the GPU tier, most recently used."""
        self.ledger.promote(entry.nbytes)
        self.gpu_order[entry.key] = entry
        self._counters.promoted()

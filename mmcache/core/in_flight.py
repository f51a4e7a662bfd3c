"""The offloads in flight: the part of the tier state that follows each copy of GPU
entries to the host tier from its queueing to its landing (or its quarantine).

Part of the tier state (core/state.py): only the TierState calls it, through the verbs
it binds as its own (offload_queued, offload_refused, offload_landed,
quarantine_offload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, final

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, State
from mmcache.core.release import DeviceRelease, Release
from mmcache.device.base import Fence

if TYPE_CHECKING:
    from mmcache.core.room import OffloadItems
    from mmcache.core.state import TierState

__all__ = ["InFlight", "Landing", "Offload"]


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
class InFlight:
    """Every offload in flight (its entry linked or already discarded) and whether its
    device bytes are the GPU tier's; the transitions of their entries."""

    def __init__(self, state: TierState, *, counters: Counters, done_fence: Fence) -> None:
        self._state = state
        self._ledger = state.ledger
        self._index = state.index
        self._host_order = state.host_order
        self._quarantine = state.quarantine
        self._counters = counters
        self._done = done_fence  # a finished fence: a host entry's stands for its copies'
        #: entry -> whether its device bytes are charged to the GPU tier
        self.entries: dict[Entry, bool] = {}

    def offload_queued(
        self, items: OffloadItems, fence: Fence, started: float, *, charged_gpu: bool
    ) -> Offload:
        """Entries whose copies into blocks were queued behind fence: D2H until it lands."""
        offloading = self.entries
        batch = []
        features = nbytes = 0
        for entry, block in items:
            entry.begin_offload(block, fence)
            offloading[entry] = charged_gpu
            features += entry.count
            nbytes += entry.nbytes
            batch.append(entry)
        self._ledger.offloading(nbytes, features, charged_gpu)
        return Offload(fence, batch, started, charged_gpu, nbytes, features)

    def offload_refused(self, items: OffloadItems, *, charged_gpu: bool) -> list[Release]:
        """The device refused the copy of items at enqueue (nothing was queued): their
        blocks go back and the entries are lost."""
        releases: list[Release] = []
        for entry, block in items:
            self._state.free_block(block)
            if charged_gpu:
                releases.extend(self._state.drop(entry))
            else:  # a put straight to the host tier: nothing was charged to the GPU tier
                self._counters.lost(self._index.forget(entry))
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
        offloading = self.entries
        quarantined = self._quarantine if self._quarantine else None
        host_order = self._host_order
        done = self._done
        releases: list[Release] = []
        lost: list[Entry] = []
        released = features = 0  # features still counted: members may have left since
        overdue = 0  # bytes of quarantined entries, no longer counted as releasing
        shared = self._state.pool is not None and self._state.pool.shared  # host_share="node"
        for entry in offload.batch:
            del offloading[entry]
            features += entry.count
            if quarantined is not None:
                overdue += quarantined.release(entry)  # a late fence: its bytes come back now
            landed = entry.state is State.D2H and failed is None
            # Landed, both copies are done and good: a shared finished fence stands in for
            # them, so a host entry keeps no CUDA event (nor the batch's fence) alive.
            tensor = entry.land(done) if landed else entry.end_offload()
            # A host get's download may still read the device tensor.
            readers = entry.device_readers_pending() if entry.device_readers else None
            if readers and charged_gpu:
                releases.append(self._state.release_charged(tensor, entry.nbytes, readers))
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
                    self._counters.lost(self._index.forget(entry))
                    entry.discard()
                releases.extend(self._state.take_block(entry))
        if charged_gpu:
            self._ledger.offloaded(offload.nbytes - overdue, features, released)
        return Landing(releases, lost, failed)

    def _share_landed(self, entry: Entry) -> None:
        """A host copy just landed in the node's shared host tier: offer it to the other
        ranks, or, where one of them wrote the feature first, hold theirs and free ours."""
        pool = self._state.pool
        block = entry.block
        if pool is None or block is None or entry.members is not None:
            return
        if entry.readers_pending() or entry.host_streams:
            return  # read already: it keeps its own block (a copy the node holds twice)
        theirs = pool.publish(block, entry.key, entry.shape, entry.dtype)
        if theirs is not None:
            pool.free(entry.move_block(theirs))

    def quarantine_offload(self, entry: Entry, fence: Fence) -> bool:
        """An offload past copy_timeout_s: drop its entry, keep its bytes reserved as
        leaked (the copy may still read the tensor or write the block), and no longer
        counted as GPU room on its way; False if it is done, gone or held already. Its
        landing releases both if the fence ever completes."""
        if fence.done() or entry not in self.entries or entry in self._quarantine:
            return False
        block = entry.block
        device_bytes = entry.nbytes if self.entries[entry] else 0
        self._quarantine.hold(entry, device_bytes, block.nbytes if block is not None else 0)
        # Room on its way no more: a put waiting for it must have other entries evicted.
        self._ledger.overdue(device_bytes)
        self._counters.quarantined()
        if entry.state is not State.GONE:  # discarded or replaced meanwhile: gone already
            lost = self._index.forget(entry)
            if lost:
                self._counters.lost(lost)
            entry.discard()
        return True

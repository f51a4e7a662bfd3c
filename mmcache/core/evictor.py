"""Evictor: the GPU tier's room for puts, and the victims it hands to the offload pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import torch

from mmcache.budget import FifoBudget
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry
from mmcache.core.grants import Grant
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.core.offload import OffloadPipeline
from mmcache.core.packing import BATCH_BYTES, LARGE_BATCH_BYTES
from mmcache.core.policy import EvictionPolicy
from mmcache.device import CopyPlan, Device, Fence
from mmcache.errors import CacheClosedError
from mmcache.host_pool import HostBlock

__all__ = ["Evictor"]


@final
class Evictor:
    """Grants GPU room to puts (first come first served) and makes it by offloading.

    A put takes room at once when it has some and nobody waits before it; otherwise it
    joins the line (a FifoBudget over the ledger). Victims come from the GPU tier's
    policy and go to the host tier through the offload pipeline, small ones batched
    behind one fence; those the host tier cannot take now are dropped. Nothing here
    waits, except a put for its grant.
    """

    def __init__(
        self,
        *,
        device: Device,
        ledger: TierLedger,
        counters: Counters,
        index: KeyIndex,
        order: EvictionPolicy,
        host: HostTier,
        pipeline: OffloadPipeline,
        drop: Callable[[Entry], None],
        evict_ahead: int,
        small_copy_bytes: int,
    ) -> None:
        self._device = device
        self._ledger = ledger
        self._counters = counters
        self._index = index
        self._order = order
        self._host = host
        self._pipeline = pipeline
        self._drop = drop  # loses an entry the host tier cannot take now
        # Offloading a little ahead keeps the copy engine busy while the next puts run,
        # instead of each put waiting for the one copy that makes its room.
        self._ahead = evict_ahead
        self._small = small_copy_bytes
        #: puts waiting for GPU room, granted into their grants in arrival order
        self.waiting: FifoBudget[tuple[int, Grant], Grant] = FifoBudget(
            ledger.take_if_free, ledger.return_grant
        )
        self._closed = False

    def take(self, nbytes: int, grant: Grant) -> bool:
        """Reserve nbytes of the GPU tier into grant if it has room now and no put waits
        before us."""
        ahead = self._ahead
        ledger = self._ledger
        if ledger.free() < nbytes + ahead and self._pipeline:
            self._pipeline.reap()
        # Asked once: evicting adds no put to the line (only wait() does).
        if self.waiting:
            return False
        if ledger.free() + ledger.releasing < nbytes + ahead // 2:
            # Below the low-water mark: offload a batch now, so the copies of the next
            # batch overlap with the puts that use the room this one makes. Topping up a
            # batch saves a copy only where a host tier takes it (else it drops more).
            slack = ahead // 2 if self._host.pool is not None else 0
            self.evict_for(nbytes + ahead, slack=slack, ahead=True)
        if ledger.free() >= nbytes:
            ledger.grant(grant, nbytes)
            return True
        return False

    def give_back(self, grant: Grant) -> None:
        """Give back the GPU budget grant holds (its put will not insert), waking waiters."""
        if grant.nbytes:
            self._ledger.return_grant(grant)
            self.wake()

    async def wait(self, nbytes: int, grant: Grant) -> None:
        """Wait in line until nbytes of the GPU tier are granted into grant (after take()
        failed)."""
        waiter = self.waiting.join((nbytes, grant))
        self.wake()  # offloads for us, and grants at once what drops freed
        self._pipeline.watch()  # now, not late: we wait for the room they make
        try:
            await self.waiting.wait(waiter)
        except BaseException:
            self.give_back(grant)  # granted just as we were cancelled: give it back
            self.wake()  # and our place goes to the next
            raise
        if self._closed:  # granted, then close() ran before we resumed: insert nothing
            self.give_back(grant)
            raise CacheClosedError("the cache closed while put waited")

    def wake(self) -> None:
        """Grant waiting puts in arrival order while they fit; offload more for the rest."""
        waiters = self.waiting
        ledger = self._ledger
        while True:
            waiters.grant()
            if not waiters:
                return
            free_before = ledger.free()
            self.evict_for(sum(nbytes for nbytes, _ in waiters.wanted()))
            if ledger.free() == free_before:
                return  # the rest is on its way (copies in flight)

    def close(self) -> None:
        """A put granted from now on inserts nothing (the cache is closing)."""
        self._closed = True

    def fail_waiting(self) -> None:
        """Raise CacheClosedError in every put waiting for GPU room."""
        self.waiting.fail_all(lambda: CacheClosedError("the cache closed while put waited"))

    def evict_for(self, needed: int, *, slack: int = 0, ahead: bool = False) -> None:
        """Offload victims until needed bytes are free or on their way.

        Features below small_copy_bytes go in batches of about BATCH_BYTES behind one
        fence: per-copy work (an enqueue, an event, a wake-up on landing) would otherwise
        cap small features far below the copy engine's bandwidth. Up to slack bytes more
        may go to top up a last batch left part full with the next small victims: on its
        own it would pay a copy, a fence and a landing for a few features. Larger ones go
        alone, so that the room each makes comes back as soon as it lands; when the room
        is for later puts (ahead), in batches of up to LARGE_BATCH_BYTES, which cost the
        loop one copy call, fence and landing per batch instead of per feature; and of up
        to half of evict_ahead, so that the copy engine has a second batch queued while
        the first lands (one batch of all the room ahead returns it at once, and the
        engine idles while the next puts use it up).
        """
        order = self._order
        ledger = self._ledger
        small_limit = self._small
        large_limit = min(LARGE_BATCH_BYTES, self._ahead // 2) if ahead else 0
        limit = needed + slack
        batch: list[Entry] = []
        large: list[Entry] = []
        batched = large_bytes = evicted = 0
        while order:
            have = ledger.free() + ledger.releasing + batched + large_bytes
            if have >= needed:
                if not batch:
                    break
                oldest = order.next_victim()
                if oldest is None or oldest.nbytes >= small_limit or have + oldest.nbytes > limit:
                    break
            entry = order.evict()
            evicted += entry.count
            if entry.nbytes < small_limit:
                if large:  # older victims get their host room first, in the policy's order
                    self._offload_batch(large)
                    large, large_bytes = [], 0
                batch.append(entry)
                batched += entry.nbytes
                if batched >= BATCH_BYTES:
                    # One fence frees a whole batch: bounded, so room comes back in steps.
                    self._offload_batch(batch)
                    batch, batched = [], 0
            else:
                if batch:
                    self._offload_batch(batch)
                    batch, batched = [], 0
                if large and large_bytes + entry.nbytes > large_limit:
                    self._offload_batch(large)
                    large, large_bytes = [], 0
                large.append(entry)
                large_bytes += entry.nbytes
        if large:
            self._offload_batch(large)
        if batch:
            self._offload_batch(batch)
        if evicted:
            self._counters.evicted_gpu(evicted)

    def offload(self, items: Sequence[tuple[Entry, HostBlock]], *, charged_gpu: bool) -> None:
        """Queue the device -> host copies of entries into blocks, after their producers."""
        pool = self._host.pool
        assert pool is not None
        srcs: list[torch.Tensor] = []
        offsets: list[int] = []
        # Producers long finished need no ordering; failed ones must fail the copy too.
        # A put_many group shares one producer fence: look at each fence once.
        readies: list[Fence] = []
        last: Fence | None = None
        for entry, block in items:
            assert entry.tensor is not None
            srcs.append(entry.tensor)
            offsets.append(block.offset)
            ready = entry.ready
            if ready is not last:
                last = ready
                if not ready.done() or ready.exception() is not None:
                    readies.append(ready)
        try:
            fence = self._device.submit(
                CopyPlan("d2h", srcs, into=pool.arena, offsets=offsets, after=readies, owned=True)
            )
        except Exception as e:
            # Refused at enqueue (e.g. no memory for a gather buffer, or a driver error):
            # nothing was queued, so the victims are dropped as if the host tier could not
            # take them, and the put that evicted or inserted them goes on.
            del srcs
            self._counters.copy_failed("offload", None, e)
            for entry, block in items:
                pool.free(block)
                if charged_gpu:
                    self._drop(entry)
                else:  # a put straight to the host tier: nothing was charged to the GPU tier
                    self._counters.lost(self._index.forget(entry))
                    tensor = entry.discard()
                    assert tensor is not None
                    self._device.release(tensor, after=[entry.ready])
            return
        del srcs  # the entries keep the sources alive until the copy has landed
        self._pipeline.queue(fence, items, charged_gpu=charged_gpu)

    def _offload_batch(self, entries: list[Entry]) -> None:
        """Offload GPU entries through one fence, dropping those the host tier cannot take."""
        # One run of blocks for a batch: one search in the pool, not one per feature, and
        # one range for the device to fill. Holes smaller than the batch are left to
        # features placed one by one (large ones, and batches when no range takes them).
        blocks = None
        if len(entries) > 1:
            blocks = self._host.allocate_run([e.nbytes for e in entries])
        if blocks is not None:
            items = list(zip(entries, blocks, strict=True))
        else:  # one feature, or no single free range takes them all: one by one
            items = []
            for entry in entries:
                block = self._host.allocate(entry.nbytes)
                if block is None:
                    self._drop(entry)
                else:
                    items.append((entry, block))
        if items:
            self.offload(items, charged_gpu=True)

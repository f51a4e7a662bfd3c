"""Evictor: the GPU tier's room for puts, and the offload copies of the victims it plans."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import torch

from mmcache.budget import FifoBudget
from mmcache.core.counters import Counters
from mmcache.core.grants import Grant
from mmcache.core.offload import OffloadPipeline
from mmcache.core.state import EvictionPlan, OffloadItems, Release, TierState
from mmcache.device import CopyPlan, Device, Fence
from mmcache.errors import CacheClosedError, CopyTimeoutError

__all__ = ["Evictor"]


@final
class Evictor:
    """Grants GPU room to puts (first come first served) and makes it by offloading.

    A put takes room at once when it has some and nobody waits before it; otherwise it
    joins the line (a FifoBudget over the ledger). The state plans the victims
    (TierState.plan_eviction); this part queues their copies, each batch behind one
    fence, and hands them to the offload pipeline. Nothing here waits, except a put for
    its grant.
    """

    def __init__(
        self,
        *,
        device: Device,
        state: TierState,
        counters: Counters,
        pipeline: OffloadPipeline,
        waiting: FifoBudget[tuple[int, Grant], Grant],
        carry_out: Callable[[Sequence[Release]], None],
        evict_ahead: int,
    ) -> None:
        self._device = device
        self._state = state
        self._ledger = state.ledger  # read here; changed through the state's verbs
        self._counters = counters
        self._pipeline = pipeline
        self._carry_out = carry_out
        # Offloading a little ahead keeps the copy engine busy while the next puts run,
        # instead of each put waiting for the one copy that makes its room.
        self._ahead = evict_ahead
        #: puts waiting for GPU room, granted into their grants in arrival order
        self.waiting = waiting
        self._line = waiting.line  # truthy while a put waits (no call to ask)
        self._landings = pipeline.queued  # truthy while offloads are unhandled
        self._closed = False

    def take(self, nbytes: int, grant: Grant) -> bool:
        """Reserve nbytes of the GPU tier into grant if it has room now and no put waits
        before us."""
        if self.room_for(nbytes):
            self._state.grant(grant, nbytes)
            return True
        return False

    def room_for(self, nbytes: int) -> bool:
        """Whether nbytes are free for a put now, nobody waiting before it (a put that then
        indexes with no await may take them); offloads ahead below the low-water mark."""
        ahead = self._ahead
        ledger = self._ledger
        if ledger.capacity - ledger.used < nbytes + ahead and self._landings:
            self._pipeline.reap()
        # Asked once: evicting adds no put to the line (only wait() does).
        if self._line:
            return False
        if ledger.capacity - ledger.used + ledger.releasing < nbytes + ahead // 2:
            # Below the low-water mark: offload a batch now, so the copies of the next
            # batch overlap with the puts that use the room this one makes. Topping up a
            # batch saves a copy only where a host tier takes it (else it drops more).
            if self._state.pool is not None:
                self.evict_for(nbytes + ahead, slack=ahead // 2, ahead=True)
            else:  # no host tier (yet): a victim ahead would only be dropped early
                self.evict_for(nbytes)
        return ledger.capacity - ledger.used >= nbytes

    def give_back(self, grant: Grant) -> None:
        """Give back the GPU budget grant holds (its put will not insert), waking waiters."""
        if grant.nbytes:
            self._state.return_grant(grant)
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
        line = waiters.line  # read with no call: most landings find nobody waiting
        ledger = self._ledger
        while True:
            if line:
                waiters.grant()
            if not line:
                return
            free_before = ledger.free()
            self.evict_for(sum(nbytes for nbytes, _ in waiters.wanted()))
            if ledger.free() == free_before:
                if self._state.quarantine:
                    self._fail_beyond_quarantine()
                return  # the rest is on its way (copies in flight)

    def _fail_beyond_quarantine(self) -> None:
        """Fail the waiting puts that need more room than the GPU tier has outside the
        quarantine: only a hung copy that completes at last could give it back."""
        held = self._state.quarantine.device_bytes()
        room = self._ledger.capacity - held

        def error() -> CopyTimeoutError:
            return CopyTimeoutError(
                f"put waits for GPU room that offload copies hold: {held} bytes of the "
                f"{self._ledger.capacity}-byte tier are quarantined (their copies did not "
                "complete within MMCACHE_COPY_TIMEOUT_SEC), and the room left cannot take it"
            )

        self.waiting.fail_if(lambda want: want[0] > room, error)

    def close(self) -> None:
        """A put granted from now on inserts nothing (the cache is closing)."""
        self._closed = True

    def fail_waiting(self) -> None:
        """Raise CacheClosedError in every put waiting for GPU room."""
        self.waiting.fail_all(lambda: CacheClosedError("the cache closed while put waited"))

    def evict_for(self, needed: int, *, slack: int = 0, ahead: bool = False) -> EvictionPlan:
        """Offload victims until needed bytes are free or on their way (the state's plan,
        TierState.plan_eviction, carried out); returns the plan."""
        plan = self._state.plan_eviction(needed, slack=slack, ahead=ahead)
        # carry_out(plan), inline: a put that evicts pays no call for it
        if plan.releases:
            self._carry_out(plan.releases)
        if plan.demoted:
            self._carry_out(plan.demoted)
        for items in plan.batches:
            self.offload(items, charged_gpu=True)
        return plan

    def carry_out(self, plan: EvictionPlan) -> None:
        """Carry out an eviction plan: release what was dropped and what was demoted (after
        their readers; demotions copy nothing), and queue one copy per batch."""
        if plan.releases:
            self._carry_out(plan.releases)
        if plan.demoted:
            self._carry_out(plan.demoted)
        for items in plan.batches:
            self.offload(items, charged_gpu=True)

    def offload(self, items: OffloadItems, *, charged_gpu: bool) -> None:
        """Queue the device -> host copies of entries into blocks, after their producers."""
        pool = self._state.pool
        assert pool is not None
        srcs: list[torch.Tensor] = []
        offsets: list[int] = []
        # The copy orders after each producer (the device skips those long done, and
        # fails the copy after one that failed). Puts of one loop turn, and a put_many
        # group, share one producer fence: each is given once.
        readies: list[Fence] = []
        last: Fence | None = None
        for entry, block in items:
            assert entry.tensor is not None
            srcs.append(entry.tensor)
            offsets.append(block.offset)
            ready = entry.ready
            if ready is not last:
                last = ready
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
            self._carry_out(self._state.offload_refused(items, charged_gpu=charged_gpu))
            return
        del srcs  # the entries keep the sources alive until the copy has landed
        self._pipeline.queue(fence, items, charged_gpu=charged_gpu)

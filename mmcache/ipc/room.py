"""SendRoom: the room sends are granted in the IPC pool and the host fallback, and its audit."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from mmcache.budget import FifoBudget
from mmcache.device import Fence
from mmcache.errors import ValueTooLargeError
from mmcache.host_pool import HostBlock
from mmcache.ipc.control import LIVE, ControlBlock, LaneInfo
from mmcache.ipc.errors import NoPeerAccessError
from mmcache.ipc.leases import LeaseLedger
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.pool import SliceArena, SlotAllocator
from mmcache.settings import CacheSettings

__all__ = ["Placement", "SendRoom", "Where"]

_MiB: Final = 1 << 20

Where = Literal["pool", "host"]


@dataclass(slots=True, eq=False)
class Placement:
    """Room granted to one send: a slice of an arena and a control-block slot.

    owner is the task of the send it was granted to: room still granted once
    that task has ended is leaked. after holds the copies queued into the slice
    (it is reused only after them), seq the send the slot was armed for (0: not
    yet), settled whether it became a lease or was given back.
    """

    where: Where
    arena: SliceArena
    block: HostBlock
    slot: int
    owner: asyncio.Task[object] | None
    after: list[Fence] = field(default_factory=list)
    seq: int = 0
    settled: bool = False


# What a send waits for: its bytes, whether the pool may take them, the task sending.
_Want = tuple[int, bool, "asyncio.Task[object] | None"]


class SendRoom:
    """Grants sends a slice of the pool or the fallback and a slot, and takes them back.

    It owns the slots, the bytes granted to sends still copying, the room granted
    and not yet a lease or given back, and the line of sends waiting for room.
    """

    def __init__(self, memory: SenderMemory, settings: CacheSettings, max_slices: int) -> None:
        self._memory = memory
        self.settings = settings
        self._slots = SlotAllocator(max_slices)
        self._inflight = {"pool": 0, "host": 0}  # bytes placed for sends still copying
        self._granted: set[Placement] = set()  # room granted, not yet a lease or given back
        self._control: ControlBlock | None = None
        self._ledger: LeaseLedger | None = None
        # Sends waiting for room, granted a placement in arrival order (the cache's FIFO
        # budget): what a send that gave up was granted goes back through abort.
        self.waiters: FifoBudget[_Want, Placement] = FifoBudget(
            self._place_wanted, lambda placement: self.abort(placement, ())
        )

    @property
    def slot_count(self) -> int:
        """How many slots there are (one per send not yet reclaimed)."""
        return self._slots.capacity

    def bind(self, control: ControlBlock, ledger: LeaseLedger) -> None:
        """The control block whose slots are granted, and the ledger of the leases."""
        self._control, self._ledger = control, ledger

    def in_flight(self) -> bool:
        """Whether room is placed for sends still copying."""
        return any(self._inflight.values())

    def give_slot(self, slot: int) -> None:
        """A reclaimed lease's slot goes back."""
        self._slots.give(slot)

    def pool_refusal(self, nbytes: int, lanes: Sequence[LaneInfo]) -> str | None:
        """Why nbytes may not go through the pool at all (None: it may)."""
        if self._memory.pool is None:
            return "disabled"
        if nbytes > self._memory.pool.max_slice_bytes:
            return "too_large"
        if any(not i.peer_ok for i in lanes if i.state == LIVE):
            return "no_peer"
        return None

    def check_fits(self, nbytes: int, refusal: str | None) -> None:
        """Refuse at once what could never be placed, saying which setting to change."""
        pool, fallback = self._memory.pool, self._memory.fallback
        if refusal is None:  # pool_refusal found the pool able to take it
            return
        if fallback is not None and nbytes <= fallback.max_slice_bytes:
            return
        env = self.settings.env_name
        if refusal == "no_peer":
            raise NoPeerAccessError(
                "a registered receiver cannot read this GPU's IPC pool and the host fallback "
                f"cannot take {nbytes / _MiB:.1f} MiB; raise {env('ipc_fallback_mb')}"
            )
        pool_mb = pool.capacity_bytes / _MiB if pool is not None else 0.0
        fallback_mb = fallback.capacity_bytes / _MiB if fallback is not None else 0.0
        off = "" if self.settings.use_cuda_ipc else f"; off: {env('use_cuda_ipc')}=0"
        raise ValueTooLargeError(
            f"a feature of {nbytes / _MiB:.1f} MiB fits neither the IPC pool "
            f"({pool_mb:.1f} MiB, {env('ipc_pool_mb')}{off}) nor the host fallback "
            f"({fallback_mb:.1f} MiB, {env('ipc_fallback_mb')}); raise one of them"
        )

    def try_place(
        self,
        nbytes: int,
        pool_ok: bool,
        owner: asyncio.Task[object] | None,
        host_ok: bool = True,
    ) -> Placement | None:
        """Room for nbytes now, for the send running as task owner: a pool slice if
        pool_ok, else a fallback block if host_ok; None if full."""
        slot = self._slots.take()
        if slot is None:
            return None
        choices: tuple[tuple[Where, SliceArena | None], ...] = (
            ("pool", self._memory.pool if pool_ok else None),
            ("host", self._memory.fallback if host_ok else None),
        )
        for where, arena in choices:
            if arena is None:
                continue
            block = arena.allocate(nbytes)
            if block is not None:
                self._inflight[where] += block.nbytes
                placement = Placement(where, arena, block, slot, owner)
                self._granted.add(placement)
                return placement
        self._slots.give(slot)
        return None

    def _place_wanted(self, want: _Want) -> Placement | None:
        """Room for a waiting send now (its FifoBudget's take), or None."""
        return self.try_place(*want)

    def abort(self, placement: Placement, after: Sequence[Fence]) -> None:
        """Give back room a send will not use, after the fences and the copies queued
        into it; nothing if it was given back already or became a lease."""
        if placement.settled:
            return
        self.settle(placement)
        if placement.seq and self._control is not None:
            self._control.invalidate(placement.slot, placement.seq)
        placement.arena.free(placement.block, [*placement.after, *after])
        self._slots.give(placement.slot)

    def settle(self, placement: Placement) -> None:
        """Room granted to a send stops being in flight: a lease holds it, or it went back."""
        placement.settled = True
        self._granted.discard(placement)
        self._inflight[placement.where] -= placement.block.nbytes

    def full_message(self, nbytes: int, waited: float | None) -> str:
        """Why a send of nbytes found no room (now, or within waited s), and what to do."""
        env = self.settings.env_name
        held = len(self._ledger) if self._ledger is not None else 0
        used = sum(
            a.used_bytes for a in (self._memory.pool, self._memory.fallback) if a is not None
        )
        how = "now" if waited is None else f"within {waited:.1f} s ({env('ipc_lease_timeout_s')})"
        return (
            f"no room for a {nbytes / _MiB:.2f} MiB feature in the IPC pool or the host "
            f"fallback {how}: {used / _MiB:.1f} MiB are held by {held} sends that receivers "
            f"have not released. Check that the receivers run and receive every handle, or "
            f"raise {env('ipc_fallback_mb')} / {env('ipc_pool_mb')}"
        )

    def leaked_bytes(self) -> int:
        """Late leases, room still granted to sends that have ended, plus arena bytes that
        no lease, send in progress or pending free owns."""
        ledger = self._ledger
        if ledger is None:
            return 0
        leaked = ledger.leaked_bytes()
        leaked += sum(
            placement.block.nbytes
            for placement in self._granted
            if placement.owner is None or placement.owner.done()
        )
        for where, arena in (("pool", self._memory.pool), ("host", self._memory.fallback)):
            if arena is None:
                continue
            owned = ledger.held_bytes(arena) + self._inflight[where] + arena.freeing_bytes
            leaked += arena.used_bytes - owned
        return leaked

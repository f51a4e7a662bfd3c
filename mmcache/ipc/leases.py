"""The sender's ledger of leases: who released each send, and when its slice may be reused.

A send is owed `consumers` releases, fewer while consumers that left were not
replaced (see needed()). A receiver that opened a slice holds a
lease on it until it releases it. When no more than `consumers` receivers
were registered at send, each of them is one of its consumers: the slice
waits for every one of them that is alive, and one that died or closed is
credited with its release (its handles may never have reached it; a
replacement may read them instead). A receiver that dies is always credited
for the slices it had opened. A slice is reused only once enough releases
came, no known consumer is still to come, and no live receiver holds it
open. A lease past its timeout counts as leaked until it is released late or
its receivers are gone; it is never reused before.

Receivers mostly release in the order sends were made, so a quick sweep reads
the oldest leases only, until several in a row may not end yet: its cost
follows what it reclaims, not how many sends are outstanding. A full sweep
reads every lease, credits receivers that died or closed and flags late leases.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, final

from mmcache.device.base import Fence
from mmcache.host_pool import HostBlock
from mmcache.ipc.control import LIVE, ControlBlock, LaneInfo
from mmcache.ipc.handle import FeatureBatch, FeatureHandle
from mmcache.ipc.pool import SliceArena

__all__ = ["Lease", "LeaseLedger", "Sweep"]

#: A quick sweep stops after this many leases in a row that may not end yet.
QUICK_SWEEP_MISSES: Final = 8

#: (lane, epoch): one receiver, even after its lane is reused by another.
Receiver = tuple[int, int]


@dataclass(slots=True, eq=False)
class Lease:
    """One send whose bytes are held for its receivers."""

    handle: FeatureHandle | FeatureBatch
    arena: SliceArena
    block: HostBlock
    written: Fence
    owed_by: frozenset[Receiver]
    needed: int
    sent_at: float = field(default_factory=time.monotonic)
    released_by: set[Receiver] = field(default_factory=set)
    open_by: set[Receiver] = field(default_factory=set)
    timed_out: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the slice (rounded to the arena's alignment)."""
        return self.block.nbytes


@final
@dataclass(slots=True)
class Sweep:
    """What one sweep found."""

    recycled: list[Lease] = field(default_factory=list)
    timed_out: list[Lease] = field(default_factory=list)
    #: (receiver, sends credited to it): state GONE means it closed, LIVE that it died.
    lost: list[tuple[LaneInfo, int]] = field(default_factory=list)


@final
class LeaseLedger:
    """Every live lease of one sender, and the rules that end them."""

    __slots__ = (
        "_control",
        "_gone",
        "_held",
        "_late",
        "_leases",
        "_open",
        "_seated",
        "consumers",
        "lost_receivers",
        "timeout_s",
    )

    def __init__(self, control: ControlBlock, consumers: int, timeout_s: float) -> None:
        self._control = control
        self.consumers = consumers
        self.timeout_s = timeout_s
        self._leases: dict[int, Lease] = {}  # by seq
        self._seated = 0  # most consumers ever registered at once
        self._gone: set[Receiver] = set()  # every receiver found dead or closed
        self.lost_receivers = 0
        # Kept as leases come and go, so gauges read them per send without a pass:
        self._held: dict[int, int] = {}  # id(arena) -> bytes of its leases
        self._open: dict[int, int] = {}  # id(arena) -> bytes held open (as of the last sweep)
        self._late = 0  # bytes of leases past their timeout

    def needed(self, registered: int) -> int:
        """Releases a send owes now that `registered` receivers are registered.

        A consumer that died or closed and was not replaced leaves its seat empty:
        later sends are not owed its release, so the sender keeps serving the others.
        Receivers not registered yet (start-up) leave no seat empty. Never below one.
        """
        present = min(registered, self.consumers)
        self._seated = max(self._seated, present)
        return max(1, self.consumers - (self._seated - present))

    def add(self, lease: Lease) -> None:
        """Track a send; owed receivers found gone while it was being written are credited."""
        if len(lease.owed_by) <= self.consumers:
            lease.released_by |= lease.owed_by & self._gone
        self._leases[lease.handle.seq] = lease
        key = id(lease.arena)
        self._held[key] = self._held.get(key, 0) + lease.nbytes

    def _forget(self, lease: Lease) -> None:
        del self._leases[lease.handle.seq]
        self._held[id(lease.arena)] -= lease.nbytes
        if lease.timed_out:
            self._late -= lease.nbytes
        if lease.open_by:
            self._open[id(lease.arena)] -= lease.nbytes

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def leaked_bytes(self) -> int:
        """Bytes of leases past their timeout."""
        return self._late

    def held_bytes(self, arena: SliceArena) -> int:
        """Bytes of arena's slices that leases hold."""
        return self._held.get(id(arena), 0)

    def open_bytes(self, arena: SliceArena) -> int:
        """Bytes of arena's slices that a live receiver holds open (as of the last sweep)."""
        return self._open.get(id(arena), 0)

    def _read(self, lease: Lease, lanes: list[LaneInfo], live_ids: set[Receiver]) -> None:
        """Read the receivers' cells of lease: who released it, who holds it open."""
        control = self._control
        seq, slot = lease.handle.seq, lease.handle.slot
        was_open = bool(lease.open_by)
        lease.open_by.clear()
        # A receiver that released just before it died still released: read every lane.
        for info in lanes:
            who = (info.lane, info.epoch)
            if who in lease.released_by:
                continue
            if control.released(slot, info.lane) == seq:
                lease.released_by.add(who)
            elif who in live_ids and control.leased(slot, info.lane) == seq:
                lease.open_by.add(who)
        if was_open != bool(lease.open_by):
            key = id(lease.arena)
            self._open[key] = self._open.get(key, 0) + (
                lease.nbytes if lease.open_by else -lease.nbytes
            )

    def _reclaim(self, lease: Lease, result: Sweep) -> None:
        # Before the bytes are reused: a reader that comes late sees its slot gone.
        self._control.invalidate(lease.handle.slot, lease.handle.seq)
        self._forget(lease)
        result.recycled.append(lease)

    def quick_sweep(self) -> Sweep:
        """Reclaim the oldest leases that may end, stopping after QUICK_SWEEP_MISSES in a
        row that may not (receivers that died and late leases wait for a full sweep)."""
        result = Sweep()
        lanes = self._control.lanes()
        # Registered counts as live here (no process lookups): one that died only waits
        # longer, for the full sweep that credits it.
        live_ids = {(i.lane, i.epoch) for i in lanes if i.state == LIVE}
        misses = 0
        for lease in list(self._leases.values()):
            self._read(lease, lanes, live_ids)
            if self._may_reuse(lease, live_ids):
                self._reclaim(lease, result)
                misses = 0
            else:
                misses += 1
                if misses >= QUICK_SWEEP_MISSES:
                    break
        return result

    def sweep(self, now: float | None = None) -> Sweep:
        """Read every receiver's cells; end the leases that may end; flag the late ones."""
        now = time.monotonic() if now is None else now
        control = self._control
        result = Sweep()
        lanes = control.lanes()
        live = [i for i in lanes if i.live]
        live_ids = {(i.lane, i.epoch) for i in live}
        gone = [i for i in lanes if (i.lane, i.epoch) not in live_ids]
        leases = list(self._leases.values())
        for lease in leases:
            self._read(lease, lanes, live_ids)
        for info in gone:
            who = (info.lane, info.epoch)
            credited = 0
            for lease in leases:
                if who in lease.released_by:
                    continue
                seq, slot = lease.handle.seq, lease.handle.slot
                opened = control.leased(slot, info.lane) == seq
                owed = who in lease.owed_by and len(lease.owed_by) <= self.consumers
                if opened or owed:
                    lease.released_by.add(who)
                    credited += 1
            control.free_lane(info.lane, info.epoch)
            self._gone.add(who)
            self.lost_receivers += 1
            result.lost.append((info, credited))
        for lease in leases:
            if self._may_reuse(lease, live_ids):
                self._reclaim(lease, result)
            elif not lease.timed_out and now - lease.sent_at > self.timeout_s:
                lease.timed_out = True
                self._late += lease.nbytes
                result.timed_out.append(lease)
        return result

    def _may_reuse(self, lease: Lease, live: set[Receiver]) -> bool:
        """Enough releases, nobody reading, and no known consumer still to come."""
        if len(lease.released_by) < lease.needed or lease.open_by:
            return False
        if len(lease.owed_by) > self.consumers:
            return True  # which of them are its consumers is unknown: the count decides
        # Each receiver registered at send is a consumer: a live one that has not released
        # it yet will read it, even if a replacement of a dead one already did.
        return all(who in lease.released_by or who not in live for who in lease.owed_by)

    def owing(self, lease: Lease) -> list[LaneInfo]:
        """Registered receivers that have not released lease yet (for log lines)."""
        return [
            info
            for info in self._control.lanes()
            if (info.lane, info.epoch) not in lease.released_by
        ]

    def drop_all(self) -> list[Lease]:
        """Forget every lease (the sender is closing); return them."""
        leases = list(self._leases.values())
        self._leases.clear()
        self._held.clear()
        self._open.clear()
        self._late = 0
        return leases

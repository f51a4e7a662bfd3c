"""GreedyDual-Size-Frequency: victims by what their features cost to compute again."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final, final

from mmcache.core.entry import Entry

__all__ = ["CostPolicy"]

#: seconds per byte an uncosted entry is charged before the policy saw any cost: any
#: constant orders uncosted entries alike (by hits, aged by the clock); this one is
#: mmcache demo's model of a vision encoder (3 ms per 1,000 bf16 rows of 3,584).
FIRST_SECONDS_PER_BYTE: Final = 3e-3 / (1000 * 3584 * 2)
#: the heap is rebuilt from the live entries once it holds this many times as many items
COMPACT_FACTOR: Final = 2


@final
@dataclass(slots=True, eq=False)
class _Slot:
    """One entry's place in the order: its uses, its priority and that priority's heap item."""

    entry: Entry
    hits: int
    priority: float
    seq: int


@final
class CostPolicy:
    """GDSF: the victim has the lowest priority, clock + hits * cost seconds / bytes.

    hits counts the insertion and every touch since; a touch recomputes the priority at
    the current clock, and an eviction raises the clock to the victim's priority, so an
    entry that stops being used ages out whatever it cost. An entry's cost is
    entry.cost (put's cost=, get_or_compute's measure); one without a cost is charged at
    the mean seconds per byte of the costed entries this policy was given so far
    (FIRST_SECONDS_PER_BYTE before any), so uncosted entries alone are ordered least
    frequently used first, aged. Ties go to the least recently inserted or touched.

    A heap with lazy deletion: a touch pushes a new item and leaves the old one stale,
    so touch, insertion and eviction cost O(log n).
    """

    __slots__ = ("_clock", "_costed_bytes", "_costed_seconds", "_heap", "_seq", "_slots")

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self._clock = 0.0
        self._costed_seconds = 0.0
        self._costed_bytes = 0

    @property
    def clock(self) -> float:
        """The priority of the last victim: where the priorities of new entries start."""
        return self._clock

    def priority(self, key: Hashable) -> float:
        """key's current priority (KeyError if absent)."""
        return self._slots[key].priority

    def __setitem__(self, key: Hashable, entry: Entry, /) -> None:
        if entry.cost is not None:
            self._costed_seconds += entry.cost
            self._costed_bytes += entry.nbytes
        slot = _Slot(entry, 1, 0.0, 0)
        self._slots[key] = slot
        self._place(key, slot)

    def touch(self, key: Hashable, /) -> None:
        """A use: one more hit, and a priority from the current clock."""
        slot = self._slots[key]
        slot.hits += 1
        self._place(key, slot)

    def pop(self, key: Hashable, default: None, /) -> Entry | None:
        slot = self._slots.pop(key, None)
        return default if slot is None else slot.entry

    def evict(self) -> Entry:
        """Remove and return the entry of lowest priority; the clock rises to it."""
        key = self._live_top()
        if key is None:
            raise KeyError("evict() from an empty policy")
        priority, _, _ = heapq.heappop(self._heap)
        self._clock = priority
        return self._slots.pop(key).entry

    def next_victim(self) -> Entry | None:
        """The entry of lowest priority, left in place."""
        key = self._live_top()
        return None if key is None else self._slots[key].entry

    def peek(self, n: int, /) -> list[Entry]:
        """The next victim alone (a heap tells no further without popping), left in place."""
        victim = self.next_victim() if n > 0 else None
        return [] if victim is None else [victim]

    def __len__(self) -> int:
        return len(self._slots)

    def _place(self, key: Hashable, slot: _Slot) -> None:
        """Give slot a priority from the current clock and a heap item carrying it."""
        entry = slot.entry
        cost = entry.cost
        if cost is None:
            per_byte = (
                self._costed_seconds / self._costed_bytes
                if self._costed_bytes
                else FIRST_SECONDS_PER_BYTE
            )
        else:
            per_byte = cost / max(entry.nbytes, 1)
        slot.priority = self._clock + slot.hits * per_byte
        slot.seq = next(self._seq)
        heap = self._heap
        if len(heap) >= COMPACT_FACTOR * len(self._slots) + 64:
            # Stale items (touched or removed entries) would otherwise grow without bound.
            heap[:] = [(s.priority, s.seq, k) for k, s in self._slots.items() if s is not slot]
            heapq.heapify(heap)
        heapq.heappush(heap, (slot.priority, slot.seq, key))

    def _live_top(self) -> Hashable | None:
        """The key of the lowest live heap item (stale ones above it dropped), or None."""
        heap = self._heap
        slots = self._slots
        while heap:
            _, seq, key = heap[0]
            slot = slots.get(key)
            if slot is not None and slot.seq == seq:
                return key
            heapq.heappop(heap)
        return None

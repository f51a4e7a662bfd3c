"""Admission to the GPU tier: which host-tier hit deserves the room of which GPU entries.

TinyLFU's rule (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission
Policy", 2017; Caffeine's W-TinyLFU): keep an approximate count of recent uses of every key,
cached or not, in a count-min sketch of small counters, halved every so many uses so that
old popularity fades; admit a candidate only if it was used more often than the victim it
would displace. Under a skewed (Zipf) popularity the GPU tier then holds the most used
features, not the most recently used ones, and a feature used once does not push out one
used a hundred times.

The state counts a use where it costs nothing: a read bumps `Entry.hits` (a field, no
call); those uses are folded into the sketch when the state compares the entry with
another (a host hit that wants GPU room and the GPU entries it would displace).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final, final

from mmcache.core.entry import Entry, Member

__all__ = ["FrequencySketch", "TinyLfu"]

#: a counter's largest value (4-bit counters, as TinyLFU's and Caffeine's)
COUNTER_MAX: Final = 15
#: rows of the sketch: each key has one counter per row, its estimate is the smallest
DEPTH: Final = 4
#: uses counted between two halvings, per counter of a row (TinyLFU's sample size W = 10 C)
SAMPLES_PER_COUNTER: Final = 10
#: the widest row: a row's index is 24 bits of the key's mixed hash
MAX_WIDTH: Final = 1 << 24
_MASK64: Final = (1 << 64) - 1
# Odd multipliers (from SplitMix64 and Murmur3's finaliser), one per row.
_SEEDS: Final = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xFF51AFD7ED558CCD)
#: byte -> byte halved: the reset halves every counter by one bytes.translate
_HALVE: Final = bytes(v >> 1 for v in range(256))


@final
class FrequencySketch:
    """A count-min sketch of uses per key: DEPTH rows of width counters of 0..COUNTER_MAX.

    add() raises a key's smallest counters (conservative update, so a collision inflates
    an estimate less); estimate() is the smallest of its counters. Every
    SAMPLES_PER_COUNTER * width uses, every counter is halved (TinyLFU's reset), so an
    estimate follows recent popularity. A key's counters are found from hash(key) mixed
    by one multiplier per row; keys are any hashable.
    """

    __slots__ = ("_added", "_mask", "_reset_at", "_table", "width")

    def __init__(self, width: int = 1024) -> None:
        self._size(width)

    def _size(self, width: int) -> None:
        if width < 1 or width & (width - 1) or width > MAX_WIDTH:
            raise ValueError(
                f"the sketch's width must be a power of two to {MAX_WIDTH}, not {width}"
            )
        self.width = width
        self._mask = width - 1
        self._table = bytearray(width * DEPTH)
        self._added = 0
        self._reset_at = SAMPLES_PER_COUNTER * width

    def _slots(self, key: Hashable) -> tuple[int, int, int, int]:
        h = hash(key) & _MASK64
        width, mask = self.width, self._mask
        # The high bits of a multiplicative hash: well mixed even for small ints.
        return (
            ((h * _SEEDS[0]) & _MASK64) >> 40 & mask,
            width + (((h * _SEEDS[1]) & _MASK64) >> 40 & mask),
            2 * width + (((h * _SEEDS[2]) & _MASK64) >> 40 & mask),
            3 * width + (((h * _SEEDS[3]) & _MASK64) >> 40 & mask),
        )

    def estimate(self, key: Hashable) -> int:
        """How often key was used lately (never less than counted since the last halving)."""
        table = self._table
        a, b, c, d = self._slots(key)
        return min(table[a], table[b], table[c], table[d])

    def add(self, key: Hashable, uses: int = 1) -> int:
        """Count uses of key; returns its estimate after."""
        table = self._table
        slots = self._slots(key)
        low = min(table[i] for i in slots)
        new = min(low + uses, COUNTER_MAX)
        for i in slots:
            if table[i] < new:
                table[i] = new
        self._added += uses
        if self._added >= self._reset_at:
            self.halve()
            return new >> 1
        return new

    def halve(self) -> None:
        """Halve every counter and the count of uses since (TinyLFU's reset)."""
        self._table = bytearray(self._table.translate(_HALVE))
        self._added //= 2

    def grow(self, width: int) -> None:
        """Make the rows width counters wide (a power of two, larger than now); the counts
        start again."""
        if width > self.width:
            self._size(width)


@final
class TinyLfu:
    """The admission filter: a candidate is admitted over victims used less often than it.

    Uses are counted per key in a FrequencySketch: an entry's uses since it was last
    compared (Entry.hits, bumped by the reads) are folded in when it is compared, a group
    member's use is counted at once (a member has no entry of its own). The sketch grows
    with the number of keys cached (grow_for), so that its counters stay a few per key.
    """

    __slots__ = ("sketch",)

    def __init__(self, width: int = 1024) -> None:
        self.sketch = FrequencySketch(width)

    def frequency(self, found: Entry | Member) -> int:
        """found's uses lately, its uncounted ones folded in first."""
        sketch = self.sketch
        if isinstance(found, Member):
            return sketch.estimate(found.key)
        hits = found.hits
        if hits:
            found.hits = 0
            return sketch.add(found.key, hits)
        return sketch.estimate(found.key)

    def used(self, found: Entry | Member) -> int:
        """Count one use of found (a host hit); its uses lately, this one included."""
        if isinstance(found, Member):
            return self.sketch.add(found.key)
        found.hits += 1
        return self.frequency(found)

    def grow_for(self, keys: int) -> None:
        """Keep the sketch at least twice as wide as keys (cached keys), a power of two."""
        sketch = self.sketch
        if keys * 2 > sketch.width and sketch.width < MAX_WIDTH:
            sketch.grow(min(MAX_WIDTH, 1 << (keys * 2 - 1).bit_length()))

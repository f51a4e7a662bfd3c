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
#: lookups between two halvings, per entry of the GPU tier (TinyLFU's sample size W = 10 C)
SAMPLES_PER_ENTRY: Final = 20
#: the fewest GPU entries the sample size is reckoned for
MIN_ENTRIES: Final = 16
#: halvings at most at once, however long since the last (4: every counter is 0 after)
MAX_HALVINGS: Final = 4
#: the widest row: a row's index is 24 bits of the key's mixed hash
MAX_WIDTH: Final = 1 << 24
_MASK64: Final = (1 << 64) - 1
# Odd multipliers (from SplitMix64 and Murmur3's finaliser), one per row.
_S0: Final = 0x9E3779B97F4A7C15
_S1: Final = 0xBF58476D1CE4E5B9
_S2: Final = 0x94D049BB133111EB
_S3: Final = 0xFF51AFD7ED558CCD
#: byte -> byte halved: the reset halves every counter by one bytes.translate
_HALVE: Final = bytes(v >> 1 for v in range(256))


@final
class FrequencySketch:
    """A count-min sketch of uses per key: DEPTH rows of width counters of 0..COUNTER_MAX.

    add() raises a key's smallest counters (conservative update, so a collision inflates
    an estimate less); estimate() is the smallest of its counters; halve() halves them
    all (TinyLFU's reset, which its owner calls every so many uses), so that an estimate
    follows recent popularity. A key's counters are found from hash(key) mixed by one
    multiplier per row; keys are any hashable.
    """

    __slots__ = ("_mask", "_table", "epoch", "width")

    def __init__(self, width: int = 1024) -> None:
        #: halvings so far (a new width counts as MAX_HALVINGS + 1: every count is gone)
        self.epoch = 0
        self._size(width)

    def _size(self, width: int) -> None:
        if width < 1 or width & (width - 1) or width > MAX_WIDTH:
            raise ValueError(
                f"the sketch's width must be a power of two to {MAX_WIDTH}, not {width}"
            )
        self.width = width
        self._mask = width - 1
        self._table = bytearray(width * DEPTH)

    # Each key's counters: row r's at the top 24 bits of (hash(key) * seed r) mod 2**64,
    # masked to the width; a multiplicative hash's high bits are well mixed even for the
    # small ints of keys. Written out in each method: a key's read is one call, not two.

    def estimate(self, key: Hashable) -> int:
        """How often key was used lately (never less than counted since the last halving)."""
        h = hash(key) & _MASK64
        w, m, t = self.width, self._mask, self._table
        return min(
            t[((h * _S0) & _MASK64) >> 40 & m],
            t[w + (((h * _S1) & _MASK64) >> 40 & m)],
            t[2 * w + (((h * _S2) & _MASK64) >> 40 & m)],
            t[3 * w + (((h * _S3) & _MASK64) >> 40 & m)],
        )

    def add(self, key: Hashable, uses: int = 1) -> int:
        """Count uses of key (raising only its smallest counters); its estimate after."""
        h = hash(key) & _MASK64
        w, m, t = self.width, self._mask, self._table
        a = ((h * _S0) & _MASK64) >> 40 & m
        b = w + (((h * _S1) & _MASK64) >> 40 & m)
        c = 2 * w + (((h * _S2) & _MASK64) >> 40 & m)
        d = 3 * w + (((h * _S3) & _MASK64) >> 40 & m)
        new = min(t[a], t[b], t[c], t[d]) + uses
        if new > COUNTER_MAX:
            new = COUNTER_MAX
        if t[a] < new:
            t[a] = new
        if t[b] < new:
            t[b] = new
        if t[c] < new:
            t[c] = new
        if t[d] < new:
            t[d] = new
        return new

    def halve(self) -> None:
        """Halve every counter (TinyLFU's reset)."""
        self._table = bytearray(self._table.translate(_HALVE))
        self.epoch += 1

    def grow(self, width: int) -> None:
        """Make the rows width counters wide (a power of two, larger than now); the counts
        start again."""
        if width > self.width:
            self._size(width)
            self.epoch += MAX_HALVINGS + 1


@final
class TinyLfu:
    """The admission filter: a candidate is admitted over victims used less often than it.

    Uses are counted per key in a FrequencySketch: an entry's uses since it was last
    compared (Entry.hits, bumped by the reads) are folded in when it is compared, a group
    member's use is counted at once (a member has no entry of its own). keep_up(), before
    comparisons, halves the counts every SAMPLES_PER_ENTRY lookups per GPU entry and
    widens the sketch to twice the keys cached.
    """

    __slots__ = ("_aged_at", "sketch")

    def __init__(self, width: int = 1024) -> None:
        self.sketch = FrequencySketch(width)
        self._aged_at = 0  # the lookups counted when the counts were last halved

    def frequency(self, found: Entry | Member) -> int:
        """found's uses lately, its uncounted ones folded in first.

        An entry keeps the count it was last read at (Entry.frequency): read again, it is
        that count halved as often as the sketch was since, with no look-up (the sketch's
        own count is never less: other keys' uses may only raise its counters).
        """
        sketch = self.sketch
        if isinstance(found, Member):
            return sketch.estimate(found.key)
        hits = found.hits
        if hits:
            found.hits = 0
            used = found.frequency = sketch.add(found.key, hits)
        elif found.frequency_epoch >= 0:
            return found.frequency >> (sketch.epoch - found.frequency_epoch)
        else:
            used = found.frequency = sketch.estimate(found.key)
        found.frequency_epoch = sketch.epoch
        return used

    def used(self, found: Entry | Member) -> int:
        """Count one use of found (a host hit); its uses lately, this one included."""
        sketch = self.sketch
        if isinstance(found, Member):
            return sketch.add(found.key)
        uses = found.hits + 1  # frequency() with a use more, inline: one call, not two
        found.hits = 0
        used = found.frequency = sketch.add(found.key, uses)
        found.frequency_epoch = sketch.epoch
        return used

    def keep_up(self, lookups: int, resident: int, keys: int) -> None:
        """Age and size the sketch: lookups so far (every get's, hits and misses), the
        entries of the GPU tier, the keys cached. Halved once per SAMPLES_PER_ENTRY
        lookups per GPU entry since the last time; twice as wide as keys at least."""
        sketch = self.sketch
        if keys * 2 > sketch.width and sketch.width < MAX_WIDTH:
            sketch.grow(min(MAX_WIDTH, 1 << (keys * 2 - 1).bit_length()))
        period = SAMPLES_PER_ENTRY * max(resident, MIN_ENTRIES)
        elapsed = lookups - self._aged_at
        if elapsed >= period:
            for _ in range(min(elapsed // period, MAX_HALVINGS)):
                sketch.halve()
            self._aged_at = lookups

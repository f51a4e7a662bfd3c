"""Entry: one cached feature, its state in the GPU -> host lifecycle, and what it holds."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from mmcache.device.base import Fence
from mmcache.errors import InvalidKeyError, InvalidRowsError
from mmcache.host_pool import HostBlock

__all__ = ["Entry", "GroupKey", "Member", "State", "check_key", "check_keys", "row_range"]


class State(enum.Enum):
    """Where an entry's bytes are."""

    GPU = "gpu"  # device tensor resident; `ready` is the producer's fence
    D2H = "d2h"  # being offloaded: device tensor alive until `copy_fence` completes
    HOST = "host"  # only the host block remains
    GONE = "gone"  # discarded, replaced or dropped; its memory is released after its fences


@dataclass(slots=True, eq=False)
class Entry:
    """A cached feature; the cache owns `tensor` (its own alias) and `block`."""

    key: Hashable
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    state: State
    tensor: torch.Tensor | None
    ready: Fence
    block: HostBlock | None = None
    copy_fence: Fence | None = None
    # Reader lists are made on first use: most entries never get one, and every object an
    # entry holds is one more for the cyclic garbage collector to walk while it lives.
    #: fences of copies that read the host block (uploads of host hits)
    host_readers: list[Fence] | None = None
    #: fences of copies that read the device tensor (downloads for host gets)
    device_readers: list[Fence] | None = None
    #: a group (put_many, put_split): the features whose rows it holds (None: one feature)
    members: list[Member] | None = None
    #: features the entry holds for the tier counters (a group's: its members still cached)
    count: int = 1

    def readers_pending(self) -> list[Fence]:
        """Fences of host-block readers still running (done ones are forgotten)."""
        return _pending(self.host_readers)

    def device_readers_pending(self) -> list[Fence]:
        """Fences of device-tensor readers still running (done ones are forgotten)."""
        return _pending(self.device_readers)

    def add_host_reader(self, fence: Fence) -> None:
        """Record a copy that reads the host block: it is freed only after it."""
        self.host_readers = [*self.readers_pending(), fence]

    def add_device_reader(self, fence: Fence) -> None:
        """Record a copy that reads the device tensor: it is released only after it."""
        self.device_readers = [*self.device_readers_pending(), fence]

    def host_view(self, start: int, stop: int, block: HostBlock | None = None) -> torch.Tensor:
        """Rows start..stop of the host copy (in block, default the entry's), typed and shaped."""
        block = block if block is not None else self.block
        assert block is not None
        row_bytes = self.nbytes // self.shape[0]
        raw = block.bytes(start * row_bytes, stop * row_bytes)
        return raw.view(self.dtype).view((stop - start, *self.shape[1:]))

    def host_whole(self, block: HostBlock | None = None) -> torch.Tensor:
        """The whole host copy (in block, default the entry's), typed and shaped."""
        block = block if block is not None else self.block
        assert block is not None
        return block.bytes(0, self.nbytes).view(self.dtype).view(self.shape)


class Member(tuple[Hashable, "Entry", int, int]):
    """A feature put by put_many or put_split: rows start..stop of its group's entry.

    A group is one entry for the tiers (one recency slot, one host block, one copy, one
    landing), so its features cost no bookkeeping of their own after put. A member that
    goes (discarded, replaced, promoted) leaves its rows charged until the last one goes.

    A tuple (key, group, start, stop): made without Python code per member, by the
    thousand a second. Compared by identity wherever the cache compares members.
    """

    __slots__ = ()

    @property
    def key(self) -> Hashable:
        return self[0]

    @property
    def group(self) -> Entry:
        return self[1]

    @property
    def start(self) -> int:
        return self[2]

    @property
    def stop(self) -> int:
        return self[3]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.group.shape[1:])

    @property
    def nbytes(self) -> int:
        group = self.group
        return group.nbytes // group.shape[0] * (self.stop - self.start)

    def span(self, rows: tuple[int, int] | None) -> tuple[int, int]:
        """Rows of the group for rows (relative to this member; None: all of it)."""
        if rows is None:
            return self.start, self.stop
        return self.start + rows[0], self.start + rows[1]


@dataclass(slots=True, eq=False, repr=False)
class GroupKey:
    """A group's key in the tiers' recency order: never equal to a user's key."""

    first: Hashable
    size: int

    def __repr__(self) -> str:
        return f"<group of {self.size} from {self.first!r}>"


def _pending(fences: list[Fence] | None) -> list[Fence]:
    return [f for f in fences if not f.done()] if fences else []


_KEY_TYPES = (str, bytes, int)
_PLAIN_KEY_TYPES = frozenset(_KEY_TYPES)
_PLAIN_OR_TUPLE = _PLAIN_KEY_TYPES | {tuple}
_TUPLE_ONLY = {tuple}


def check_key(key: object) -> None:
    """Accept str, bytes, int and (nested) tuples of these; refuse anything else clearly."""
    # Exact types first: put_many checks every key of a batch, thousands a second.
    cls = key.__class__
    if cls in _PLAIN_KEY_TYPES:
        return
    if isinstance(key, _KEY_TYPES):
        return
    if isinstance(key, tuple):
        for part in key:
            if part.__class__ not in _PLAIN_KEY_TYPES:
                check_key(part)
        return
    raise InvalidKeyError(
        f"cache keys must be str, bytes, int or tuples of these, not {type(key).__name__} "
        f"({key!r:.60}); hash the source with mmcache.keys.feature_key(...) for content keys"
    )


def check_keys(keys: list[object]) -> None:
    """check_key for each of keys: a batch of plain or flat tuple keys costs no Python per key."""
    classes = set(map(type, keys))
    if classes <= _PLAIN_KEY_TYPES:
        return
    if classes <= _PLAIN_OR_TUPLE:
        tuples = keys if classes == _TUPLE_ONLY else [k for k in keys if type(k) is tuple]
        if set(map(type, itertools.chain.from_iterable(tuples))) <= _PLAIN_KEY_TYPES:  # type: ignore[arg-type]
            return
    for key in keys:  # nested tuples, subclasses, or a bad key (which raises, named)
        check_key(key)


def row_range(rows: slice | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """Validate rows against shape; None means the whole tensor."""
    if rows is None:
        return None
    if not isinstance(rows, slice):
        raise InvalidRowsError(f"rows must be a slice, not {type(rows).__name__}")
    if not shape:
        raise InvalidRowsError("rows= needs a tensor with at least one dimension")
    if rows.step not in (None, 1):
        raise InvalidRowsError(f"rows must be contiguous (step 1), got step {rows.step}")
    n = shape[0]
    start = 0 if rows.start is None else rows.start
    stop = n if rows.stop is None else rows.stop
    if not isinstance(start, int) or not isinstance(stop, int):
        raise InvalidRowsError(f"rows bounds must be integers, got {rows!r}")
    if start < 0:
        start += n
    if stop < 0:
        stop += n
    if not 0 <= start <= stop <= n:
        raise InvalidRowsError(f"rows {rows.start}:{rows.stop} out of range for {n} rows")
    return start, stop

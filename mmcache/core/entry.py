"""Entry: one cached feature, its state in the GPU -> host lifecycle, and what it holds."""

from __future__ import annotations

import enum
import itertools
import reprlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

from mmcache.device.base import Fence, Stream
from mmcache.errors import InvalidKeyError, InvalidRowsError
from mmcache.host_pool import HostBlock

__all__ = ["Entry", "GroupKey", "Member", "State", "check_key", "check_keys", "row_range"]


class State(enum.Enum):
    """Where an entry's bytes are."""

    # device tensor resident; `ready` is the producer's fence. A GPU entry promoted from
    # the host tier keeps its host block too (the tiers are inclusive): leaving the GPU
    # tier again (demote) then costs no copy.
    GPU = "gpu"
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
    #: streams that queued copies reading the host block without a fence of their own
    #: (uploads on the reader's stream): a fence recorded on each at the block's free
    #: comes after them
    host_streams: list[Stream] | None = None
    #: fences of copies that read the device tensor (downloads for host gets)
    device_readers: list[Fence] | None = None
    #: a group (put_many, put_split): the features whose rows it holds (None: one feature)
    members: list[Member] | None = None
    #: features the entry holds for the tier counters (a group's: its members still cached)
    count: int = 1
    #: seconds to compute the feature again (put's cost=, get_or_compute's measure), for
    #: the cost eviction policy; None: not given
    cost: float | None = None
    #: uses not yet counted in the admission filter's sketch (core/admission.py): the one
    #: that made the entry (a miss, then its put), and the reads since, which bump it with
    #: no call; the state folds them in when it compares entries
    hits: int = 1
    #: the sketch's count of the key's uses when they were last folded in, and the
    #: sketch's epoch then (-1: never): read again with no call while the sketch has not
    #: changed them (halvings since are shifts)
    frequency: int = 0
    frequency_epoch: int = -1
    #: the stream the device tensor's block was last marked used on by a loop read
    #: (record_stream): once is enough, the allocator records its event at the block's
    #: free; None for a new tensor
    used_on: Stream | None = None

    # Every change of state, tensor, block, fences or members goes through one of the
    # methods below, which refuses a transition the lifecycle does not have: the parts
    # call them, and none assigns these fields itself.

    def begin_offload(self, block: HostBlock, fence: Fence) -> None:
        """GPU -> D2H: a copy of the device tensor into block was queued behind fence (an
        entry with a host copy already is demoted instead)."""
        if self.state is not State.GPU or self.block is not None:
            raise _illegal(self, "begin an offload (GPU -> D2H, no host copy yet)")
        self.state = State.D2H
        self.block = block
        self.copy_fence = fence

    def land(self, done: Fence) -> torch.Tensor:
        """D2H -> HOST: the copy landed good; returns the device tensor to release.

        done, a finished fence, stands in for the producer's and the copy's, so a host
        entry keeps no device event alive.
        """
        tensor = self.tensor
        if self.state is not State.D2H or tensor is None:
            raise _illegal(self, "land (D2H -> HOST)")
        self.state = State.HOST
        self.tensor = None
        self.copy_fence = self.ready = done
        return tensor

    def end_offload(self) -> torch.Tensor:
        """The device tensor of an offload that does not land (its copy failed, or the
        entry went meanwhile), to release; the entry's state is left as it is."""
        tensor = self.tensor
        if tensor is None or (self.state is not State.D2H and self.state is not State.GONE):
            raise _illegal(self, "end an offload that does not land")
        self.tensor = None
        return tensor

    def promote(self, tensor: torch.Tensor, ready: Fence) -> None:
        """HOST -> GPU: tensor (ready after ready) holds the feature again; the entry keeps
        its host block (and the copy_fence that block was written behind)."""
        if self.state is not State.HOST or self.block is None or self.tensor is not None:
            raise _illegal(self, "promote (HOST -> GPU, keeping its block)")
        # State last: a thread reading GPU hits without a lock (core/thread_hits.py) reads
        # state, then tensor, then ready, and may run between any two of these stores. Once
        # it sees GPU, the new tensor and its upload's fence are both in place; before, it
        # sees HOST and hands off (the other order served the new tensor with the old fence).
        self.ready = ready
        self.tensor = tensor
        self.used_on = None  # a new block: no stream has used it yet
        self.state = State.GPU

    def demote(self) -> torch.Tensor:
        """GPU -> HOST for an entry that kept its host copy: returns the device tensor to
        release (after its readers); no copy, the block already holds the bytes."""
        tensor = self.tensor
        copied = self.copy_fence
        if self.state is not State.GPU or self.block is None or tensor is None or copied is None:
            raise _illegal(self, "demote (GPU -> HOST, with a host copy)")
        self.state = State.HOST
        self.tensor = None
        self.ready = copied  # a host entry's ready stands for its host copy's
        return tensor

    def keep_copy(self, block: HostBlock, copied: Fence) -> None:
        """GPU, no host copy -> GPU with one: block holds the feature already, written
        behind copied (another rank's copy in the node's shared host tier); demote next."""
        if self.state is not State.GPU or self.block is not None or self.members is not None:
            raise _illegal(self, "keep a host copy written elsewhere")
        self.block = block
        self.copy_fence = copied

    def move_block(self, block: HostBlock) -> HostBlock:
        """HOST: its bytes are in block from now on (the same feature's, written by another
        rank of the node); returns the block it held, to free."""
        old = self.block
        if self.state is not State.HOST or old is None or self.host_readers or self.host_streams:
            raise _illegal(self, "move to another host block")
        self.block = block
        return old

    def discard(self) -> torch.Tensor | None:
        """GPU, D2H or HOST -> GONE; returns a GPU entry's device tensor, to release.

        A D2H entry keeps its tensor: the copy may still read it, and its landing
        releases it (end_offload).
        """
        state = self.state
        if state is State.GONE:
            raise _illegal(self, "discard (-> GONE)")
        self.state = State.GONE
        if state is not State.GPU:
            return None
        tensor, self.tensor = self.tensor, None
        return tensor

    def take_block(self) -> HostBlock | None:
        """The entry's host block, if any, to free; it holds none after."""
        if self.state is State.D2H:  # a copy is writing it
            raise _illegal(self, "give up its host block")
        block, self.block = self.block, None
        self.host_streams = None  # they read that block
        return block

    def add_members(self, members: list[Member]) -> None:
        """A new group's members, once (their count was given at construction)."""
        if self.members is not None or len(members) != self.count:
            raise _illegal(self, f"take {len(members)} members")
        self.members = members

    def member_left(self) -> None:
        """One of a group's members left the cache; its rows stay until the last goes."""
        if self.members is None or self.count <= 0:
            raise _illegal(self, "lose a member")
        self.count -= 1

    def drop_members(self) -> list[Member]:
        """A group's members, forgotten: members name their group, and without this the
        two would die only by the cyclic collector (whose pauses grow with its objects)."""
        members = self.members
        if members is None:
            raise _illegal(self, "drop its members")
        self.members = []
        return members

    def readers_pending(self) -> list[Fence]:
        """Fences of host-block readers still running (done ones are forgotten)."""
        return _pending(self.host_readers)

    def device_readers_pending(self) -> list[Fence]:
        """Fences of device-tensor readers still running (done ones are forgotten)."""
        return _pending(self.device_readers)

    def add_host_reader(self, fence: Fence) -> None:
        """Record a copy that reads the host block: it is freed only after it."""
        readers = self.host_readers
        if readers is None:
            self.host_readers = [fence]
        elif len(readers) < _READERS_KEPT:
            readers.append(fence)
        else:  # forget those done (asking each is a device call: not on every read)
            kept = [fence]
            for reader in readers:
                if not reader.done():
                    kept.append(reader)
            self.host_readers = kept

    @staticmethod
    def add_host_stream(entries: Iterable[Entry], stream: Stream) -> None:
        """Record on each of entries a stream that queued a copy reading its host block
        (once per stream): one call for a batch's entries."""
        for entry in entries:
            streams = entry.host_streams
            if streams is None:
                entry.host_streams = [stream]
            elif stream not in streams:
                streams.append(stream)

    def add_device_reader(self, fence: Fence) -> None:
        """Record a copy that reads the device tensor: it is released only after it."""
        self.device_readers = [*self.device_readers_pending(), fence]

    def host_bytes(self, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The flat bytes of the host copy, or of its rows start..stop (a copy's source)."""
        block = self.block
        assert block is not None
        if start is None or stop is None:
            return block.bytes(0, self.nbytes)
        row_bytes = self.nbytes // self.shape[0]
        return block.bytes(start * row_bytes, stop * row_bytes)

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


def _illegal(entry: Entry, change: str) -> AssertionError:
    """An internal error: entry cannot make change from where it is."""
    tensor = "held" if entry.tensor is not None else "none"
    block = "held" if entry.block is not None else "none"
    return AssertionError(
        f"mmcache internal error: entry {reprlib.repr(entry.key)} in state {entry.state.name} "
        f"(tensor {tensor}, block {block}, count {entry.count}) cannot {change}"
    )


#: reader fences an entry keeps before it forgets those done (add_host_reader)
_READERS_KEPT = 4


def _pending(fences: list[Fence] | None) -> list[Fence]:
    return [f for f in fences if not f.done()] if fences else []


_KEY_TYPES = (str, bytes, int)
_PLAIN_KEY_TYPES = frozenset(_KEY_TYPES)
_PLAIN_OR_TUPLE = _PLAIN_KEY_TYPES | {tuple}
_TUPLE_ONLY = {tuple}

#: Deepest nesting of tuples in a key (a flat tuple is depth 1).
MAX_KEY_DEPTH = 32
#: Largest key: the characters, bytes and int bytes of its parts, plus one per tuple item.
MAX_KEY_SIZE = 1024 * 1024


def check_key(key: object) -> None:
    """Accept str, bytes, int and (nested) tuples of these within the size and depth bounds;
    refuse anything else clearly."""
    # Exact types first: put_many checks every key of a batch, thousands a second.
    cls = key.__class__
    # _plain_size inline for the commonest keys: they cost one call, this one.
    if cls is str:
        if len(key) > MAX_KEY_SIZE:  # type: ignore[arg-type]
            raise _too_large(key)
        return
    if cls is int:
        if key.bit_length() >= MAX_KEY_SIZE * 8:  # type: ignore[attr-defined]
            raise _too_large(key)
        return
    if cls in _PLAIN_KEY_TYPES or isinstance(key, _KEY_TYPES):
        if _plain_size(key) > MAX_KEY_SIZE:  # type: ignore[arg-type]
            raise _too_large(key)
        return
    if not isinstance(key, tuple):
        raise _bad_part(key)
    # Iterative, not recursive: a key nested thousands deep is refused, not a RecursionError
    # (hashing it would recurse in C first).
    size = 0
    stack: list[tuple[tuple[object, ...], int]] = [(key, 1)]
    while stack:
        parts, depth = stack.pop()
        if depth > MAX_KEY_DEPTH:
            raise InvalidKeyError(
                f"cache keys nest tuples at most {MAX_KEY_DEPTH} deep; this one nests deeper: "
                "flatten it, or hash it with mmcache.keys.feature_key(...)"
            )
        size += len(parts)
        for part in parts:
            if part.__class__ in _PLAIN_KEY_TYPES or isinstance(part, _KEY_TYPES):
                size += _plain_size(part)  # type: ignore[arg-type]
            elif isinstance(part, tuple):
                stack.append((part, depth + 1))
            else:
                raise _bad_part(part)
        if size > MAX_KEY_SIZE:
            raise _too_large(key)


def _plain_size(key: str | bytes | int) -> int:
    """A plain key's size: its characters or bytes, or an int's bytes."""
    if isinstance(key, int):
        return key.bit_length() // 8 + 1
    return len(key)


def _too_large(key: object) -> InvalidKeyError:
    return InvalidKeyError(
        f"a {type(key).__name__} key larger than {MAX_KEY_SIZE} characters or bytes (parts "
        "and tuple items counted) is refused; hash it with mmcache.keys.feature_key(...)"
    )


def _bad_part(part: object) -> InvalidKeyError:
    return InvalidKeyError(
        f"cache keys must be str, bytes, int or tuples of these, not {type(part).__name__} "
        f"({reprlib.repr(part)}); hash the source with mmcache.keys.feature_key(...) for "
        "content keys"
    )


def key_list(keys: Iterable[Hashable], caller: str) -> list[Hashable]:
    """keys as a checked list (one str or bytes is refused: it would iterate characters)."""
    if isinstance(keys, (str, bytes)):
        raise InvalidKeyError(
            f"{caller} takes a list of keys, not one str or bytes key; use get() for one"
        )
    batch = list(keys)
    check_keys(batch)
    return batch


def check_keys(keys: list[object]) -> None:
    """check_key for each of keys: a batch of plain or flat tuple keys costs no Python per key."""
    if len(keys) <= 16:  # a request's few keys: one loop, no list built
        for key in keys:
            cls = key.__class__
            if not (
                (cls is str and len(key) <= MAX_KEY_SIZE)  # type: ignore[arg-type]
                or (cls is int and key.bit_length() < MAX_KEY_SIZE * 8)  # type: ignore[attr-defined]
            ):
                break
        else:
            return
    classes = set(map(type, keys))
    if classes <= _PLAIN_OR_TUPLE:
        tuples: list[tuple[object, ...]] = (
            [k for k in keys if type(k) is tuple] if tuple in classes else []
        )
        plain = [k for k in keys if type(k) is not tuple] if classes != _TUPLE_ONLY else []
        parts = list(itertools.chain.from_iterable(tuples))
        if (
            set(map(type, parts)) <= _PLAIN_KEY_TYPES
            and _largest(plain) <= MAX_KEY_SIZE
            # A flat tuple's size is at most its length times one more than its largest part.
            and (not tuples or max(map(len, tuples)) * (1 + _largest(parts)) <= MAX_KEY_SIZE)
        ):
            return
    for key in keys:  # nested tuples, subclasses, large keys, or a bad key (which raises, named)
        check_key(key)


def _largest(values: list[object]) -> int:
    """The largest _plain_size among values, all of exact type str, bytes or int."""
    sized = [len(v) for v in values if type(v) is not int]  # type: ignore[arg-type]
    ints = [v for v in values if type(v) is int]
    bits = max(map(int.bit_length, ints), default=-8)
    return max(max(sized, default=0), bits // 8 + 1)


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

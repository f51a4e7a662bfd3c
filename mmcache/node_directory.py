"""NodeDirectory: the blocks of one node's shared host arena, kept in shared memory.

The ranks of a node (host_share="node") share one host arena, a file in /dev/shm that each
maps. This directory, a second file beside it, says which bytes of the arena are taken and
by whom: one record per block, each with its offset, its size, the ranks that hold it (a
bitmask of group ranks), and, once its bytes are written, a digest of the feature it holds
(shared: other ranks may take a reference instead of copying the feature again). A block
whose bytes are still being written is private to the rank that writes them.

Every change happens under one cross-process lock, a POSIX record lock on the directory's
first byte, which the kernel drops when its holder dies. Each attached rank also holds a
lock on a byte of its own for as long as it lives: a rank whose byte can be locked is dead,
and the survivors release its references (sweep()). Those locks are the process's, not a
thread's (a second thread's lockf succeeds at once, and its unlock drops the first's), so
each file also has a threading.Lock that every lockf and close of it in this process holds.

A rank may die (SIGKILL) at any point of a change, and the kernel then hands the lock to
the next rank as the dead one left the table: so every change takes effect by one 8-byte
store, and what is written before it is invisible until then. A record is a block while its
holders mask is not 0: a record is written in a free slot first and made a block by storing
its holders, a block is freed by storing 0 there, and a rank's reference is one bit of it.
The records are in no order (a block's search and the free ranges sort them), and slots
past the count of slots in use are free: a record written there counts once the count is
stored. A block is shared once its SHARED cell is stored, after its digest.

Layout (int64 cells): a header of HEADER_CELLS (magic, version, the arena's bytes, the
table's capacity, the slots in use, a cell no longer used, then each rank's pid, 0 where
no rank is attached), then the records, RECORD cells each.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, final

import torch

from mmcache.ipc.shm import reserve

__all__ = ["MAX_RANKS", "DetachedError", "NodeDirectory", "NodeUsage", "records_for"]


class DetachedError(RuntimeError):
    """The rank has left the node's directory (its cache closed)."""


MAX_RANKS: Final = 64  # one bit of an int64 per rank
_MAGIC: Final = 0x6D6D6E6F6465  # "mmnode"
_VERSION: Final = 2  # 2: records in any order, free where no rank holds them
HEADER_CELLS: Final = 128
# header cells
_H_MAGIC, _H_VERSION, _H_ARENA, _H_CAPACITY, _H_COUNT = range(5)
_H_PIDS: Final = 8
# record cells
RECORD: Final = 6
OFFSET, NBYTES, HOLDERS, DIGEST_A, DIGEST_B, SHARED = range(RECORD)
_MUTEX: Final = 0  # the directory's lock: its first byte
_FILE_MODE: Final = 0o600


def _liveness_byte(rank: int) -> int:
    return 1 + rank


def _bit(rank: int) -> int:
    """rank's bit in a holders mask (as a signed int64: rank 63 is the sign bit)."""
    return -(1 << 63) if rank == 63 else 1 << rank


@final
@dataclass(frozen=True, slots=True)
class NodeUsage:
    """What the node's arena holds: blocks and bytes in all (each once, whoever holds
    them), of which shared (written and findable), and the ranks attached."""

    blocks: int
    used_bytes: int
    shared_blocks: int
    arena_bytes: int
    ranks: tuple[int, ...]


def records_for(capacity_bytes: int) -> int:
    """Records a directory keeps for an arena of capacity_bytes: one per 16 KiB, at least
    4,096 (an arena of small features runs out of records before it runs out of bytes)."""
    return max(4096, capacity_bytes // (16 << 10))


@final
class NodeDirectory:
    """One rank's handle on its node's directory: open() it, detach() when done."""

    __slots__ = ("_cells", "_fd", "_head", "_mapping", "_table", "_thread_lock", "path", "rank")

    def __init__(
        self, path: str, fd: int, mapping: mmap.mmap, rank: int, thread_lock: threading.Lock
    ) -> None:
        self.path = path
        self.rank = rank
        self._fd = fd
        self._thread_lock = thread_lock
        self._mapping: mmap.mmap | None = mapping
        self._cells = torch.frombuffer(mapping, dtype=torch.int64)
        self._head = self._cells[:HEADER_CELLS]
        capacity = int(self._head[_H_CAPACITY])
        self._table = self._cells[HEADER_CELLS : HEADER_CELLS + capacity * RECORD].view(
            capacity, RECORD
        )

    # --- attaching -------------------------------------------------------------------

    @classmethod
    def open(
        cls, path: str, rank: int, arena_bytes: int, capacity: int, on_create: Callable[[], None]
    ) -> NodeDirectory:
        """Attach rank to the directory at path, creating it (and calling on_create, under
        the lock, to make the arena) where it is missing or no attached rank lives."""
        if not 0 <= rank < MAX_RANKS:
            raise ValueError(f"a node's shared host tier takes ranks 0..{MAX_RANKS - 1}")
        size = (HEADER_CELLS + capacity * RECORD) * 8
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
            try:
                _check_own_file(fd, path)
                thread_lock = _thread_lock_of(fd)
            except BaseException:
                os.close(fd)
                raise
            with thread_lock:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX, 1, _MUTEX)
                    if not _still_named(fd, path):  # a sweeper unlinked it meanwhile: again
                        os.close(fd)
                        continue
                    mapping = _attach_or_create(
                        fd, path, size, arena_bytes, capacity, rank, on_create
                    )
                    directory = cls(path, fd, mapping, rank, thread_lock)
                    directory._head[_H_PIDS + rank] = os.getpid()
                    fcntl.lockf(fd, fcntl.LOCK_EX, 1, _liveness_byte(rank))
                    directory._sweep_locked()
                    fcntl.lockf(fd, fcntl.LOCK_UN, 1, _MUTEX)
                    return directory
                except BaseException:
                    os.close(fd)  # drops every lock of ours on it
                    raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:  # first: this process's other threads wait here
            if self._fd < 0:
                raise DetachedError("the node's directory is detached")
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _MUTEX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _MUTEX)

    # --- blocks --------------------------------------------------------------------------

    def carve(self, sizes: list[int]) -> int | None:
        """A run of blocks of sizes, back to back in the smallest free range that takes them
        all, private to this rank; its offset, or None if no free range (or record) is left."""
        total = sum(sizes)
        with self._locked():
            count = int(self._head[_H_COUNT])
            rows = self._table[:count]
            free_slots = torch.nonzero(rows[:, HOLDERS] == 0).flatten()
            spare = int(free_slots.numel()) + self._table.shape[0] - count
            if spare < len(sizes):
                return None
            blocks = self._blocks(rows)
            arena = int(self._head[_H_ARENA])
            ends = blocks[:, OFFSET] + blocks[:, NBYTES]
            starts = torch.cat((torch.zeros(1, dtype=torch.int64), ends))
            stops = torch.cat((blocks[:, OFFSET], torch.tensor([arena])))
            gaps = stops - starts
            fitting = torch.where(gaps >= total, gaps, torch.iinfo(torch.int64).max)
            place = int(torch.argmin(fitting))  # the smallest that fits, the lowest among equals
            if int(gaps[place]) < total:
                return None
            start = int(starts[place])
            new = torch.zeros(len(sizes), RECORD, dtype=torch.int64)
            offset = start
            for i, size in enumerate(sizes):
                new[i, OFFSET] = offset
                new[i, NBYTES] = size
                offset += size
            new[:, HOLDERS] = _bit(self.rank)
            self._add(count, free_slots[: len(sizes)], new)
            return start

    def adopt(self, digest: tuple[int, int], nbytes: int) -> int | None:
        """Hold the node's written copy of a feature (by digest, of nbytes): its offset, or
        None where the node holds none."""
        with self._locked():
            place = self._find_shared(digest, nbytes)
            if place is None:
                return None
            self._table[place, HOLDERS] |= _bit(self.rank)  # one store: held
            return int(self._table[place, OFFSET])

    def publish(self, offset: int, digest: tuple[int, int]) -> int | None:
        """This rank's private block at offset now holds the feature of digest, written: it
        is shared from now on, or, where the node holds that feature already, this rank holds
        that copy too and the offset of it is returned (free the block at offset then)."""
        with self._locked():
            place = self._at(offset)
            nbytes = int(self._table[place, NBYTES])
            other = self._find_shared(digest, nbytes)
            if other is not None:
                self._table[other, HOLDERS] |= _bit(self.rank)
                return int(self._table[other, OFFSET])
            record = self._table[place]
            record[DIGEST_A], record[DIGEST_B] = digest
            record[SHARED] = 1  # the store that shares it, its digest written
            return None

    def release(self, offset: int, last: Callable[[int, int], None] | None = None) -> bool:
        """This rank no longer holds the block at offset; where no rank does, it is free
        again (last(offset, nbytes) is called first, under the lock). Whether it is free."""
        with self._locked():
            place = self._at(offset)
            holders = int(self._table[place, HOLDERS]) & ~_bit(self.rank)
            if holders:
                self._table[place, HOLDERS] = holders
                return False
            if last is not None:
                last(offset, int(self._table[place, NBYTES]))
            self._table[place, HOLDERS] = 0  # one store: free
            return True

    def sweep(self) -> int:
        """Release the references of ranks that died attached; the blocks freed."""
        with self._locked():
            return self._sweep_locked()

    def detach(self, on_last: Callable[[], None] = lambda: None) -> bool:
        """Release every reference of this rank and leave; whether a live rank stays
        attached (if not, on_last is called first, under the lock, to remove the files)."""
        with self._thread_lock:
            if self._mapping is None:
                return True
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _MUTEX)
                self._sweep_locked()
                self._drop_rank(self.rank)
                self._head[_H_PIDS + self.rank] = 0
                others = any(int(pid) for pid in self._head[_H_PIDS : _H_PIDS + MAX_RANKS])
                if not others:
                    # Under the lock: a rank waiting for it finds the files unlinked and
                    # makes new ones, never attaches to files about to be removed.
                    on_last()
            finally:
                self._close()  # closing the file drops our locks on it
        return others

    # --- reading -------------------------------------------------------------------------

    def usage(self) -> NodeUsage:
        """The node's blocks and bytes, each once."""
        with self._locked():
            blocks = self._blocks(self._table[: int(self._head[_H_COUNT])])
            pids = self._head[_H_PIDS : _H_PIDS + MAX_RANKS]
            return NodeUsage(
                blocks=int(blocks.shape[0]),
                used_bytes=int(blocks[:, NBYTES].sum()),
                shared_blocks=int(blocks[:, SHARED].sum()),
                arena_bytes=int(self._head[_H_ARENA]),
                ranks=tuple(int(r) for r in torch.nonzero(pids).flatten()),
            )

    def records(self) -> list[tuple[int, int, int, tuple[int, int], bool]]:
        """Every block as (offset, nbytes, holders mask, digest, shared), in arena order."""
        with self._locked():
            blocks = self._blocks(self._table[: int(self._head[_H_COUNT])])
            return [
                (r[OFFSET], r[NBYTES], r[HOLDERS], (r[DIGEST_A], r[DIGEST_B]), bool(r[SHARED]))
                for r in blocks.tolist()
            ]

    # --- internals (under the lock) ------------------------------------------------------

    @staticmethod
    def _blocks(rows: torch.Tensor) -> torch.Tensor:
        """The records of rows that are blocks (some rank holds them), in arena order."""
        blocks = rows[rows[:, HOLDERS] != 0]
        return blocks[torch.argsort(blocks[:, OFFSET])]

    def _find_shared(self, digest: tuple[int, int], nbytes: int) -> int | None:
        count = int(self._head[_H_COUNT])
        rows = self._table[:count]
        found = torch.nonzero(
            (rows[:, DIGEST_A] == digest[0])
            & (rows[:, DIGEST_B] == digest[1])
            & (rows[:, SHARED] == 1)
            & (rows[:, NBYTES] == nbytes)
            & (rows[:, HOLDERS] != 0)
        )
        return int(found[0, 0]) if found.numel() else None

    def _at(self, offset: int) -> int:
        """The slot of the block at offset."""
        count = int(self._head[_H_COUNT])
        rows = self._table[:count]
        found = torch.nonzero((rows[:, OFFSET] == offset) & (rows[:, HOLDERS] != 0))
        if not found.numel():
            raise AssertionError(f"mmcache internal error: no node host block at {offset}")
        return int(found[0, 0])

    def _add(self, count: int, free_slots: torch.Tensor, new: torch.Tensor) -> None:
        """Make the records new blocks: in free slots below count first, then past it. Each
        takes effect by one store (its holders, or the count), nothing before it seen."""
        table = self._table
        reused = int(free_slots.numel())
        if reused:
            # Every cell but the holders first: those stores are each a block's birth.
            rest = [c for c in range(RECORD) if c != HOLDERS]
            table[free_slots[:, None], torch.tensor(rest)] = new[:reused][:, rest]
            table[free_slots, HOLDERS] = new[:reused, HOLDERS]
        more = new.shape[0] - reused
        if more:
            try:
                table[count : count + more] = new[reused:]  # free slots past the count: unseen
                self._head[_H_COUNT] = count + more  # one store: they are blocks
            except BaseException:  # raised, not killed: the whole run or none of it
                if reused:
                    table[free_slots, HOLDERS] = 0
                raise

    def _drop_rank(self, rank: int) -> int:
        """Clear rank's bit in every record (each a store of its own: stopped midway, the
        rest is cleared when done again); the blocks no rank holds any more are free."""
        count = int(self._head[_H_COUNT])
        rows = self._table[:count]
        held = rows[:, HOLDERS] != 0
        rows[:, HOLDERS] &= ~_bit(rank)
        return int((held & (rows[:, HOLDERS] == 0)).sum())

    def _sweep_locked(self) -> int:
        freed = 0
        me = os.getpid()
        for rank in range(MAX_RANKS):
            pid = int(self._head[_H_PIDS + rank])
            if rank == self.rank or pid == 0 or pid == me:
                continue  # a process cannot test its own locks (they are its own)
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _liveness_byte(rank))
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    continue  # it lives
                raise
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _liveness_byte(rank))
            freed += self._drop_rank(rank)
            self._head[_H_PIDS + rank] = 0
        return freed

    def _close(self) -> None:
        self._table = self._head = self._cells = torch.empty(0, dtype=torch.int64)
        self._mapping = None  # unmapped once no view of it is left
        if self._fd >= 0:
            os.close(self._fd)  # drops our locks, the liveness one with them
            self._fd = -1


#: the threading.Lock of each directory file this process has opened, by (device, inode)
_THREAD_LOCKS: dict[tuple[int, int], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _thread_lock_of(fd: int) -> threading.Lock:
    info = os.fstat(fd)
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault((info.st_dev, info.st_ino), threading.Lock())


def _check_own_file(fd: int, path: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a file of this user: refusing to share it")


def _still_named(fd: int, path: str) -> bool:
    """Whether path still names the file fd has open (not unlinked or replaced)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    info = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (info.st_dev, info.st_ino)


def _attach_or_create(
    fd: int,
    path: str,
    size: int,
    arena_bytes: int,
    capacity: int,
    rank: int,
    on_create: Callable[[], None],
) -> mmap.mmap:
    """The directory's mapping (under its lock): as it is, or made anew where it is empty,
    of another layout, or left by ranks that all died. Where it cannot be made (a full
    /dev/shm), its file is removed: a rank waiting for the lock tries anew."""
    current = os.fstat(fd).st_size
    if current >= HEADER_CELLS * 8:
        mapping = mmap.mmap(fd, current)
        head = torch.frombuffer(mapping, dtype=torch.int64, count=HEADER_CELLS)
        version = int(head[_H_VERSION])
        alive = int(head[_H_MAGIC]) == _MAGIC and _any_rank_alive(fd, head, rank)
        del head
        if alive and version == _VERSION:
            return mapping
        mapping.close()
        if alive:  # ranks of another mmcache use it: never wipe what they hold
            raise RuntimeError(
                f"{path} is a node host tier of layout {version} (this mmcache writes layout "
                f"{_VERSION}), in use by live ranks: run one mmcache version on a node, or "
                "give this cache another name"
            )
    os.ftruncate(fd, 0)  # zeroes whatever a dead node left
    try:
        os.ftruncate(fd, size)
        reserve(fd, 0, size, path, "lower cpu_cache_mb")
        on_create()
    except BaseException:
        os.unlink(path)
        os.ftruncate(fd, 0)
        raise
    mapping = mmap.mmap(fd, size)
    head = torch.frombuffer(mapping, dtype=torch.int64, count=HEADER_CELLS)
    head[_H_MAGIC] = _MAGIC
    head[_H_VERSION] = _VERSION
    head[_H_ARENA] = arena_bytes
    head[_H_CAPACITY] = capacity
    del head
    return mapping


def _any_rank_alive(fd: int, head: torch.Tensor, rank: int) -> bool:
    me = os.getpid()
    for other in range(MAX_RANKS):
        pid = int(head[_H_PIDS + other])
        if pid == 0:
            continue
        if pid == me and other != rank:
            return True  # another cache of this process
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _liveness_byte(other))
        except OSError:
            return True
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _liveness_byte(other))
    return False

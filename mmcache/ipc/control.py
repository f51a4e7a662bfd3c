"""The control block: a small shared table of receiver lanes and slot cells, one writer per cell.

Layout (int64 cells): a header (with a digest of the sender's endpoint), then
one row per receiver lane (state, pid, epoch, peer), then one row per slot:
the sequence number of the send that holds it (sender), its ready mark
(sender's copy fence: seq, or -seq if the copy failed), the slice it
published (where, offset, length, and a digest of its dtype, shape and CUDA
event), and per lane the seq the receiver leased and the seq it released
(that receiver only). A receiver serves a handle only if every field matches
what the slot publishes for that seq. Sequence numbers are never reused, so a stale
cell never matches a live send, and a writer never needs a lock; only lane
registration takes one (flock on the segment: the kernel drops it if the
holder dies).

Cells are aligned 8-byte stores, never torn. A reader that sees a ready mark
then reads the bytes it guards, and a reader that finds its slot's seq
unchanged after reading knows they were not reused meanwhile: this relies on
stores becoming visible in program order and loads not passing loads (x86-64
TSO, where CI and the simulator run). On CUDA the ready signal a receiver
waits on is the slot's IPC event, ordered by the GPU, not this cell.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Final, final

from mmcache.ipc.errors import InvalidHandleError, TooManyReceiversError
from mmcache.ipc.shm import SharedSegment

__all__ = [
    "FREE",
    "GONE",
    "LIVE",
    "MAX_ROWS",
    "WHERE_CODES",
    "ControlBlock",
    "LaneInfo",
    "process_alive",
]

MAGIC: Final = 0x6D6D636163686531  # "mmcache1"
VERSION: Final = 2
FREE: Final = 0
LIVE: Final = 1
GONE: Final = 2  # the receiver closed: the sender reclaims what it owed, then frees the lane

_HEADER: Final = 8
_H_MAGIC, _H_VERSION, _H_PID, _H_LANES, _H_SLOTS, _H_CLOSED, _H_ENDPOINT = range(7)
_LANE: Final = 4
_L_STATE, _L_PID, _L_EPOCH, _L_PEER = range(4)
_SLOT_FIXED: Final = 6
_S_SEQ, _S_READY, _S_WHERE, _S_OFFSET, _S_NBYTES, _S_DIGEST = range(6)
#: Lanes or slots of a control block at most (far above any real sender's).
MAX_ROWS: Final = 1 << 20
#: How a slot records where its slice is.
WHERE_CODES: Final = {"pool": 1, "host": 2}


@final
@dataclass(frozen=True, slots=True)
class LaneInfo:
    """One receiver lane as the sender sees it."""

    lane: int
    state: int
    pid: int
    epoch: int
    peer_ok: bool

    @property
    def live(self) -> bool:
        """Registered and its process still running."""
        return self.state == LIVE and process_alive(self.pid)


def process_alive(pid: int) -> bool:
    """True while process pid runs (a zombie counts as dead)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs: kill(0) is all we know
    # The state letter follows the command name, which is in parentheses and may hold spaces.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


@final
class ControlBlock:
    """The shared control table of one sender, mapped by the sender and every receiver."""

    __slots__ = ("_c", "_lanes0", "_segment", "_slot_cells", "_slots0", "n_lanes", "n_slots")

    def __init__(self, segment: SharedSegment) -> None:
        """Take over segment (closed here if it is not a control block of this version)."""
        self._segment = segment
        try:
            c = segment.cells()
            if (
                len(c) < _HEADER
                or c[_H_MAGIC] != MAGIC
                or c[_H_VERSION] != VERSION
                or not 0 <= c[_H_LANES] <= MAX_ROWS
                or not 0 <= c[_H_SLOTS] <= MAX_ROWS
                or len(c) < _cells(c[_H_LANES], c[_H_SLOTS])
            ):
                raise InvalidHandleError(
                    f"{segment.path} is not an mmcache IPC control block of version {VERSION}: "
                    "run the same mmcache version in the sender and the receiver"
                )
        except BaseException:
            with contextlib.suppress(NameError):
                c.release()  # the mapping, and the descriptor it holds, go with the segment
            segment.close()
            raise
        self._c = c
        self.n_lanes = c[_H_LANES]
        self.n_slots = c[_H_SLOTS]
        self._lanes0 = _HEADER
        self._slots0 = _HEADER + _LANE * self.n_lanes
        self._slot_cells = _SLOT_FIXED + 2 * self.n_lanes

    @classmethod
    def create(cls, directory: str, n_lanes: int, n_slots: int) -> ControlBlock:
        """A new control block owned by this process (the sender), in its private directory."""
        cells = _cells(n_lanes, n_slots)
        segment = SharedSegment.create(directory, "control", cells * 8)
        try:
            segment.commit(0, cells * 8, "lower the number of IPC slots or receivers")
        except BaseException:
            # Nobody else holds it yet: its descriptor would stay open until exit.
            segment.unlink()
            segment.close()
            raise
        c = segment.cells()
        c[_H_PID] = os.getpid()
        c[_H_LANES] = n_lanes
        c[_H_SLOTS] = n_slots
        c[_H_VERSION] = VERSION
        c[_H_MAGIC] = MAGIC  # last: a reader that sees the magic sees the rest
        return cls(segment)

    @classmethod
    def attach(cls, path: str) -> ControlBlock:
        """Map the control block of a sender (a receiver does this once per sender).

        InvalidHandleError if path is not one (nothing stays open); FileNotFoundError
        if it is gone.
        """
        return cls(SharedSegment.attach(path, "control", writable=True))

    @property
    def path(self) -> str:
        return self._segment.path

    @property
    def sender_pid(self) -> int:
        return self._c[_H_PID]

    @property
    def closed(self) -> bool:
        """True once the sender closed: nothing will become ready any more."""
        return self._c[_H_CLOSED] != 0

    @property
    def endpoint_digest(self) -> int:
        """The digest of the endpoint the sender published (0 before it has)."""
        return self._c[_H_ENDPOINT]

    def publish_endpoint(self, digest: int) -> None:
        """Publish the digest of the sender's endpoint (sender only, once)."""
        self._c[_H_ENDPOINT] = digest

    def sender_alive(self) -> bool:
        """True while the sender is open and its process runs."""
        return not self.closed and process_alive(self.sender_pid)

    def close(self, unlink: bool) -> None:
        """Close the file (and, for the sender, mark the block closed and unlink it).

        The mapping stays until this object is gone: a receiver's late release lands
        harmlessly in memory nobody reads any more.
        """
        if unlink:
            self._c[_H_CLOSED] = 1
            for slot in range(self.n_slots):
                self._c[self._slot(slot) + _S_SEQ] = 0  # any reader mid-way sees its slice gone
            self._segment.unlink()
        self._segment.close()

    # --- lanes ------------------------------------------------------------------------

    def register(self, pid: int, peer_ok: bool) -> tuple[int, int]:
        """Take a free lane for a receiver: return (lane, epoch)."""
        with self._segment.lock():
            for lane in range(self.n_lanes):
                base = self._lanes0 + _LANE * lane
                if self._c[base + _L_STATE] != FREE:
                    continue
                epoch = self._c[base + _L_EPOCH] + 1
                self._c[base + _L_PID] = pid
                self._c[base + _L_EPOCH] = epoch
                self._c[base + _L_PEER] = int(peer_ok)
                self._c[base + _L_STATE] = LIVE  # last: the sender sees a complete lane
                return lane, epoch
        raise TooManyReceiversError(
            f"all {self.n_lanes} receiver lanes of the IPC sender (pid {self.sender_pid}) are "
            "taken; close receivers you no longer use, or give FeatureSender a larger "
            "max_receivers"
        )

    def leave(self, lane: int, epoch: int) -> None:
        """Mark a receiver's lane gone (it closed): the sender reclaims what it owed."""
        base = self._lanes0 + _LANE * lane
        if self._c[base + _L_EPOCH] == epoch and self._c[base + _L_STATE] == LIVE:
            self._c[base + _L_STATE] = GONE

    def lanes(self) -> list[LaneInfo]:
        """Every lane that is not free."""
        out = []
        c = self._c
        for lane in range(self.n_lanes):
            base = self._lanes0 + _LANE * lane
            state = c[base + _L_STATE]
            if state != FREE:
                out.append(
                    LaneInfo(
                        lane, state, c[base + _L_PID], c[base + _L_EPOCH], c[base + _L_PEER] != 0
                    )
                )
        return out

    def free_lane(self, lane: int, epoch: int) -> None:
        """Clear a dead or gone receiver's cells and make its lane free (sender only)."""
        with self._segment.lock():
            base = self._lanes0 + _LANE * lane
            if self._c[base + _L_EPOCH] != epoch:
                return
            for slot in range(self.n_slots):
                cell = self._slot(slot) + _SLOT_FIXED + 2 * lane
                self._c[cell] = 0
                self._c[cell + 1] = 0
            self._c[base + _L_PID] = 0
            self._c[base + _L_STATE] = FREE

    # --- slots: the sender's cells ---------------------------------------------------------

    def arm(self, slot: int, seq: int, where: str, offset: int, nbytes: int, digest: int) -> None:
        """Give slot to send seq (not ready yet) and publish its slice."""
        base = self._slot(slot)
        c = self._c
        c[base + _S_SEQ] = 0  # first: a reader never pairs the old seq with the new slice
        c[base + _S_READY] = 0
        c[base + _S_WHERE] = WHERE_CODES[where]
        c[base + _S_OFFSET] = offset
        c[base + _S_NBYTES] = nbytes
        c[base + _S_DIGEST] = digest
        c[base + _S_SEQ] = seq

    def mark_ready(self, slot: int, seq: int, ok: bool) -> None:
        """Publish that send seq's bytes are written (or that the copy failed); any thread."""
        base = self._slot(slot)
        if self._c[base + _S_SEQ] == seq:
            self._c[base + _S_READY] = seq if ok else -seq

    def invalidate(self, slot: int, seq: int) -> None:
        """Take slot back from send seq before its bytes are reused (a late reader sees it)."""
        base = self._slot(slot)
        if self._c[base + _S_SEQ] == seq:
            self._c[base + _S_SEQ] = 0

    def slot_seq(self, slot: int) -> int:
        return self._c[self._slot(slot) + _S_SEQ]

    def published(self, slot: int) -> tuple[int, int, int, int]:
        """What slot publishes of its slice: (where code, offset, length, digest).

        Consistent with the send it belongs to when slot_seq() reads that send's seq
        both before and after.
        """
        base = self._slot(slot)
        c = self._c
        return c[base + _S_WHERE], c[base + _S_OFFSET], c[base + _S_NBYTES], c[base + _S_DIGEST]

    def ready(self, slot: int) -> int:
        return self._c[self._slot(slot) + _S_READY]

    # --- slots: a receiver's cells -----------------------------------------------------------

    def lease(self, slot: int, lane: int, seq: int) -> None:
        """Receiver lane starts reading send seq."""
        self._c[self._slot(slot) + _SLOT_FIXED + 2 * lane] = seq

    def release(self, slot: int, lane: int, seq: int) -> None:
        """Receiver lane is done with send seq (its reads have completed)."""
        self._c[self._slot(slot) + _SLOT_FIXED + 2 * lane + 1] = seq

    def leased(self, slot: int, lane: int) -> int:
        return self._c[self._slot(slot) + _SLOT_FIXED + 2 * lane]

    def released(self, slot: int, lane: int) -> int:
        return self._c[self._slot(slot) + _SLOT_FIXED + 2 * lane + 1]

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range (0..{self.n_slots - 1})")
        return self._slots0 + self._slot_cells * slot


def _cells(n_lanes: int, n_slots: int) -> int:
    """Cells of a control block with n_lanes lanes and n_slots slots."""
    return _HEADER + _LANE * n_lanes + (_SLOT_FIXED + 2 * n_lanes) * n_slots

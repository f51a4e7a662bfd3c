"""ThreadHits: reads of GPU-resident features from threads other than the cache's loop.

A thread that calls the cache (an engine's scheduler) would otherwise hand every get to
the loop's thread and wait for it: two thread switches for a hit that needs no await.
Here it reads a resident feature itself, without a lock, and the loop applies the hit's
count and recency soon after (DRAIN_DELAY_S). Where anything could go differently (the feature is
not resident, its fence not done where the device cannot order on streams, or the entry
changed while it was read) it answers None and the caller takes the hand-off.

Why it is safe without a lock (CPython with the GIL: each bytecode, and each C call that
keeps the GIL, such as dict.get or Tensor.detach, is atomic to other threads, and the GIL's
hand-over orders memory):

- Only the loop's thread changes the index, entries and orders (TierState). Every
  transition that gives up an entry's device tensor first takes it off the entry
  (`Entry.discard`, `land`, `end_offload` set `tensor` to None; `promote` sets a new
  tensor, never the old one again) and only then hands it to `Device.release`.
- The thread reads the entry's tensor t (A), makes a fresh alias of it (B), then checks
  again (C) that the index still maps the key to what it found, that the entry is still
  GPU or D2H, and that `entry.tensor is t`. If C passes, the tensor had not been taken
  off the entry at C, so its release comes after C, hence after B: the release sees the
  alias. If C fails, the alias is dropped unused. The fence read at A belongs to t:
  every transition that changes `ready` changes `tensor` too, and t cannot come back;
  `promote` stores `ready` and `tensor` before `state` (read first at A), so a thread
  that sees GPU sees the upload's fence with the upload's tensor.
- The simulator recycles (poisons) released memory only where no tensor outside the
  cache and the device shares its storage (`SimDevice._try_recycle` counts storage uses
  under its lock; one left outside is swept at a later release, after the alias dies).
  On CUDA the caching allocator frees a block only when the last tensor of its storage
  dies, and `use_on` (record_stream) keeps it for the reader's stream's queued work: the
  alias alone keeps the bytes, whatever the cache does next. Between A and B the
  thread holds t itself: on CUDA that already holds the storage; on the simulator t is
  the cache's own alias, not counted outside, so memory recycled between A and B is
  possible, and C then fails (the tensor was taken off the entry before its release).
- A fence that is done stays done; `Fence.ok()` is a read (CudaFence queries its event,
  which the driver allows from any thread, and caches the answer idempotently). A
  pending one is taken only where the device orders reads on streams (CUDA:
  `wait_on`, a cudaStreamWaitEvent, thread-safe); elsewhere the hand-off awaits it. A
  failed one goes to the hand-off, which raises.
- The hit's count and recency touch are not applied here: the entry goes on a deque
  (append and popleft are atomic) that the loop drains in `apply()`: DRAIN_DELAY_S after
  the first hit of a burst, at the start of every call the loop serves (so a thread's hits
  stay older than its next hand-off), before every eviction plan, and before stats()
  (`apply_from`, which a thread other than the loop's asks of the loop). The stats'
  counts of hits are exact once the loop has drained it.

A free-threaded build (no GIL) has none of these guarantees: there the thread path is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Final, final

import torch

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State, row_range
from mmcache.core.index import KeyIndex
from mmcache.core.policy import EvictionPolicy
from mmcache.device import Device, Stream

__all__ = ["DRAIN_DELAY_S", "GIL_ENABLED", "ThreadHits"]

#: whether this interpreter runs with the GIL, which the lock-free reads rely on
GIL_ENABLED: Final[bool] = bool(getattr(sys, "_is_gil_enabled", lambda: True)())

#: how long after the first hit of a burst the loop applies the burst's hits (seconds):
#: one loop wake-up per burst, and the counters behind by at most this much
DRAIN_DELAY_S: Final = 0.01

_GPU: Final = State.GPU
_D2H: Final = State.D2H


@final
class ThreadHits:
    """Serves GPU-resident hits to other threads; the loop applies their counts and recency."""

    __slots__ = (
        "_counters",
        "_device",
        "_gpu_order",
        "_index",
        "_ordered",
        "_wake",
        "_woken",
        "unapplied",
    )

    def __init__(
        self,
        *,
        index: KeyIndex,
        device: Device,
        counters: Counters,
        gpu_order: EvictionPolicy,
    ) -> None:
        self._index = index
        self._device = device
        self._ordered = device.stream_ordered_reads
        self._counters = counters
        self._gpu_order = gpu_order
        #: hits served off the loop, not yet applied: the entry to touch (None: a D2H
        #: hit, counted but not touched, as the loop's read does)
        self.unapplied: deque[Entry | None] = deque()
        self._wake: Callable[[], object] | None = None
        self._woken = False  # a drain is scheduled on the loop and has not started

    @property
    def pending(self) -> int:
        """Hits served off the loop that apply() has not counted yet."""
        return len(self.unapplied)

    def bind(self, wake: Callable[[], object]) -> None:
        """wake(): schedule apply() on the loop from any thread (call_soon_threadsafe)."""
        self._wake = wake

    def serve(self, key: Hashable, rows: slice | None, stream: Stream) -> torch.Tensor | None:
        """key's feature (or rows of it) ordered on stream, if it is resident on the device
        and readable now from this thread; None: take the hand-off to the loop."""
        found = self._index.get(key)
        if found is None:
            return None
        # A: what the entry holds now (each read atomic; C below checks they belong together).
        span: tuple[int, int] | None
        if type(found) is Member:
            entry = found[1]
            span = found.span(row_range(rows, found.shape))
        else:
            entry = found  # type: ignore[assignment]
            span = None if rows is None else row_range(rows, entry.shape)
        state = entry.state
        tensor = entry.tensor
        ready = entry.ready
        if tensor is None or (state is not _GPU and state is not _D2H):
            return None
        if not ready.ok() and (ready.done() or not self._ordered):
            return None  # failed (the loop raises), or a wait this thread cannot order
        # B: the reader's own alias, before the check: from C on it holds the bytes.
        out = tensor.detach() if span is None else tensor[span[0] : span[1]]
        # C: nothing was given up between A and B (see the module's docstring).
        now = entry.state
        if (
            entry.tensor is not tensor
            or (now is not _GPU and now is not _D2H)
            or self._index.get(key) is not found
        ):
            del out
            return None
        del tensor
        device = self._device
        if not ready.ok():
            if ready.done():  # failed since A: never served as done (the loop raises)
                del out
                return None
            device.wait_on(stream, ready)  # pending: ordered on the reader's stream (CUDA)
        device.use_on(out, stream)
        self.unapplied.append(entry if state is _GPU else None)
        if not self._woken:
            # Racing threads may both wake: a drain of nothing costs one loop callback.
            self._woken = True
            wake = self._wake
            if wake is not None:
                with contextlib.suppress(RuntimeError):  # the loop has stopped: stats drain
                    wake()
        return out

    def drain(self) -> None:
        """The wake-up's apply(), on the loop: a hit appended from here on wakes it again
        (other callers of apply() leave a scheduled drain to come)."""
        self._woken = False
        self.apply()

    def apply(self) -> None:
        """On the loop: count the hits served off it and touch their entries' recency."""
        pending = self.unapplied
        if not pending:
            return
        hits = 0
        touch = self._gpu_order.touch
        pop = pending.popleft
        while pending:
            entry = pop()
            hits += 1
            # Still resident: in the GPU order under its key (a victim leaves the order
            # and the GPU state in one loop step; a later entry of the key is another one).
            if entry is not None and entry.state is _GPU:
                with contextlib.suppress(KeyError):  # a GPU entry outside the order
                    touch(entry.key)
        self._counters.looked_up(hits, 0, 0)

    def apply_from(
        self, loop: asyncio.AbstractEventLoop | None, loop_thread: int, timeout: float
    ) -> None:
        """apply() from any thread (stats() counts every hit served so far): at once on the
        loop's thread (loop_thread), or where no loop runs that could change the state
        meanwhile; from another thread, by asking the loop and waiting up to timeout s."""
        if not self.unapplied:
            return
        if (
            loop is None
            or threading.get_ident() == loop_thread
            or not loop.is_running()
            or loop.is_closed()
        ):
            self.apply()
            return
        applied = threading.Event()

        def apply() -> None:
            try:
                self.apply()
            finally:
                applied.set()

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:  # closed just now
            self.apply()
            return
        applied.wait(timeout)

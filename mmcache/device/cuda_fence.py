"""CudaFence: a CUDA event recorded on a stream, and ordering streams after fences."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, final

import torch

from mmcache.device.base import Fence
from mmcache.device.cuda_driver import FenceSleeper
from mmcache.errors import CopyFailedError, InvalidValueError, MMCacheError

if TYPE_CHECKING:
    from mmcache.device.cuda_waiters import FenceWaiters

__all__ = ["CudaFence", "order_after", "pending_event", "record_fence"]

# torch.cuda.Event's Python methods only fill in defaults and forward to these; a put
# records a fence and the loop queries fences all the time, so they are called directly.
# (torch defines the class in every build: a placeholder where CUDA is missing.)
_EventBase: Any = torch._C._CudaEventBase


def _event_query(event: torch.cuda.Event) -> bool:
    """event.query(), typed."""
    return bool(_EventBase.query(event))


def _new_event() -> torch.cuda.Event:
    """An untimed event that costs the host nothing to record.

    Not a blocking-sync one: with dozens of those pending on one stream the next record
    there blocks the host until the oldest completes, and a put records a fence on its
    producer's stream, which may run a long kernel. Threads sleep through a FenceSleeper.
    """
    event: torch.cuda.Event = _EventBase.__new__(torch.cuda.Event)
    return event


@final
class CudaFence(Fence):
    """A torch.cuda.Event recorded on a stream: done once the GPU has passed it."""

    __slots__ = ("_done", "_error", "_waiters", "event", "seq", "stream")

    def __init__(
        self, event: torch.cuda.Event, stream: torch.cuda.Stream, waiters: FenceWaiters, seq: int
    ) -> None:
        self.event = event
        self.stream = stream
        self.seq = seq  # fences of one stream complete in this order
        self._waiters = waiters
        self._done = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Return True once the work before the fence has completed (successfully or not)."""
        if self._done:
            return True
        try:
            if not _event_query(self.event):
                return False
        except RuntimeError as exc:  # a sticky CUDA error surfaces at the next query
            self._error = CopyFailedError(f"device work before a fence failed: {exc}")
        self._done = True
        return True

    def ok(self) -> bool:
        """Done without error; a read's first question, so one call once done."""
        return (self._done or self.done()) and self._error is None

    def exception(self) -> BaseException | None:
        """The sticky CUDA error seen while waiting, if any (copies fail at enqueue instead)."""
        return self._error

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call fn() at once if known done, else from one of the device's waiter threads.

        No query here: callers have just looked (a fresh fence is pending anyway), and
        a fence that completed meanwhile only sends fn through a waiter.
        """
        if self._done:
            fn()
        else:
            self._waiters.submit(self, fn)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (polling at up to 1 ms) or until timeout; return done()."""
        if self.done():
            return True
        if timeout is None:
            self.synchronize()
            return True
        deadline = time.monotonic() + timeout  # inf: until done
        pause = 20e-6
        while not self.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 1e-3)
        return True

    def synchronize(self, sleeper: FenceSleeper | None = None) -> None:
        """Block the calling thread until done: asleep in the driver through sleeper (the
        GIL released), or without one polling at up to 1 ms (the event would spin a core)."""
        if self._done:
            return
        if sleeper is None:
            self.wait(math.inf)  # done() records a sticky error
            return
        try:
            sleeper.sleep_until(self.event.cuda_event)  # a sticky error surfaces here too
        except (RuntimeError, MMCacheError) as exc:
            self._error = CopyFailedError(f"device work before a fence failed: {exc}")
        self._done = True

    def pending_event(self) -> torch.cuda.Event | None:
        """The event to wait on, or None once the fence is known to be done."""
        return None if self._done else self.event


_fence_seq = itertools.count()
_record_lock = threading.Lock()


def record_fence(stream: torch.cuda.Stream, waiters: FenceWaiters) -> CudaFence:
    """A fence after the work queued on stream so far; waiters run its callbacks."""
    event = _new_event()
    # The order number is taken with the record: threads recording on one stream
    # between the two would otherwise get numbers out of the stream's order.
    with _record_lock:
        _EventBase.record(event, stream)
        seq = next(_fence_seq)
    return CudaFence(event, stream, waiters, seq)


def order_after(stream: torch.cuda.Stream, after: Sequence[Fence]) -> None:
    """Make later work on stream wait for every fence in after (no host synchronisation)."""
    if len(after) > 1:
        # A batch's producers are mostly a few streams: waiting on the last fence of
        # each stream orders after all of them, at one wait_event per stream.
        last: dict[int, Fence] = {}
        for deferred in after:
            fence = deferred.resolved()
            if isinstance(fence, CudaFence):
                key = fence.stream.cuda_stream
                seen = last.get(key)
                if not isinstance(seen, CudaFence) or seen.seq < fence.seq:
                    last[key] = fence
            else:
                last[-1 - len(last)] = fence  # not ours: pending_event checks it
        after = list(last.values())
    for fence in after:
        event = pending_event(fence)
        if event is not None:
            stream.wait_event(event)


def pending_event(fence: Fence) -> torch.cuda.Event | None:
    """The CUDA event a stream must wait on for fence, or None if it is done."""
    fence = fence.resolved()
    if isinstance(fence, CudaFence):
        return fence.pending_event()
    if fence.done():
        return None
    raise InvalidValueError(
        f"cannot order CUDA work after a pending {type(fence).__name__}; "
        "use fences made by the same CudaDevice"
    )

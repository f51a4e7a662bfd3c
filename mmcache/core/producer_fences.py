"""ProducerFences: the fence each put orders its features' readers after, recorded sparingly."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Final

from mmcache.device.base import DeferredFence, Device, Fence, Stream

__all__ = ["ProducerFences"]

_UNSEEN: Final = object()
_log = logging.getLogger("mmcache")


class ProducerFences:
    """Hands each put the fence of its producer's stream, one record per stream and iteration.

    The first put on a stream in an iteration of the event loop records a fence there, at
    once. Later puts on that stream in the same iteration share one DeferredFence, recorded
    when something first orders after it (an offload, a read on another stream) or when the
    iteration ends, whichever comes first. A burst of puts, such as a video's frames or a
    batch put one feature at a time, then records a few fences rather than one each: a
    record, and the offload's query of it, are a large share of the loop's time per
    small feature at copy speed (BENCHMARKS.md). A shared fence is recorded after its
    puts, so it covers their producers'
    work; it may also cover work queued on the stream later in that iteration, which a
    reader on another stream then waits for as well.

    Unbound (before the cache starts) or called off the loop's thread, it records every time.
    """

    __slots__ = ("_device", "_loop", "_open", "_thread")

    def __init__(self, device: Device) -> None:
        self._device = device
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        # id(stream) -> the fence later puts on it share in this iteration (None: none yet).
        # A stream whose first put is seen here is not referenced: should it die and another
        # take its id, that one's puts share a fence on their own stream, still exact.
        self._open: dict[int, DeferredFence | None] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Share fences within iterations of loop, which runs on the calling thread."""
        self._loop, self._thread = loop, threading.get_ident()

    def fence(self, stream: Stream) -> Fence:
        """The fence a put on stream orders its features' readers after."""
        loop = self._loop
        if loop is None or threading.get_ident() != self._thread:
            return self._device.record(stream)
        opened = self._open
        key = id(stream)
        shared = opened.get(key, _UNSEEN)
        if shared is _UNSEEN:
            if not opened:
                loop.call_soon(self.record_open)
            opened[key] = None
            return self._device.record(stream)
        if not isinstance(shared, DeferredFence) or shared.recorded:
            shared = opened[key] = DeferredFence(self._device, stream)
        return shared

    def unbind(self) -> None:
        """Record what is shared now and every fence at once from here on (closing)."""
        self._loop = None
        try:
            self.record_open()
        except Exception:  # a device that cannot record must not stop a close
            _log.exception("mmcache: recording the shared producer fences failed")

    def record_open(self) -> None:
        """Record the shared fences nothing has needed yet, and start a new iteration.

        Runs at the end of each iteration with puts: work queued on a stream from then on
        is no longer theirs to cover.
        """
        opened = self._open
        try:
            for shared in opened.values():
                if shared is not None:
                    shared.resolved()
        finally:  # one that failed to record still records when needed
            opened.clear()

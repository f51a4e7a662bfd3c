"""RemoteWriter: what goes to the server, from which host copy, and why a write was dropped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from typing import Final, final

import torch

from mmcache.core.entry import Entry, Member, State
from mmcache.core.index import KeyIndex
from mmcache.device import Device, NewCopyPlan
from mmcache.metrics import RemoteSeries
from mmcache.remote.calls import Failed, ServerCalls
from mmcache.remote.codec import encode_value, supported
from mmcache.remote.store import RemoteStore
from mmcache.remote.writes import Write, WriteQueue
from mmcache.settings import CacheSettings
from mmcache.waiting import wait_fences

__all__ = ["THREAD_FROM_BYTES", "RemoteWriter"]

log = logging.getLogger("mmcache")

#: values at least this large are encoded and checked off the event loop
THREAD_FROM_BYTES: Final = 1024 * 1024


@final
class RemoteWriter:
    """Writes features to the server in the background, from host copies; never waits.

    A put's write is a download queued at once on the copy stream after the data's
    fence (the device tensor is released only after it); a host entry's is a copy of its
    landed bytes. Writes queue up to remote_queue_mb; one that does not fit, or is
    larger than remote_max_value_mb, or comes while the server is backed off from, is
    dropped and counted by reason.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        store: RemoteStore,
        calls: ServerCalls,
        key: Callable[[Hashable], bytes],
        index: KeyIndex,
        device: Device,
        series: RemoteSeries,
    ) -> None:
        self._store = store
        self._calls = calls
        self._key = key  # the server key of a cache key
        self._index = index
        self._device = device
        self._series = series
        self._ttl = settings.remote_ttl_sec
        self._max_bytes = settings.remote_max_value_bytes
        self._copy_timeout = settings.copy_timeout_s
        self.queue = WriteQueue(self._send, settings.remote_queue_bytes, queued=series.set_queued)
        self.written_bytes = self.dropped = 0
        self._probe: asyncio.Task[None] | None = None

    def put(self, key: Hashable) -> None:
        """Queue a write of key's feature, just put, from a host copy of it."""
        if self._calls.in_burst():
            self._unavailable()  # first: a put costs the least while the server is down
            return
        found = self._index.get(key)
        if found is None:
            return
        entry, start, stop = _rows(found)
        nbytes = _nbytes(entry, start, stop)
        if not self._writable(entry.dtype, nbytes):
            return
        if entry.state is State.HOST and entry.block is not None:
            self._queue_host_copy(key, entry, start, stop, nbytes)
            return
        tensor = entry.tensor
        if tensor is None or entry.state is State.GONE:
            return
        src = tensor if entry.members is None else tensor[start:stop]
        dst, fence = self._device.submit(NewCopyPlan("d2h", (src,), after=(entry.ready,)))
        assert fence is not None  # a download always has one
        entry.add_device_reader(fence)  # the tensor's release waits for this copy
        del src, tensor
        self.queue.offer(Write(self._key(key), dst, fence, nbytes))

    def evicted(self, entry: Entry) -> None:
        """Queue writes of the features of a host entry leaving the host tier (copied now)."""
        if entry.members is None:
            if self._index.get(entry.key) is entry:
                self._queue_host_copy(entry.key, entry, None, None, entry.nbytes)
            return
        for member in entry.members:
            if self._index.get(member.key) is member:
                self._queue_host_copy(member.key, entry, member.start, member.stop, member.nbytes)

    def drop_all(self, writes: list[Write], reason: str) -> None:
        """Count writes that will not be sent."""
        for _ in writes:
            self._drop(reason)

    def _queue_host_copy(
        self, key: Hashable, entry: Entry, start: int | None, stop: int | None, nbytes: int
    ) -> None:
        """Queue a write from a copy of a host entry's landed bytes, made now."""
        if not self._writable(entry.dtype, nbytes):
            return
        fence = entry.copy_fence
        if entry.block is None or fence is None or not fence.done() or fence.exception():
            return  # still landing (its put's write is queued from the device) or lost
        view = entry.host_whole() if start is None or stop is None else entry.host_view(start, stop)
        copy = torch.empty_like(view, device="cpu")
        copy.copy_(view)  # the block's copy has landed: plain host memory now
        self.queue.offer(Write(self._key(key), copy, None, nbytes))

    def _writable(self, dtype: torch.dtype, nbytes: int) -> bool:
        """Whether a write of nbytes can be queued now; counts why not."""
        if nbytes == 0 or not supported(dtype):
            return False
        if nbytes > self._max_bytes:
            self._drop("too_large")
            return False
        if self._calls.in_burst():
            self._unavailable()
            return False
        if not self.queue.fits(nbytes):
            self._drop("queue_full")
            return False
        return True

    def _unavailable(self) -> None:
        """Drop a write while the server is backed off from; once the back-off is over, ask
        the server (one small call) whether it is back, since no write goes to find out."""
        self._drop("unavailable")
        if self._probe is None and self._calls.available():
            self._probe = asyncio.ensure_future(self._ask_server())

    async def _ask_server(self) -> None:
        try:
            await self._calls("probe", self._store.exists(self._key("mmcache:probe")))
        finally:
            self._probe = None

    def stop_probing(self) -> asyncio.Task[None] | None:
        """The probe running, cancelled (close())."""
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
        return probe

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self._series.dropped[reason].inc()

    async def _send(self, write: Write) -> None:
        """Write one queued value: wait for its host copy, add the header, send it."""
        try:
            if write.fence is not None:
                await wait_fences([write.fence], self._copy_timeout)
            if not self._calls.available():  # before encoding: a down server costs nothing
                self._drop("unavailable")
                return
            if write.nbytes >= THREAD_FROM_BYTES:
                value = await asyncio.to_thread(encode_value, write.tensor, write.key)
            else:
                value = encode_value(write.tensor, write.key)
        except asyncio.CancelledError:
            self._drop("closed")
            raise
        except Exception as e:  # a failed copy: nothing to write
            log.debug("remote write of %r skipped: %s", write.key, e)
            self._drop("error")
            return
        try:
            result = await self._calls(
                "put", self._store.put(write.key, memoryview(value), self._ttl), len(value)
            )
        except asyncio.CancelledError:
            self._drop("closed")
            raise
        if isinstance(result, Failed):
            self._drop("error")
            return
        self.written_bytes += write.nbytes
        self._series.bytes["written"].inc(write.nbytes)


def _rows(found: Entry | Member) -> tuple[Entry, int | None, int | None]:
    """The entry holding a key's feature, and its rows there (None: all of it)."""
    if isinstance(found, Member):
        return found.group, found.start, found.stop
    return found, None, None


def _nbytes(entry: Entry, start: int | None, stop: int | None) -> int:
    if start is None or stop is None:
        return entry.nbytes
    return entry.nbytes // entry.shape[0] * (stop - start)

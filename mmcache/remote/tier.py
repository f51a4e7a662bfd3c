"""RemoteTier: the third tier, shared by every cache on one server; reads after local misses,
background writes, integrity checks and fault handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import reprlib
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Final, TypeVar, final

import torch

from mmcache.core.tiers import Tiers
from mmcache.device import Device
from mmcache.entry import Entry, Member, State
from mmcache.metrics import RemoteSeries
from mmcache.remote.codec import RemoteValueError, encode_key, encode_value, parse, supported
from mmcache.remote.faults import Faults
from mmcache.remote.landing import HostLanding
from mmcache.remote.store import RemoteStore
from mmcache.remote.writes import Write, WriteQueue
from mmcache.settings import CacheSettings
from mmcache.single_flight import SingleFlight
from mmcache.waiting import wait_fences

__all__ = ["REMOTE_STAT_NAMES", "RemoteTier"]

log = logging.getLogger("mmcache")

_T = TypeVar("_T")

#: values at least this large are checksummed off the event loop
_THREAD_FROM_BYTES: Final = 1024 * 1024

#: the CacheStats fields the remote tier fills
REMOTE_STAT_NAMES: Final = (
    "remote_hits",
    "remote_misses",
    "remote_rejected",
    "remote_errors",
    "remote_read_bytes",
    "remote_written_bytes",
    "remote_queued_bytes",
    "remote_dropped_writes",
)


@final
class RemoteTier:
    """Reads a key from the server after both local tiers missed it; writes in the background.

    A read lands the value in a host block and indexes it as a host entry, so the get
    that asked serves it as a host hit; concurrent gets of one key share one fetch. A
    value that fails a check of its header or payload is counted, deleted on the server
    and never served. Faults (server down, slow, restarted) make reads miss within
    remote_timeout_sec and drop writes; they are counted, logged once per burst, and
    backed off from until the server answers again. Nothing local depends on the server.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        name: str,
        core: Tiers,
        device: Device,
        changed: Callable[[], None],
        series: RemoteSeries,
        store: RemoteStore | None = None,
    ) -> None:
        """The tier of settings.remote_url (or of store, a RemoteStore given instead) for the
        cache named name, whose parts are core."""
        if store is None:
            from mmcache.remote.redis_store import RedisStore

            assert settings.remote_url is not None
            redis = RedisStore(settings.remote_url, settings.remote_timeout_sec)
            store, name = redis, f"{redis.url} (cache {name!r})"
        self._store = store
        self._prefix = settings.remote_namespace.encode() + b":"
        self._write_mode = settings.remote_write
        self._ttl = settings.remote_ttl_sec
        self._timeout = settings.remote_timeout_sec
        self._max_bytes = settings.remote_max_value_bytes
        self._copy_timeout = settings.copy_timeout_s
        self._device = device
        self._index = index = core.index
        self._series = series
        self._landing = HostLanding(
            device=device, host=core.host, index=index, ledger=core.ledger, changed=changed
        )
        self._faults = Faults(name, series.error)
        self._fetches: SingleFlight[None] = SingleFlight()
        self._writes = WriteQueue(self._send, settings.remote_queue_bytes, queued=series.set_queued)
        self._deletes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.hits = self.misses = self.rejected = 0
        self.read_bytes = self.written_bytes = self.dropped_writes = 0

    # --- keys and stats -----------------------------------------------------------------

    def key(self, key: Hashable) -> bytes:
        """The server-side key of a cache key: <namespace>: + a stable encoding of it."""
        return self._prefix + encode_key(key)

    def stats(self) -> dict[str, int]:
        """The remote tier's figures, by CacheStats field."""
        return {
            "remote_hits": self.hits,
            "remote_misses": self.misses,
            "remote_rejected": self.rejected,
            "remote_errors": self._faults.total,
            "remote_read_bytes": self.read_bytes,
            "remote_written_bytes": self.written_bytes,
            "remote_queued_bytes": self._writes.nbytes,
            "remote_dropped_writes": self.dropped_writes,
        }

    # --- reads --------------------------------------------------------------------------

    async def fetch(self, key: Hashable) -> Entry | Member | None:
        """key's local entry after asking the server for it (None: a miss, however caused).

        Shared by concurrent callers of one key; a caller cancelled does not cancel the
        fetch, which lands the value for the others (and for later gets).
        """
        if self._closed:
            return None
        task = self._fetches.run(key, lambda: self._fetch(key))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                return None  # the fetch was cancelled (close()), not this caller: a miss
            raise
        return self._index.get(key)

    async def _fetch(self, key: Hashable) -> None:
        lookups = self._series.lookups
        if not self._faults.available():
            lookups["skipped"].inc()
            return
        rkey = self.key(key)
        value = await self._call("get", self._store.get(rkey))
        if isinstance(value, _Failed):
            lookups["error"].inc()
            return
        if value is None:
            self.misses += 1
            lookups["miss"].inc()
            return
        try:
            if len(value) >= _THREAD_FROM_BYTES:
                header, _ = await asyncio.to_thread(parse, value)
            else:
                header, _ = parse(value)
        except RemoteValueError as e:
            self._reject(key, rkey, value, e)
            return
        if key in self._index:  # put locally while the value travelled: that one is newer
            return
        block = self._landing.block_for(header.length)
        if block is None:
            self.misses += 1
            lookups["miss"].inc()
            return
        try:
            self._landing.fill(block, value, header)
        except BaseException:
            self._landing.release(block)
            raise
        del value
        if self._landing.insert(key, block, header):
            self.hits += 1
            self.read_bytes += header.length
            lookups["hit"].inc()
            self._series.bytes["read"].inc(header.length)

    def _reject(self, key: Hashable, rkey: bytes, value: bytes, error: RemoteValueError) -> None:
        """A value failed a check: count it, delete it on the server, serve a miss."""
        self.rejected += 1
        self._series.lookups["rejected"].inc()
        log.warning("remote value of %s rejected and deleted: %s", reprlib.repr(key), error)
        task = asyncio.get_running_loop().create_task(self._delete(rkey, value))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _delete(self, rkey: bytes, value: bytes) -> None:
        await self._call("delete", self._store.delete(rkey, only_if=value))

    # --- writes -------------------------------------------------------------------------

    @property
    def writes_on_put(self) -> bool:
        """Whether every put is written (remote_write=put)."""
        return self._write_mode == "put" and not self._closed

    @property
    def writes_on_evict(self) -> bool:
        """Whether what leaves the host tier is written (remote_write=evict)."""
        return self._write_mode == "evict" and not self._closed

    def put(self, key: Hashable) -> None:
        """Queue a write of key's feature, just put, from a host copy of it; never waits.

        The copy is queued now, on the copy stream after the data's fence; the device
        tensor is released only after it. Dropped (counted) past remote_queue_mb.
        """
        if not self._faults.available():
            self._drop("unavailable")  # first: a put costs the least while the server is down
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
        dst = self._device.host_empty(tuple(src.shape), src.dtype)
        fence = self._device.copy_d2h(src, dst, after=[entry.ready])
        entry.add_device_reader(fence)  # the tensor's release waits for this copy
        del src, tensor
        self._writes.offer(Write(self.key(key), dst, fence, nbytes))

    def evicted(self, entry: Entry) -> None:
        """Queue writes of the features of a host entry leaving the host tier (copied now)."""
        if entry.members is None:
            if self._index.get(entry.key) is entry:
                self._queue_host_copy(entry.key, entry, None, None, entry.nbytes)
            return
        for member in entry.members:
            if self._index.get(member.key) is member:
                self._queue_host_copy(member.key, entry, member.start, member.stop, member.nbytes)

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
        self._writes.offer(Write(self.key(key), copy, None, nbytes))

    def _writable(self, dtype: torch.dtype, nbytes: int) -> bool:
        """Whether a write of nbytes can be queued now; counts why not."""
        if nbytes == 0 or not supported(dtype):
            return False
        if nbytes > self._max_bytes:
            self._drop("too_large")
            return False
        if not self._faults.available():
            self._drop("unavailable")
            return False
        if not self._writes.fits(nbytes):
            self._drop("queue_full")
            return False
        return True

    def _drop(self, reason: str) -> None:
        self.dropped_writes += 1
        self._series.dropped[reason].inc()

    async def _send(self, write: Write) -> None:
        """Write one queued value: wait for its host copy, add the header, send it."""
        try:
            if write.fence is not None:
                await wait_fences([write.fence], self._copy_timeout)
            if write.nbytes >= _THREAD_FROM_BYTES:
                value = await asyncio.to_thread(encode_value, write.tensor)
            else:
                value = encode_value(write.tensor)
        except asyncio.CancelledError:
            self._drop("closed")
            raise
        except Exception as e:  # a failed copy: nothing to write
            log.debug("remote write of %r skipped: %s", write.key, e)
            self._drop("error")
            return
        if not self._faults.available():
            self._drop("unavailable")
            return
        try:
            result = await self._call(
                "put", self._store.put(write.key, memoryview(value), self._ttl)
            )
        except asyncio.CancelledError:
            self._drop("closed")
            raise
        if isinstance(result, _Failed):
            self._drop("error")
            return
        self.written_bytes += write.nbytes
        self._series.bytes["written"].inc(write.nbytes)

    # --- faults -------------------------------------------------------------------------

    async def _call(self, op: str, call: Awaitable[_T]) -> _T | _Failed:
        """await call within remote_timeout_sec; a fault is counted and returned, not raised."""
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, self._timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._faults.failed(op, e)
            return _FAILED
        if op in self._series.seconds:
            self._series.seconds[op].observe(time.perf_counter() - started)
        self._faults.succeeded()
        return result

    # --- lifecycle ----------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every write queued so far has been sent or dropped."""
        await self._writes.drain()

    async def close(self) -> None:
        """Send queued writes for up to remote_timeout_sec, drop the rest, close the client."""
        if self._closed:
            return
        self._closed = True
        for task in self._fetches.running():
            task.cancel()
        for task in self._fetches.running():
            with contextlib.suppress(BaseException):
                await task
        left = await self._writes.close(self._timeout)
        for _ in left:
            self._drop("closed")
        for task in list(self._deletes):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, self._timeout)
        try:
            await self._store.close()
        except Exception as e:
            log.debug("closing the remote store: %s", e)


@final
class _Failed:
    """What _call returns for an operation that failed (counted already)."""

    __slots__ = ()


_FAILED: Final = _Failed()


def _rows(found: Entry | Member) -> tuple[Entry, int | None, int | None]:
    """The entry holding a key's feature, and its rows there (None: all of it)."""
    if isinstance(found, Member):
        return found.group, found.start, found.stop
    return found, None, None


def _nbytes(entry: Entry, start: int | None, stop: int | None) -> int:
    if start is None or stop is None:
        return entry.nbytes
    return entry.nbytes // entry.shape[0] * (stop - start)

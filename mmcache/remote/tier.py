"""RemoteTier: the third tier, shared by every cache on one server; reads after local misses,
background writes, integrity checks and fault handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import reprlib
import time
from collections.abc import Callable, Hashable, Iterable
from typing import final

from mmcache.core.entry import Entry, Member
from mmcache.core.tiers import Tiers
from mmcache.device import Device
from mmcache.metrics import CacheMetrics, RemoteSeries
from mmcache.remote.calls import Failed, ServerCalls
from mmcache.remote.codec import OtherVersionError, RemoteValueError, parse, server_key
from mmcache.remote.faults import Faults, describe
from mmcache.remote.landing import HostLanding
from mmcache.remote.store import RemoteStore, WrongTypeError
from mmcache.remote.writer import THREAD_FROM_BYTES, RemoteWriter
from mmcache.settings import CacheSettings
from mmcache.single_flight import SingleFlight

__all__ = ["RemoteTier", "remote_tier_for"]

log = logging.getLogger("mmcache")


@final
class RemoteTier:
    """Reads a key from the server after both local tiers missed it; writes in the background.

    A read lands the value in a host block and indexes it as a host entry, so the get
    that asked serves it as a host hit; concurrent gets of one key share one fetch. A
    value that fails a check of its header or payload, or a key that holds another type,
    is counted, deleted on the server and never served; a value of another format
    version is a miss. Faults (server down, slow, restarted) make reads miss within
    remote_timeout_sec (plus remote_timeout_per_mib_sec per MiB of a value being moved)
    and drop writes; they are counted, logged when they start and when they end, and
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
        self._redis = None
        if store is None:
            from mmcache.remote.redis_store import RedisStore

            assert settings.remote_url is not None
            self._redis = redis = RedisStore(settings.remote_url, settings.remote_timeout_sec)
            store, name = redis, f"{redis.url} (cache {name!r})"
        self._name = name
        self._store = store
        self._namespace = settings.remote_namespace
        self._write_mode = settings.remote_write
        self._timeout = settings.remote_timeout_sec
        self._index = index = core.index
        self._series = series
        self._landing = HostLanding(state=core.state, carry_out=core.carry_out, changed=changed)
        self._faults = faults = Faults(name, series.error, settings.remote_timeout_sec)
        self._call = calls = ServerCalls(
            faults,
            settings.remote_timeout_sec,
            series.seconds,
            per_mib_s=settings.remote_timeout_per_mib_sec,
        )
        self._ttl = settings.remote_ttl_sec
        self._fetches: SingleFlight[None] = SingleFlight()
        self._writer = RemoteWriter(
            settings,
            store=store,
            calls=calls,
            key=self.key,
            index=index,
            device=device,
            series=series,
        )
        self._deletes: set[asyncio.Task[None]] = set()
        self._check: asyncio.Task[None] | None = None
        self._closed = False
        self.hits = self.misses = self.rejected = self.read_bytes = 0

    # --- keys and stats -----------------------------------------------------------------

    def key(self, key: Hashable) -> bytes:
        """The server-side key of a cache key: <len>:<namespace>:<a stable encoding of it>."""
        return server_key(self._namespace, key)

    def stats(self) -> dict[str, int]:
        """The remote tier's figures, by CacheStats field."""
        return {
            "remote_hits": self.hits,
            "remote_misses": self.misses,
            "remote_rejected": self.rejected,
            "remote_errors": self._faults.total,
            "remote_read_bytes": self.read_bytes,
            "remote_written_bytes": self._writer.written_bytes,
            "remote_queued_bytes": self._writer.queue.nbytes,
            "remote_dropped_writes": self._writer.dropped,
        }

    # --- reads --------------------------------------------------------------------------

    async def fetch_missing(self, keys: Iterable[Hashable]) -> None:
        """Fetch, concurrently, those of keys no local tier holds (get_many's misses)."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._index]
        if missing:
            await asyncio.gather(*map(self.fetch, missing))

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
        started = time.perf_counter()
        try:
            # The value's length first: the GET's time limit grows with it.
            size = await self._call("get", self._store.size(rkey), timed=False)
            if isinstance(size, Failed):
                lookups["error"].inc()
                return
            value = None
            if size > 0:
                got = await self._call("get", self._store.get(rkey), size, timed=False)
                if isinstance(got, Failed):
                    lookups["error"].inc()
                    return
                value = got
        except WrongTypeError as e:
            self._reject(key, rkey, None, e)
            return
        self._series.seconds["get"].observe(time.perf_counter() - started)
        if value is None:
            self.misses += 1
            lookups["miss"].inc()
            return
        try:
            if len(value) >= THREAD_FROM_BYTES:
                header, _ = await asyncio.to_thread(parse, value, rkey)
            else:
                header, _ = parse(value, rkey)
        except OtherVersionError as e:
            # Another mmcache's value, not a damaged one: a miss, left for it (or for this
            # cache's next write of key, which replaces it).
            log.debug("remote value of %s is a miss: %s", reprlib.repr(key), e)
            self.misses += 1
            lookups["miss"].inc()
            return
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

    def _reject(self, key: Hashable, rkey: bytes, value: bytes | None, error: Exception) -> None:
        """A value failed a check, or key's server key holds another type (value None):
        count it, delete it on the server, serve a miss."""
        self.rejected += 1
        self._series.lookups["rejected"].inc()
        log.warning("remote value of %s rejected and deleted: %s", reprlib.repr(key), error)
        task = asyncio.get_running_loop().create_task(self._delete(rkey, value))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _delete(self, rkey: bytes, value: bytes | None) -> None:
        # A rejected value only while it is still there; another type at once (a value
        # written since then replaced it, and the delete may take that one: a miss).
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
        """Queue a write of key's feature, just put, from a host copy of it; never waits."""
        self._writer.put(key)

    def stored(self, keys: Iterable[Hashable]) -> None:
        """The features of keys were just put: queue their writes where every put is written."""
        if self.writes_on_put:
            for key in keys:
                self._writer.put(key)

    def evicted(self, entry: Entry) -> None:
        """Queue writes of the features of a host entry leaving the host tier."""
        self._writer.evicted(entry)

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Look at the server's memory limit in the background (on the cache's start)."""
        if self._redis is not None and self._check is None and not self._closed:
            self._check = asyncio.get_running_loop().create_task(self._check_memory())

    async def _check_memory(self) -> None:
        """Warn where the server can fill up: no maxmemory, or one that refuses writes when
        reached. Not a fault of the tier's: a failure here is logged at debug level only."""
        assert self._redis is not None
        try:
            found = await asyncio.wait_for(self._redis.memory_policy(), self._timeout)
        except Exception as e:
            log.debug("remote tier %s: could not read maxmemory: %s", self._name, describe(e))
            return
        if found is None:
            return
        limit, policy = found
        ttl = "no TTL" if self._ttl is None else f"remote_ttl_sec {self._ttl:g}"
        if limit == 0:
            log.warning(
                "remote tier %s: the server has no memory limit (maxmemory 0): values (%s) "
                "can fill its memory; set maxmemory and maxmemory-policy allkeys-lru on it",
                self._name,
                ttl,
            )
        elif policy == "noeviction":
            log.warning(
                "remote tier %s: the server evicts nothing (maxmemory-policy noeviction): "
                "once full, every write fails; set maxmemory-policy allkeys-lru on it",
                self._name,
            )

    async def drain(self) -> None:
        """Wait until every write queued so far has been sent or dropped."""
        await self._writer.queue.drain()

    async def close(self) -> None:
        """Send queued writes for up to the time their bytes may take (remote_timeout_sec
        plus remote_timeout_per_mib_sec per MiB), drop the rest, close the client."""
        if self._closed:
            return
        self._closed = True
        if self._check is not None:
            self._check.cancel()
            with contextlib.suppress(BaseException):
                await self._check
        for task in self._fetches.running():
            task.cancel()
        for task in self._fetches.running():
            with contextlib.suppress(BaseException):
                await task
        queue = self._writer.queue
        # As long as the bytes queued may take to send: a put's own time limit.
        self._writer.drop_all(await queue.close(self._call.timeout(queue.nbytes)), "closed")
        probe = self._writer.stop_probing()
        if probe is not None:
            with contextlib.suppress(BaseException):
                await probe
        for task in list(self._deletes):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, self._timeout)
        try:
            await self._store.close()
        except Exception as e:
            log.debug("closing the remote store: %s", e)


def remote_tier_for(
    settings: CacheSettings,
    *,
    name: str,
    core: Tiers,
    device: Device,
    changed: Callable[[], None],
    metrics: CacheMetrics,
) -> RemoteTier | None:
    """The remote tier of a cache whose settings name a server (remote_url), else None."""
    if settings.remote_url is None:
        return None
    tier = RemoteTier(
        settings, name=name, core=core, device=device, changed=changed, series=metrics.remote()
    )
    if tier.writes_on_evict:
        core.host.tell_evictions(tier.evicted)
    return tier

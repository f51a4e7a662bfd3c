"""Prometheus metrics of each cache, pushed on every change so multiprocess mode works.

Serving the metrics from an aiohttp application (no extra dependency)::

    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from mmcache.metrics import exposition_registry

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(exposition_registry())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)

From an ASGI application (FastAPI, Starlette): ``app.mount("/metrics", asgi_app())``.
Standalone: ``start_metrics_server(9464)``.

Multiprocess mode: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before any
process imports prometheus_client, expose ``make_multiprocess_registry()`` (the three
helpers above do so by themselves), and call ``mark_process_dead(pid)`` when a worker
exits so that its gauges stop counting.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from threading import Thread
from typing import Any, Final, NamedTuple, TypeVar, final
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_asgi_app,
    start_http_server,
)
from prometheus_client import multiprocess as _multiprocess
from prometheus_client.metrics import MetricWrapperBase

from mmcache.errors import MMCacheError, SettingsError

__all__ = [
    "CacheMetrics",
    "CacheNameInUseError",
    "DeferredPush",
    "DIRECTIONS",
    "FAULT_KINDS",
    "GroupSeries",
    "IPC_FALLBACK_REASONS",
    "IPC_POOL_STATES",
    "LATENCY_BUCKETS",
    "LEAK_TIERS",
    "LOOKUP_RESULTS",
    "METRICS_TABLE",
    "MetricInfo",
    "REMOTE_DIRECTIONS",
    "REMOTE_LOOKUP_RESULTS",
    "REMOTE_OPS",
    "REMOTE_WRITE_DROP_REASONS",
    "RemoteSeries",
    "TIERS",
    "asgi_app",
    "exposition_registry",
    "make_multiprocess_registry",
    "mark_process_dead",
    "multiprocess_dir",
    "start_metrics_server",
]

LOOKUP_RESULTS: Final = ("hit_gpu", "hit_cpu", "miss")
TIERS: Final = ("gpu", "cpu")
LEAK_TIERS: Final = ("gpu", "cpu", "ipc")
DIRECTIONS: Final = ("d2h", "h2d")
IPC_POOL_STATES: Final = ("used", "free", "leased")
# Open sets: these are pre-bound (exported at 0 from the start, so rate() sees the
# first event); other values are accepted and bound on first use.
IPC_FALLBACK_REASONS: Final = ("pool_full", "too_large", "disabled", "no_peer")
FAULT_KINDS: Final = ("copy_failed", "oom", "quarantined")
REMOTE_LOOKUP_RESULTS: Final = ("hit", "miss", "rejected", "error", "skipped")
REMOTE_DIRECTIONS: Final = ("read", "written")
REMOTE_OPS: Final = ("get", "put")
REMOTE_WRITE_DROP_REASONS: Final = ("queue_full", "too_large", "unavailable", "error", "closed")

# From a small H2D copy's wait to a copy of hundreds of MB over PCIe; a wait past 1 s is
# a stall and only needs to be counted, which +Inf does.
LATENCY_BUCKETS: Final = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
)


class MetricInfo(NamedTuple):
    """One metric family as exposed: name, type, label names and meaning."""

    name: str
    type: str
    labels: tuple[str, ...]
    meaning: str


METRICS_TABLE: Final[list[MetricInfo]] = [
    MetricInfo(
        "mmcache_tier_bytes",
        "gauge",
        ("cache", "tier"),
        "Bytes held by a tier, resident plus in flight.",
    ),
    MetricInfo(
        "mmcache_tier_capacity_bytes",
        "gauge",
        ("cache", "tier"),
        "Byte budget of a tier (0: the tier is off).",
    ),
    MetricInfo("mmcache_tier_entries", "gauge", ("cache", "tier"), "Entries held by a tier."),
    MetricInfo(
        "mmcache_host_ready_bytes",
        "gauge",
        ("cache",),
        "Bytes of the host arena pinned and serving so far (the cpu capacity once ready).",
    ),
    MetricInfo(
        "mmcache_lookups_total",
        "counter",
        ("cache", "result"),
        "Lookups by result: hit_gpu, hit_cpu or miss.",
    ),
    MetricInfo(
        "mmcache_evictions_total",
        "counter",
        ("cache", "tier"),
        "Entries that left a tier (gpu: offloaded or dropped; cpu: dropped).",
    ),
    MetricInfo(
        "mmcache_dropped_total",
        "counter",
        ("cache",),
        "Entries lost because the host tier could not take them.",
    ),
    MetricInfo(
        "mmcache_pending_copies",
        "gauge",
        ("cache", "direction"),
        "Copies queued and not yet observed complete (d2h: offload, h2d: upload).",
    ),
    MetricInfo(
        "mmcache_copy_bytes_total",
        "counter",
        ("cache", "direction"),
        "Bytes copied between device and host (d2h: offload, h2d: upload).",
    ),
    MetricInfo(
        "mmcache_copy_duration_seconds",
        "histogram",
        ("cache", "direction"),
        "Time from enqueueing a copy to observing its completion.",
    ),
    MetricInfo(
        "mmcache_get_wait_seconds",
        "histogram",
        ("cache",),
        "Time a get waited on pending copies.",
    ),
    MetricInfo(
        "mmcache_leaked_bytes",
        "gauge",
        ("cache", "tier"),
        "Bytes owned by no entry, copy, lease or pool slice (gpu, cpu, ipc); 0 when healthy.",
    ),
    MetricInfo(
        "mmcache_ipc_pool_bytes",
        "gauge",
        ("cache", "state"),
        "IPC pool bytes by state: used, free, leased.",
    ),
    MetricInfo(
        "mmcache_ipc_fallbacks_total",
        "counter",
        ("cache", "reason"),
        "Sends that fell back to host memory, by reason.",
    ),
    MetricInfo(
        "mmcache_ipc_recycle_seconds",
        "histogram",
        ("cache",),
        "Time from an IPC send to its slice's reuse (every receiver done with it).",
    ),
    MetricInfo(
        "mmcache_faults_total",
        "counter",
        ("cache", "kind"),
        "Faults by kind: copy_failed, oom, quarantined, ...",
    ),
    MetricInfo(
        "mmcache_remote_lookups_total",
        "counter",
        ("cache", "result"),
        "Remote tier lookups after local misses: hit, miss, rejected, error or skipped.",
    ),
    MetricInfo(
        "mmcache_remote_errors_total",
        "counter",
        ("cache", "kind"),
        "Remote tier errors by kind: timeout, connection, server or other.",
    ),
    MetricInfo(
        "mmcache_remote_bytes_total",
        "counter",
        ("cache", "direction"),
        "Payload bytes read from or written to the remote tier.",
    ),
    MetricInfo(
        "mmcache_remote_writes_dropped_total",
        "counter",
        ("cache", "reason"),
        "Remote writes dropped: queue_full, too_large, unavailable, error or closed.",
    ),
    MetricInfo(
        "mmcache_remote_queued_bytes",
        "gauge",
        ("cache",),
        "Bytes of remote writes queued and not yet sent.",
    ),
    MetricInfo(
        "mmcache_remote_seconds",
        "histogram",
        ("cache", "op"),
        "Latency of remote tier operations (get, put) that reached the server.",
    ),
    MetricInfo(
        "mmcache_group_misses_total",
        "counter",
        ("cache",),
        "Local hits served as misses because another rank of the cache's group missed them.",
    ),
    MetricInfo(
        "mmcache_group_seconds",
        "histogram",
        ("cache",),
        "Time a lookup's agreement across the group took (its collective, issue to result).",
    ),
]

_INFO: Final = {info.name: info for info in METRICS_TABLE}

_M = TypeVar("_M", bound=MetricWrapperBase)


class CacheNameInUseError(MMCacheError, ValueError):
    """Two live caches tried to report under the same name to one registry."""


def _counter(name: str, registry: CollectorRegistry) -> Counter:
    info = _INFO[name]
    return Counter(name, info.meaning, info.labels, registry=registry)


def _gauge(name: str, registry: CollectorRegistry) -> Gauge:
    info = _INFO[name]
    # livesum: each process reports its own caches, so the sum over live processes is
    # the total, and a dead process's bytes are no longer held by anyone.
    return Gauge(name, info.meaning, info.labels, registry=registry, multiprocess_mode="livesum")


def _histogram(name: str, registry: CollectorRegistry) -> Histogram:
    info = _INFO[name]
    return Histogram(name, info.meaning, info.labels, registry=registry, buckets=LATENCY_BUCKETS)


class _Families:
    """The metric families of one registry, shared by every cache reporting to it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tier_bytes = _gauge("mmcache_tier_bytes", registry)
        self.tier_capacity_bytes = _gauge("mmcache_tier_capacity_bytes", registry)
        self.tier_entries = _gauge("mmcache_tier_entries", registry)
        self.host_ready_bytes = _gauge("mmcache_host_ready_bytes", registry)
        self.lookups = _counter("mmcache_lookups_total", registry)
        self.evictions = _counter("mmcache_evictions_total", registry)
        self.dropped = _counter("mmcache_dropped_total", registry)
        self.pending_copies = _gauge("mmcache_pending_copies", registry)
        self.copy_bytes = _counter("mmcache_copy_bytes_total", registry)
        self.copy_duration = _histogram("mmcache_copy_duration_seconds", registry)
        self.get_wait = _histogram("mmcache_get_wait_seconds", registry)
        self.leaked_bytes = _gauge("mmcache_leaked_bytes", registry)
        self.ipc_pool_bytes = _gauge("mmcache_ipc_pool_bytes", registry)
        self.ipc_fallbacks = _counter("mmcache_ipc_fallbacks_total", registry)
        self.ipc_recycle = _histogram("mmcache_ipc_recycle_seconds", registry)
        self.faults = _counter("mmcache_faults_total", registry)
        self.remote_lookups = _counter("mmcache_remote_lookups_total", registry)
        self.remote_errors = _counter("mmcache_remote_errors_total", registry)
        self.remote_bytes = _counter("mmcache_remote_bytes_total", registry)
        self.remote_dropped = _counter("mmcache_remote_writes_dropped_total", registry)
        self.remote_queued = _gauge("mmcache_remote_queued_bytes", registry)
        self.remote_seconds = _histogram("mmcache_remote_seconds", registry)
        self.group_misses = _counter("mmcache_group_misses_total", registry)
        self.group_seconds = _histogram("mmcache_group_seconds", registry)
        self._owners: dict[str, weakref.ref[CacheMetrics]] = {}
        self._lock = threading.Lock()

    def claim(self, name: str, owner: CacheMetrics) -> None:
        with self._lock:
            ref = self._owners.get(name)
            if ref is not None and ref() is not None:
                raise CacheNameInUseError(
                    f"a cache named {name!r} already reports to this Prometheus registry; "
                    "give each cache its own name, or close() the other cache first"
                )
            self._owners[name] = weakref.ref(owner)

    def release(self, name: str, owner: CacheMetrics) -> None:
        with self._lock:
            ref = self._owners.get(name)
            if ref is not None and ref() is owner:
                del self._owners[name]


# Weak keys: a registry that is gone takes its families along, and a new registry that
# happens to reuse its id() does not inherit them.
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families_for(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        families = _families.get(registry)
        if families is None:
            families = _families[registry] = _Families(registry)
        return families


def multiprocess_dir() -> str | None:
    """Return the prometheus-client multiprocess directory, or None in single-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


@final
class DeferredPush:
    """Runs push at most once per event-loop iteration, however many changes ask for it.

    Gauges of a cache change with every feature; pushing them each time costs more than
    the change. Asked before bind(), after unbind() or from another thread, it pushes
    at once.
    """

    __slots__ = ("_loop", "_push", "_scheduled", "_thread")

    def __init__(self, push: Callable[[], None]) -> None:
        self._push = push
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._scheduled = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Defer to loop, which runs on the calling thread."""
        self._loop, self._thread = loop, threading.get_ident()

    def unbind(self) -> None:
        """Push at once from now on (the owner is closing)."""
        self._loop = None

    def request(self) -> None:
        """Push before the loop's next iteration ends (at once where it cannot defer)."""
        if self._scheduled:
            return
        loop = self._loop
        if loop is None or threading.get_ident() != self._thread:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Push now."""
        self._scheduled = False
        self._push()


def hot_inc(series: Counter | Gauge) -> Callable[[float], None]:
    """series.inc for a caller that counts on every lookup: the inc of the value
    prometheus_client keeps for the series (in one process or in multiprocess mode) where
    it has one, which spares a frame and an observability check per call; else series.inc.
    Its callers never pass a negative amount (which inc would refuse)."""
    inc = getattr(getattr(series, "_value", None), "inc", None)
    return inc if callable(inc) else series.inc


class CacheMetrics:
    """The metrics of one cache; every series carries its `cache` label."""

    def __init__(self, cache_name: str, registry: CollectorRegistry | None = None) -> None:
        if not cache_name:
            raise ValueError("cache_name must be a non-empty string (it is the `cache` label)")
        self._name = cache_name
        self._families = families = _families_for(REGISTRY if registry is None else registry)
        families.claim(cache_name, self)
        self._closed = False
        # (family, label values, child) of every series this cache created, for close().
        self._children: list[tuple[MetricWrapperBase, tuple[str, ...], MetricWrapperBase]] = []
        self._lookups = {r: self._bind(families.lookups, r) for r in LOOKUP_RESULTS}
        self._tier = {
            t: (
                self._bind(families.tier_bytes, t),
                self._bind(families.tier_entries, t),
            )
            for t in TIERS
        }
        self._capacity = {t: self._bind(families.tier_capacity_bytes, t) for t in TIERS}
        self._host_ready = self._bind(families.host_ready_bytes)
        self._evictions = {t: self._bind(families.evictions, t) for t in TIERS}
        self._dropped = self._bind(families.dropped)
        self._copies = {
            d: (
                self._bind(families.pending_copies, d),
                self._bind(families.copy_bytes, d),
                self._bind(families.copy_duration, d),
            )
            for d in DIRECTIONS
        }
        self._get_wait = self._bind(families.get_wait)
        self._ipc_recycle = self._bind(families.ipc_recycle)
        self._leaked = {t: self._bind(families.leaked_bytes, t) for t in LEAK_TIERS}
        self._ipc_pool = {s: self._bind(families.ipc_pool_bytes, s) for s in IPC_POOL_STATES}
        self._fallbacks = {r: self._bind(families.ipc_fallbacks, r) for r in IPC_FALLBACK_REASONS}
        self._faults = {k: self._bind(families.faults, k) for k in FAULT_KINDS}
        self._remote: RemoteSeries | None = None
        self._group: GroupSeries | None = None
        # A cache reusing the name of one that was garbage-collected without close()
        # would otherwise inherit its gauges (pending copies never finished, bytes held).
        for _, _, child in self._children:
            if isinstance(child, Gauge):
                child.set(0)

    @property
    def cache_name(self) -> str:
        """The value of the `cache` label on every series of this cache."""
        return self._name

    def _bind(self, family: _M, *labels: str) -> _M:
        values = (self._name, *labels)
        child = family.labels(*values)
        self._children.append((family, values, child))
        return child

    def lookup(self, result: str) -> None:
        """Count one lookup: result is hit_gpu, hit_cpu or miss."""
        try:
            child = self._lookups[result]
        except KeyError:
            raise _unknown("lookup result", result, LOOKUP_RESULTS) from None
        child.inc()

    def lookup_counter(self, result: str) -> Counter:
        """The series lookup(result) increments, for a caller that counts on its hot path."""
        try:
            return self._lookups[result]
        except KeyError:
            raise _unknown("lookup result", result, LOOKUP_RESULTS) from None

    def eviction_counter(self, tier: str) -> Counter:
        """The series eviction(tier) increments, for a caller that counts on its hot path."""
        try:
            return self._evictions[tier]
        except KeyError:
            raise _unknown("tier", tier, TIERS) from None

    def set_tier(self, tier: str, nbytes: int, entries: int) -> None:
        """Report a tier's bytes (resident plus in flight) and entries."""
        try:
            nbytes_gauge, entries_gauge = self._tier[tier]
        except KeyError:
            raise _unknown("tier", tier, TIERS) from None
        self._set(nbytes_gauge, nbytes)
        self._set(entries_gauge, entries)

    def set_capacity(self, tier: str, nbytes: int) -> None:
        """Report a tier's byte budget."""
        try:
            child = self._capacity[tier]
        except KeyError:
            raise _unknown("tier", tier, TIERS) from None
        self._set(child, nbytes)

    def set_host_ready(self, nbytes: int) -> None:
        """Report the bytes of the host arena pinned and serving so far."""
        self._set(self._host_ready, nbytes)

    def eviction(self, tier: str, count: int = 1) -> None:
        """Count entries leaving a tier (gpu: offloaded or dropped; cpu: dropped)."""
        try:
            child = self._evictions[tier]
        except KeyError:
            raise _unknown("tier", tier, TIERS) from None
        child.inc(count)

    def dropped(self, count: int = 1) -> None:
        """Count features lost because the host tier could not take them (or a copy failed)."""
        self._dropped.inc(count)

    def copy_started(self, direction: str, count: int = 1) -> None:
        """Count copies of count features as pending: direction is d2h or h2d."""
        series = self._copies.get(direction)  # copy_series, inline: once per copy queued
        if series is None:
            raise _unknown("copy direction", direction, DIRECTIONS)
        series[0].inc(count)

    def copy_finished(self, direction: str, nbytes: int, seconds: float, count: int = 1) -> None:
        """Record one copy observed complete: count features, nbytes in all, its latency."""
        series = self._copies.get(direction)  # copy_series, inline: once per copy landed
        if series is None:
            raise _unknown("copy direction", direction, DIRECTIONS)
        pending, copied, duration = series
        pending.dec(count)
        copied.inc(nbytes)
        duration.observe(seconds)

    def copy_on_reader_stream(self, direction: str, nbytes: int) -> None:
        """Count the bytes of a copy queued on its reader's stream: never pending to the
        cache (the reader's own stream orders it), so it has no latency of ours either."""
        self.copy_series(direction)[1].inc(nbytes)

    def copy_series(self, direction: str) -> tuple[Gauge, Counter, Histogram]:
        """The pending, bytes and duration series of direction (d2h or h2d)."""
        try:
            return self._copies[direction]
        except KeyError:
            raise _unknown("copy direction", direction, DIRECTIONS) from None

    def get_wait(self, seconds: float) -> None:
        """Record how long a get waited on pending copies."""
        self._get_wait.observe(seconds)

    def ipc_recycled(self, seconds: float) -> None:
        """Record how long an IPC slice was held, from its send to its reuse."""
        self._ipc_recycle.observe(seconds)

    def set_leaked(self, tier: str, nbytes: int) -> None:
        """Report bytes owned by nothing in a ledger: tier is gpu, cpu or ipc."""
        try:
            child = self._leaked[tier]
        except KeyError:
            raise _unknown("leak tier", tier, LEAK_TIERS) from None
        self._set(child, nbytes)

    def ipc_fallback(self, reason: str) -> None:
        """Count a send that fell back to host memory."""
        child = self._fallbacks.get(reason)
        if child is None:
            child = self._fallbacks[reason] = self._bind(self._families.ipc_fallbacks, reason)
        child.inc()

    def set_ipc_pool(self, state: str, nbytes: int) -> None:
        """Report IPC pool bytes in a state: used, free or leased."""
        try:
            child = self._ipc_pool[state]
        except KeyError:
            raise _unknown("IPC pool state", state, IPC_POOL_STATES) from None
        self._set(child, nbytes)

    def fault(self, kind: str) -> None:
        """Count a fault (copy_failed, oom, quarantined, ...)."""
        child = self._faults.get(kind)
        if child is None:
            child = self._faults[kind] = self._bind(self._families.faults, kind)
        child.inc()

    def remote(self) -> RemoteSeries:
        """The remote tier's series of this cache (bound on first call: only caches with a
        remote tier export them)."""
        if self._remote is None:
            self._remote = RemoteSeries(self)
        return self._remote

    def group(self) -> GroupSeries:
        """The group agreement's series of this cache (bound on first call: only caches
        with a process group export them)."""
        if self._group is None:
            self._group = GroupSeries(self)
        return self._group

    def bind(self, family: _M, *labels: str) -> _M:
        """family's series for this cache and labels, removed by close()."""
        return self._bind(family, *labels)

    @property
    def families(self) -> _Families:
        """The metric families of this cache's registry."""
        return self._families

    def set_gauge(self, gauge: Gauge, value: float) -> None:
        """Set one of this cache's gauges (ignored once closed)."""
        self._set(gauge, value)

    def close(self) -> None:
        """Remove this cache's series from the registry; later calls change nothing visible."""
        if self._closed:
            return
        self._closed = True
        if multiprocess_dir() is None:
            for family, values, _ in self._children:
                family.remove(*values)
        else:
            # Series live in the per-process files until the process is marked dead, and
            # prometheus-client cannot remove them there; zeroed gauges add nothing to a sum.
            for _, _, child in self._children:
                if isinstance(child, Gauge):
                    child.set(0)
        self._families.release(self._name, self)

    def _set(self, gauge: Gauge, value: float) -> None:
        # A report queued before close (a deferred push) must not bring back zeroed series.
        if not self._closed:
            gauge.set(value)


@final
class RemoteSeries:
    """The remote tier's series of one cache, bound once (exported at 0 from the start)."""

    def __init__(self, metrics: CacheMetrics) -> None:
        families = metrics.families
        bind = metrics.bind
        self._metrics = metrics
        self.lookups = {r: bind(families.remote_lookups, r) for r in REMOTE_LOOKUP_RESULTS}
        self._errors = {k: bind(families.remote_errors, k) for k in _REMOTE_ERROR_KINDS}
        self.bytes = {d: bind(families.remote_bytes, d) for d in REMOTE_DIRECTIONS}
        self.dropped = {r: bind(families.remote_dropped, r) for r in REMOTE_WRITE_DROP_REASONS}
        self._queued = bind(families.remote_queued)
        self.seconds = {op: bind(families.remote_seconds, op) for op in REMOTE_OPS}
        metrics.set_gauge(self._queued, 0)

    def error(self, kind: str) -> None:
        """Count one remote error of kind."""
        child = self._errors.get(kind)
        if child is None:
            child = self._errors[kind] = self._metrics.bind(
                self._metrics.families.remote_errors, kind
            )
        child.inc()

    def set_queued(self, nbytes: int) -> None:
        """Report the bytes of remote writes queued."""
        self._metrics.set_gauge(self._queued, nbytes)


@final
class GroupSeries:
    """The group agreement's series of one cache, bound once (exported at 0 from the start)."""

    def __init__(self, metrics: CacheMetrics) -> None:
        families = metrics.families
        self.misses = metrics.bind(families.group_misses)
        self.seconds = metrics.bind(families.group_seconds)


# The remote tier's error kinds (mmcache.remote.faults.ERROR_KINDS), pre-bound.
_REMOTE_ERROR_KINDS: Final = ("timeout", "connection", "server", "other")


def _unknown(what: str, value: str, expected: tuple[str, ...]) -> ValueError:
    return ValueError(f"unknown {what} {value!r}; expected one of {', '.join(expected)}")


def make_multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """Return a registry that collects every process's metrics from the multiprocess directory."""
    path = path or multiprocess_dir()
    if not path or not os.path.isdir(path):
        raise SettingsError(
            f"PROMETHEUS_MULTIPROC_DIR={path!r} is not a directory; set it to an empty "
            "directory in every process before prometheus_client is first imported"
        )
    registry = CollectorRegistry()
    # prometheus-client leaves its multiprocess module unannotated.
    _multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return registry


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Drop an exited process's live gauges; its counters and histograms stay."""
    path = path or multiprocess_dir()
    if not path:
        raise SettingsError(
            "mark_process_dead needs PROMETHEUS_MULTIPROC_DIR (or path=): multiprocess mode is off"
        )
    _multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def exposition_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Return the registry to expose: the given one, else the multiprocess or default one."""
    if registry is not None:
        return registry
    return make_multiprocess_registry() if multiprocess_dir() else REGISTRY


def start_metrics_server(
    port: int, registry: CollectorRegistry | None = None, addr: str = "127.0.0.1"
) -> tuple[WSGIServer, Thread]:
    """Serve /metrics on addr:port from a daemon thread; shut down with server.shutdown()."""
    return start_http_server(port, addr=addr, registry=exposition_registry(registry))


_SERVING: dict[tuple[str, int], tuple[WSGIServer, Thread]] = {}


def ensure_metrics_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, Thread]:
    """Start the default-registry /metrics server on addr:port once per process."""
    key = (addr, port)
    if key not in _SERVING:
        _SERVING[key] = start_metrics_server(port, addr=addr)
    return _SERVING[key]


def asgi_app(registry: CollectorRegistry | None = None) -> Callable[..., Any]:
    """Return an ASGI app serving the metrics, to mount at /metrics."""
    app: Callable[..., Any] = make_asgi_app(exposition_registry(registry))
    return app

"""Counters: the cache's stats counters, each moved together with its metric."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Any, Literal, final

from mmcache.errors import DeviceOutOfMemoryError
from mmcache.metrics import CacheMetrics, hot_inc

__all__ = ["COUNTER_NAMES", "Counters"]

log = logging.getLogger("mmcache")

#: the CacheStats fields the counters fill
COUNTER_NAMES = (
    "hits_gpu",
    "hits_cpu",
    "misses",
    "evictions_gpu",
    "evictions_cpu",
    "dropped",
    "d2h_bytes",
    "h2d_bytes",
    "rejected",
    "promotions",
    "copy_failures",
    "alloc_failures",
)


@final
class Counters:
    """What the cache has done so far, for stats() and Prometheus alike.

    Every method moves a stats counter and its metric in one step, so the two cannot
    disagree; the counters are read as attributes and written only here.
    """

    __slots__ = (
        "_counting_oom",
        "_d2h_pending",
        "_evicted_cpu",
        "_evicted_gpu",
        "_hit_cpu",
        "_hit_gpu",
        "_metrics",
        "_miss",
        "alloc_failures",
        "copy_failures",
        "d2h_bytes",
        "dropped",
        "evictions_cpu",
        "evictions_gpu",
        "h2d_bytes",
        "hits_cpu",
        "hits_gpu",
        "misses",
        "pending_d2h",
        "pending_h2d",
        "promotions",
        "rejected",
    )

    def __init__(self, metrics: CacheMetrics) -> None:
        self._metrics = metrics
        self._counting_oom = _CountingOom(self)
        # Bound series: a lookup is counted on every get, with no name to look up.
        self._hit_gpu = hot_inc(metrics.lookup_counter("hit_gpu"))
        self._hit_cpu = hot_inc(metrics.lookup_counter("hit_cpu"))
        self._miss = hot_inc(metrics.lookup_counter("miss"))
        self._evicted_gpu = hot_inc(metrics.eviction_counter("gpu"))
        self._evicted_cpu = hot_inc(metrics.eviction_counter("cpu"))
        self._d2h_pending = hot_inc(metrics.copy_series("d2h")[0])
        self.hits_gpu = self.hits_cpu = self.misses = 0
        self.evictions_gpu = self.evictions_cpu = self.dropped = self.rejected = 0
        self.d2h_bytes = self.h2d_bytes = self.promotions = 0
        self.copy_failures = self.alloc_failures = 0
        self.pending_d2h = self.pending_h2d = 0

    @property
    def pending_copies(self) -> int:
        """Copies queued (both directions) whose completion is not handled yet."""
        return self.pending_d2h + self.pending_h2d

    def as_dict(self) -> dict[str, Any]:
        """The counters by their CacheStats field names."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def hit_gpu(self) -> None:
        """A get found its feature on the device (resident or being offloaded)."""
        self.hits_gpu += 1
        self._hit_gpu(1)

    def hit_cpu(self) -> None:
        """A get found its feature only in the host tier."""
        self.hits_cpu += 1
        self._hit_cpu(1)

    def looked_up(self, gpu: int, cpu: int, missed: int) -> None:
        """A batch of lookups: gpu and cpu hits, and misses (one call for a get_many)."""
        if gpu:
            self.hits_gpu += gpu
            self._hit_gpu(gpu)
        if cpu:
            self.hits_cpu += cpu
            self._hit_cpu(cpu)
        if missed:
            self.misses += missed
            self._miss(missed)

    def miss(self) -> None:
        """A get found nothing."""
        self.misses += 1
        self._miss(1)

    def evicted_gpu(self, features: int) -> None:
        """Features that left the GPU tier to make room (offloaded or dropped)."""
        self.evictions_gpu += features
        self._evicted_gpu(features)

    def evicted_cpu(self, features: int) -> None:
        """Features dropped from the host tier to make room."""
        self.evictions_cpu += features
        self._evicted_cpu(features)

    def lost(self, features: int) -> None:
        """Features the cache lost: the host tier could not take them, or a copy failed."""
        self.dropped += features
        self._metrics.dropped(features)

    def refused(self, features: int) -> None:
        """Features a put with wait=False dropped for lack of room."""
        self.rejected += features

    def promoted(self, features: int = 1) -> None:
        """Host-tier hits moved back to the GPU tier."""
        self.promotions += features

    def offloaded(self, nbytes: int) -> None:
        """Bytes an offload copy moved to the host tier."""
        self.d2h_bytes += nbytes

    def uploaded(self, nbytes: int) -> None:
        """Bytes an upload copy moved to the device."""
        self.h2d_bytes += nbytes

    def uploaded_on_reader_stream(self, nbytes: int) -> None:
        """An upload queued on the reader's stream: counted as moved once queued."""
        self.h2d_bytes += nbytes
        self._metrics.copy_on_reader_stream("h2d", nbytes)

    def copy_failed(self, what: str, key: Hashable | None, exc: BaseException | None) -> None:
        """A device copy that failed (every direction), for stats and operators."""
        # A string, not the exception: a log handler keeping the record would otherwise keep
        # its traceback, and every frame and tensor in it, alive.
        log.warning("%s copy of %r failed: %s", what, key, str(exc))
        self.copy_failures += 1
        self._metrics.fault("copy_failed")

    def alloc_failed(self) -> None:
        """A device allocation that failed for lack of memory."""
        self.alloc_failures += 1
        self._metrics.fault("oom")

    def counting_oom(self) -> _CountingOom:
        """Count a device allocation that fails for lack of memory, then let it raise."""
        return self._counting_oom

    def quarantined(self) -> None:
        """A copy past copy_timeout_s whose bytes stay reserved."""
        self._metrics.fault("quarantined")

    def offload_started(self, features: int) -> None:
        """An offload copy of features queued (copy_started("d2h"), on the put path)."""
        self.pending_d2h += features
        self._d2h_pending(features)

    def copy_started(self, direction: str, features: int = 1) -> None:
        """A copy of features queued: direction is d2h or h2d."""
        if direction == "d2h":
            self.pending_d2h += features
        else:
            self.pending_h2d += features
        self._metrics.copy_started(direction, features)

    def copy_finished(self, direction: str, nbytes: int, started: float, features: int = 1) -> None:
        """A copy queued at started (perf_counter) of features, nbytes in all, is done."""
        if direction == "d2h":
            self.pending_d2h -= features
        else:
            self.pending_h2d -= features
        self._metrics.copy_finished(direction, nbytes, time.perf_counter() - started, features)

    def waited(self, seconds: float) -> None:
        """A get waited seconds on pending copies (0: it did not wait)."""
        if seconds:
            self._metrics.get_wait(seconds)


@final
class _CountingOom:
    """counting_oom()'s context manager: one per Counters, reused (it keeps no state);
    a class, since a generator-based one costs a generator per upload."""

    __slots__ = ("_counters",)

    def __init__(self, counters: Counters) -> None:
        self._counters = counters

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> Literal[False]:
        if kind is not None and issubclass(kind, DeviceOutOfMemoryError):
            self._counters.alloc_failed()
        return False  # let it raise

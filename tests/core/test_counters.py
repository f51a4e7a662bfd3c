"""Counters: each counter and its metric move together, through Counters' own methods."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from mmcache.core.counters import COUNTER_NAMES, Counters
from mmcache.metrics import CacheMetrics


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, {"cache": "c", **labels})
    return 0.0 if v is None else v


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def counters(reg: CollectorRegistry) -> Counters:
    return Counters(CacheMetrics("c", reg))


@pytest.mark.parametrize(
    ("count", "field", "metric", "labels", "n"),
    [
        (lambda c: c.hit_gpu(), "hits_gpu", "mmcache_lookups_total", {"result": "hit_gpu"}, 1),
        (lambda c: c.hit_cpu(), "hits_cpu", "mmcache_lookups_total", {"result": "hit_cpu"}, 1),
        (lambda c: c.miss(), "misses", "mmcache_lookups_total", {"result": "miss"}, 1),
        (
            lambda c: c.evicted_gpu(3),
            "evictions_gpu",
            "mmcache_evictions_total",
            {"tier": "gpu"},
            3,
        ),
        (
            lambda c: c.evicted_cpu(2),
            "evictions_cpu",
            "mmcache_evictions_total",
            {"tier": "cpu"},
            2,
        ),
        (lambda c: c.lost(4), "dropped", "mmcache_dropped_total", {}, 4),
        (lambda c: c.alloc_failed(), "alloc_failures", "mmcache_faults_total", {"kind": "oom"}, 1),
        (
            lambda c: c.copy_failed("offload", "k", None),
            "copy_failures",
            "mmcache_faults_total",
            {"kind": "copy_failed"},
            1,
        ),
    ],
)
def test_counter_and_metric_move_together(
    reg: CollectorRegistry,
    counters: Counters,
    count: Callable[[Counters], None],
    field: str,
    metric: str,
    labels: dict[str, str],
    n: int,
) -> None:
    count(counters)
    count(counters)
    assert getattr(counters, field) == 2 * n
    assert _value(reg, metric, **labels) == 2 * n
    others = {k: v for k, v in counters.as_dict().items() if k != field}
    assert set(others.values()) == {0}


def test_copies_pending_until_finished(reg: CollectorRegistry, counters: Counters) -> None:
    started = time.perf_counter()
    counters.copy_started("d2h", 3)
    counters.copy_started("h2d")
    assert counters.pending_copies == 4
    assert _value(reg, "mmcache_pending_copies", direction="d2h") == 3
    counters.copy_finished("d2h", 1024, started, 3)
    counters.copy_finished("h2d", 512, started)
    assert counters.pending_copies == 0
    assert _value(reg, "mmcache_pending_copies", direction="d2h") == 0
    assert _value(reg, "mmcache_copy_bytes_total", direction="d2h") == 1024
    assert _value(reg, "mmcache_copy_bytes_total", direction="h2d") == 512


def test_counters_without_a_metric(counters: Counters) -> None:
    counters.refused(2)
    counters.promoted()
    counters.offloaded(100)
    counters.uploaded(50)
    assert counters.as_dict() == {
        **dict.fromkeys(COUNTER_NAMES, 0),
        "rejected": 2,
        "promotions": 1,
        "d2h_bytes": 100,
        "h2d_bytes": 50,
    }

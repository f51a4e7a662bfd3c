"""In prometheus-client multiprocess mode, series add up across processes and dead ones drop out."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from mmcache.metrics import (
    CacheMetrics,
    make_multiprocess_registry,
    mark_process_dead,
    multiprocess_dir,
)


def _worker(gpu_bytes: int, hits: int, closed_cache: str | None) -> None:
    """Report like one serving process would, then exit without cleaning up."""
    # Anything prometheus-client warns about (e.g. removing series in multiprocess mode)
    # must fail the worker, as it would fail the parent's tests.
    warnings.simplefilter("error")
    from prometheus_client import values

    # The environment came with the spawn, before this process imported prometheus_client.
    assert multiprocess_dir() is not None
    assert values.ValueClass is not values.MutexValue, "not in multiprocess mode"
    metrics = CacheMetrics("vision")
    metrics.set_capacity("gpu", 1000)
    metrics.set_tier("gpu", gpu_bytes, 1)
    for _ in range(hits):
        metrics.lookup("hit_gpu")
    metrics.lookup("miss")
    metrics.copy_started("d2h")
    metrics.copy_finished("d2h", 64, 0.002)
    if closed_cache is not None:
        other = CacheMetrics(closed_cache)
        other.set_tier("cpu", 777, 7)
        other.copy_started("h2d")
        other.close()
        # Gauge reports queued before close (a deferred push) land after it: no effect.
        other.set_tier("cpu", 555, 5)
        other.set_capacity("cpu", 555)
        other.set_leaked("ipc", 555)
        other.set_ipc_pool("used", 555)


def process_pid(process: multiprocessing.process.BaseProcess) -> int:
    process.join(60)
    assert process.exitcode == 0, f"worker exited with {process.exitcode}"
    assert process.pid is not None
    return process.pid


def test_series_add_up_across_processes_and_dead_gauges_drop_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Set for the spawned workers: they import prometheus_client with it already set.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    first = ctx.Process(target=_worker, args=(100, 3, None))
    second = ctx.Process(target=_worker, args=(250, 2, "closed"))
    first.start()
    second.start()
    first_pid = process_pid(first)
    process_pid(second)
    assert list(tmp_path.glob("*.db")), "workers wrote no multiprocess files"

    def get(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    registry = make_multiprocess_registry(str(tmp_path))
    assert get(registry, "mmcache_tier_bytes", cache="vision", tier="gpu") == 350
    assert get(registry, "mmcache_tier_capacity_bytes", cache="vision", tier="gpu") == 2000
    assert get(registry, "mmcache_lookups_total", cache="vision", result="hit_gpu") == 5
    assert get(registry, "mmcache_lookups_total", cache="vision", result="miss") == 2
    assert get(registry, "mmcache_copy_bytes_total", cache="vision", direction="d2h") == 128
    assert get(registry, "mmcache_pending_copies", cache="vision", direction="d2h") == 0
    count = "mmcache_copy_duration_seconds_count"
    assert get(registry, count, cache="vision", direction="d2h") == 2
    # A closed cache's series stay in the files, but its gauges no longer add anything.
    assert get(registry, "mmcache_tier_bytes", cache="closed", tier="cpu") in (0, None)
    assert get(registry, "mmcache_pending_copies", cache="closed", direction="h2d") in (0, None)
    for name, labels in (
        ("mmcache_tier_capacity_bytes", {"tier": "cpu"}),
        ("mmcache_leaked_bytes", {"tier": "ipc"}),
        ("mmcache_ipc_pool_bytes", {"state": "used"}),
    ):
        assert get(registry, name, cache="closed", **labels) in (0, None), name

    mark_process_dead(first_pid)  # reads PROMETHEUS_MULTIPROC_DIR
    registry = make_multiprocess_registry(str(tmp_path))
    assert get(registry, "mmcache_tier_bytes", cache="vision", tier="gpu") == 250
    assert get(registry, "mmcache_tier_capacity_bytes", cache="vision", tier="gpu") == 1000
    assert get(registry, "mmcache_lookups_total", cache="vision", result="hit_gpu") == 5
    assert get(registry, count, cache="vision", direction="d2h") == 2
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)

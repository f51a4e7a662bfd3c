"""Where the event loop's time goes on the put -> offload -> landing path (CUDA).

Wraps the cache's eviction, offload, landing and reaping steps and the phases of
`CudaDevice.copy_d2h_batch` with timers, runs a put loop that forces eviction (GPU
tier a quarter of the workload), and prints each step's time per call and per
feature, next to the main thread's CPU time over wall time.

    python benchmarks/loop_phases.py --mb 1 --count 2048 --group 8
    python benchmarks/loop_phases.py --mb 0.0625 --count 16384 --group 128
    python benchmarks/loop_phases.py --mb 0.0625 --count 16384 --group 128 --split
    python benchmarks/loop_phases.py --mb 1 --count 2048 --group 8 --untimed
    python benchmarks/loop_phases.py --mb 1 --count 2048 --burst-mb 8

--burst-mb B yields to the event loop after each B MiB of features, as
`bench_offload.py`'s producers do; a second table then gives the time of every
callback the loop ran (task steps, timers, reports from other threads) and of its
waits in the selector, per loop iteration and per feature (not with --untimed).

Steps nest (eviction includes the offloads it starts, which include the device
phases; a drain of landings includes the offloads it completes). CUDA only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    SelectorWaits,
    burst_features,
    concat_batches,
    markdown_table,
    percentile,
    put_in_groups,
    put_in_splits,
)

import mmcache.cache  # noqa: E402
import mmcache.device.cuda as cuda_device  # noqa: E402
import mmcache.device.cuda_driver as cuda_driver  # noqa: E402
import mmcache.waiting  # noqa: E402
from mmcache import CacheSettings, FeatureCache  # noqa: E402

HIDDEN = 4096
clock = time.perf_counter
timings: dict[str, list[float]] = {}


def _add(name: str, seconds: float) -> None:
    timings.setdefault(name, []).append(seconds)


def _timed(owner: Any, attribute: str, label: str) -> None:
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return original(*args, **kwargs)
        finally:
            _add(label, clock() - t0)

    setattr(owner, attribute, wrapper)


def _timed_async(owner: Any, attribute: str, label: str) -> None:
    """_timed for a coroutine method: the whole await, its suspensions included."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return await original(*args, **kwargs)
        finally:
            _add(label, clock() - t0)

    setattr(owner, attribute, wrapper)


class LoopAccounting:
    """Times every callback the event loop runs, by what it calls, and its selector waits."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[float]] = {}
        self._selects: SelectorWaits | None = None
        self._original_run = asyncio.events.Handle._run

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        callbacks = self.callbacks
        original = self._original_run

        def run(handle: asyncio.Handle) -> None:
            t0 = clock()
            try:
                original(handle)
            finally:
                callbacks.setdefault(_callback_name(handle), []).append(clock() - t0)

        asyncio.events.Handle._run = run  # type: ignore[method-assign,assignment]
        self._selects = SelectorWaits(loop)
        self._selects.start()

    def uninstall(self) -> None:
        asyncio.events.Handle._run = self._original_run  # type: ignore[method-assign]
        if self._selects is not None:
            self._selects.stop()

    def table(self, count: int) -> list[list[Any]]:
        selects = self._selects.waits if self._selects is not None else []
        iterations = max(1, len(selects))
        rows: list[list[Any]] = [
            [
                "selector waits (one per loop iteration)",
                len(selects),
                f"{sum(selects) * 1e6 / iterations:.2f}",
                f"{sum(selects) * 1e6 / count:.2f}",
            ]
        ]
        for name, values in sorted(self.callbacks.items(), key=lambda kv: -sum(kv[1])):
            rows.append(
                [
                    name,
                    len(values),
                    f"{sum(values) * 1e6 / iterations:.2f}",
                    f"{sum(values) * 1e6 / count:.2f}",
                ]
            )
        return rows


def _callback_name(handle: asyncio.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return f"task step: {owner.get_coro().__qualname__}"  # type: ignore[union-attr]
    name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
    return f"{name} ({'timer' if isinstance(handle, asyncio.TimerHandle) else 'soon'})"


def instrument() -> None:
    """Install the timers (process-wide: this script only)."""
    device_cls = cuda_device.CudaDevice
    _timed(device_cls, "copy_d2h_batch", "device: batched copy (all of it)")
    _timed(device_cls, "_packed_runs", "device: checks and runs")
    _timed(device_cls, "_order_after", "device: order after producers")
    _timed(cuda_device, "_gather", "device: gather (torch.cat)")
    _timed(cuda_driver.BatchCopier, "copy", "device: cuMemcpyBatchAsync call")
    _timed(device_cls, "_copy_bytes", "device: copy_ call")
    _timed(device_cls, "_record_on", "device: record a fence (a put's too)")
    cache_cls = mmcache.cache.FeatureCache
    _timed(cache_cls, "_evict_gpu_for", "cache: evict (offloads included)")
    _timed(cache_cls, "_start_offloads", "cache: start offloads (device included)")
    _timed(cache_cls, "_offloads_done", "cache: landed batches")
    _timed(cache_cls, "_pack", "cache: pack a put_many group (device included)")
    _timed(cache_cls, "_reap_packed", "cache: let go of packed values")
    _timed(cache_cls, "_reap_landed", "cache: reap landings on the loop")
    _timed_async(cache_cls, "_wait_gpu", "cache: a put waits for room (suspended)")
    _timed(mmcache.waiting.FenceWatcher, "_drain", "loop: landings from the waiter")
    _timed(cuda_device._FenceWaiters, "submit", "device: hand fence to waiter")


async def run(
    mb: float, count: int, group: int, split: bool, burst_mb: float | None, timed: bool
) -> tuple[dict[str, float], list[list[Any]], list[list[Any]]]:
    rows = max(1, int(mb * 2**20 / (HIDDEN * 2)))
    features: list[torch.Tensor | None] = [
        torch.full((rows, HIDDEN), float(i % 7), dtype=torch.bfloat16, device="cuda")
        for i in range(count)
    ]
    batches = concat_batches(features, group) if split else []
    total = rows * HIDDEN * 2 * count
    settings = CacheSettings(gpu_cache_mb=total / 4 / 2**20, cpu_cache_mb=total * 1.1 / 2**20)
    async with FeatureCache(settings, "cuda", registry=CollectorRegistry()) as cache:
        await cache.wait_host_ready(timeout=60)
        # Untimed warm-up through the same path: the first gather and copy load their
        # kernels and grow the D2H stream's memory pool (tens of ms, once per process).
        for i in range(count // 2):
            await cache.put(
                ("warm-up", i), torch.full((rows, HIDDEN), 1.0, dtype=torch.bfloat16, device="cuda")
            )
        await cache.drain()
        for i in range(count // 2):
            cache.discard(("warm-up", i))
        await cache.drain()
        torch.cuda.synchronize()
        offloaded_before = cache.stats().d2h_bytes
        burst = 0 if burst_mb is None else burst_features(burst_mb * 2**20, rows * HIDDEN * 2)
        accounting = LoopAccounting() if burst_mb is not None and timed else None
        if accounting is not None:
            accounting.install(asyncio.get_running_loop())
        timings.clear()
        start, cpu0 = clock(), time.thread_time()
        try:
            if split:
                put_s = await put_in_splits(cache, batches, group, burst=burst > 0)
            else:
                put_s = await put_in_groups(cache, features, group, burst=burst)
            await cache.drain()
        finally:
            if accounting is not None:
                accounting.uninstall()
        wall, cpu = clock() - start, time.thread_time() - cpu0
        stats = cache.stats()
    summary = {
        "gbps": (stats.d2h_bytes - offloaded_before) / wall / 1e9,
        "us_per_feature": wall / count * 1e6,
        "main_thread_cpu_over_wall": cpu / wall,
    }
    table: list[list[Any]] = []
    for name, values in sorted({"put call": put_s, **timings}.items(), key=lambda kv: -sum(kv[1])):
        us = [v * 1e6 for v in values]
        table.append(
            [
                name,
                len(us),
                f"{percentile(us, 50):.1f}",
                f"{percentile(us, 90):.1f}",
                f"{sum(us) / count:.2f}",
            ]
        )
    return summary, table, accounting.table(count) if accounting is not None else []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=1.0, help="feature size in MiB")
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--group", type=int, default=1, help="features per put_many call")
    parser.add_argument("--split", action="store_true", help="put_split batches of --group")
    parser.add_argument(
        "--untimed",
        action="store_true",
        help="no step timers and the collector off: the put loop's own rate, to compare versions",
    )
    parser.add_argument(
        "--burst-mb",
        type=float,
        default=None,
        help="yield to the event loop after each this many MiB of features, and time the "
        "loop's callbacks (default: never yield)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("loop_phases: needs a CUDA device")
        return 0
    gc.collect()
    gc.freeze()  # torch's start-up objects: as bench_offload.py and serving engines do
    if args.untimed:
        gc.disable()  # a full collection inside a short loop is noise for a comparison
    else:
        instrument()
    if args.burst_mb is not None and not args.burst_mb >= 0:
        parser.error("--burst-mb must be 0 or more")
    summary, table, loop_table = asyncio.run(
        run(args.mb, args.count, args.group, args.split, args.burst_mb, not args.untimed)
    )
    call = "put_split" if args.split else "put_many"
    print(
        f"{args.count} x {args.mb:g} MiB, {call} of {args.group}: {summary['gbps']:.2f} GB/s "
        f"offloaded, {summary['us_per_feature']:.1f} µs per feature, main thread CPU/wall "
        f"{summary['main_thread_cpu_over_wall']:.2f}"
    )
    headers = ["step", "calls", "p50 µs", "p90 µs", "µs per feature"]
    print(markdown_table(headers, table))
    if loop_table:
        print()
        print(
            markdown_table(
                ["loop callback", "calls", "µs per iteration", "µs per feature"], loop_table
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

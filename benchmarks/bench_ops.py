"""Python overhead per cache operation: GPU-tier hit (a feature's first read, and a read
after it), miss, put without eviction, and the batch calls per feature (put_many; get_many
of the same GPU-tier hits get reads).

Runs on the simulator by default (no copies on these paths, so it measures the
cache's own bookkeeping, metrics included), or on CUDA with --device cuda.
Prints median and p99 in microseconds, next to the cost of a bare dict lookup
and of an `await` of a trivial coroutine measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import latency_table, summary_us, target_verdict, write_json

from mmcache import CacheSettings, FeatureCache

HIT_TARGET_US = 10.0
GROUP = 64  # features per put_many call
MANY = 16  # keys per get_many call: a request's images
MANY_TARGET = 0.6  # get_many's time per key over get's (issue "Serving path v3")


async def _trivial() -> None:
    return None


async def measure(device: str, n: int) -> dict[str, dict[str, float]]:
    """Time n calls of each operation, one call at a time."""
    settings = CacheSettings(gpu_cache_mb=256, cpu_cache_mb=16)
    keys = [("img", i) for i in range(n)]
    where = "cpu" if device == "sim" else device  # the simulator's device memory is the CPU's
    values = [torch.ones(16, 64, device=where) for _ in range(n)]
    results: dict[str, list[float]] = {
        "put (no eviction)": [],
        f"put_many of {GROUP}, per feature": [],
        "get GPU hit, first read": [],
        "get GPU hit": [],
        f"get_many of {MANY} GPU hits, per key": [],
        "get miss": [],
    }
    grouped = [torch.ones(16, 64, device=where) for _ in range(n)]
    baseline: dict[str, list[float]] = {"dict lookup": [], "await trivial coroutine": []}
    cache = FeatureCache(settings, device=device, registry=CollectorRegistry())
    async with cache:
        clock = time.perf_counter
        gc.disable()  # a collection inside one timed call is noise, not cache overhead
        try:
            for key in keys:
                value = values.pop()
                t0 = clock()
                await cache.put(key, value)
                results["put (no eviction)"].append(clock() - t0)
            del value
            for first in range(0, n, GROUP):
                items = [(("group", i), grouped[i]) for i in range(first, min(first + GROUP, n))]
                t0 = clock()
                await cache.put_many(items)
                results[f"put_many of {GROUP}, per feature"].append((clock() - t0) / len(items))
            del items, grouped
            # A feature's first read marks its block used on the reader's stream; the
            # reads after it, the steady state of a serving cache, do not (both gets and
            # get_many below are such).
            for key in keys:
                t0 = clock()
                await cache.get(key)
                results["get GPU hit, first read"].append(clock() - t0)
            for key in keys:
                t0 = clock()
                await cache.get(key)
                results["get GPU hit"].append(clock() - t0)
            for first in range(0, n - MANY + 1, MANY):
                batch = keys[first : first + MANY]
                t0 = clock()
                await cache.get_many(batch)
                results[f"get_many of {MANY} GPU hits, per key"].append((clock() - t0) / MANY)
            for i in range(n):
                t0 = clock()
                await cache.get(("absent", i))
                results["get miss"].append(clock() - t0)
            table = dict.fromkeys(keys, 1)
            for key in keys:
                t0 = clock()
                table.get(key)
                baseline["dict lookup"].append(clock() - t0)
            for _ in range(n):
                t0 = clock()
                await _trivial()
                baseline["await trivial coroutine"].append(clock() - t0)
        finally:
            gc.enable()
        stats = cache.stats()
        many = n // MANY * MANY
        assert stats.hits_gpu == 2 * n + many and stats.misses == n and stats.evictions_gpu == 0
    return {name: summary_us(v) for name, v in {**results, **baseline}.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="sim", help="sim (default) or cuda")
    parser.add_argument("--n", type=int, default=20_000, help="calls per operation")
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_ops: no CUDA device; run with --device sim")
        return 0
    n = 2_000 if args.quick else args.n
    figures = asyncio.run(measure(args.device, n))
    print(f"bench_ops on {args.device}: Python overhead per call, {n} calls each")
    print(latency_table(figures, "operation"))
    print(target_verdict("GPU-tier hit", figures["get GPU hit"]["p50_us"], HIT_TARGET_US))
    per_key = figures[f"get_many of {MANY} GPU hits, per key"]["p50_us"]
    share = per_key / figures["get GPU hit"]["p50_us"]
    print(
        f"get_many per key ÷ get: {share:.2f} "
        f"({'within' if share <= MANY_TARGET else 'above'} the {MANY_TARGET} target)"
    )
    write_json(args.out, {"device": args.device, "n": n, "figures": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())

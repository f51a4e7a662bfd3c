"""Reads of host-resident features to the CPU: latency and what they cost the event loop.

In one run, on the same features, three ways to get a CPU copy of a feature in the host
tier: (a) torch's `clone()` of the host bytes (what the cache did before; torch spreads a
large copy over its intra-op threads), (b) the cache with `host_copy_threads=0` (one
memcpy on the event loop), (c) the cache as configured by default (reads of 2 MiB or
more split over worker threads, off the loop). Reports get latency p50/p99, the reads'
GB/s, and the loop's longest lateness while they ran (a 1 ms ticker).

    python benchmarks/bench_host_reads.py [--device cuda|sim] [--cores N] [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import LoopLag, fmt, gbps, markdown_table, summary_us, write_json  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from mmcache import CacheSettings, FeatureCache  # noqa: E402

MiB = 1 << 20
ROW_BYTES = 4096 * 2  # a bf16 row of hidden size 4,096
STRATEGIES = ("torch clone", "memcpy on the loop", "worker threads")


def make_feature(rows: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4096, generator=g).to(torch.bfloat16).to(device)


def same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, compared by numpy on one thread: torch's own comparison runs on
    its intra-op threads, which spin afterwards and would slow whatever is timed next."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.view(torch.uint8).numpy(), b.view(torch.uint8).numpy()))


async def timed_reads(
    read: Callable[[int], Awaitable[torch.Tensor | None]], expected: list[torch.Tensor]
) -> dict[str, Any]:
    """A read of every feature, one after the other, under a loop-lag ticker that runs
    between them (a read that holds the loop delays it); then every result checked.

    A pass before the timed one holds as many results, so that on CUDA torch's pinned
    cache already has their blocks (a new pinned block takes about 0.5 ms per MiB).
    """
    count = len(expected)
    warm = [await read(i) for i in range(count)]
    del warm
    samples: list[float] = []
    values: list[torch.Tensor | None] = []
    async with LoopLag() as lag:
        start = time.perf_counter()
        for i in range(count):
            t0 = time.perf_counter()
            values.append(await read(i))
            samples.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # other tasks' turn, as a server's loop has them
        wall = time.perf_counter() - start
    return {
        "get_us": summary_us(samples),
        "wall_s": wall,
        "max_lag_ms": lag.max_lag_s * 1e3,
        "exact": all(same_bytes(v, e) for v, e in zip(values, expected, strict=True)),
    }


async def measure(size_mib: float, count: int, device: str) -> dict[str, Any]:
    """The three strategies on count features of size_mib each."""
    rows = max(1, int(size_mib * MiB) // ROW_BYTES)
    nbytes = rows * ROW_BYTES
    where = "cpu" if device == "sim" else device
    expected = [make_feature(rows, i, "cpu") for i in range(count)]
    out: dict[str, Any] = {"size_bytes": nbytes, "reads": count}

    # (a) the host bytes already in pinned memory where there is a GPU, as the arena is
    pinned = [e.pin_memory() if device != "sim" else e.clone() for e in expected]

    async def clone(i: int) -> torch.Tensor:
        return pinned[i].clone()

    out[STRATEGIES[0]] = await timed_reads(clone, expected)
    pinned.clear()  # the host memory back before the caches take theirs
    for name, threads in zip(STRATEGIES[1:], (0, None), strict=True):
        settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=math.ceil(count * nbytes / MiB) + 8)
        if threads is not None:
            settings = settings.model_copy(update={"host_copy_threads": threads})
        async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
            await cache.wait_host_ready(timeout=120)
            for i in range(count):
                assert await cache.put(("f", i), expected[i].to(where))
            await cache.drain()

            async def get(i: int, cache: FeatureCache = cache) -> torch.Tensor | None:
                return await cache.get(("f", i), device="cpu")

            out[name] = await timed_reads(get, expected)
            out[name]["host_copy_threads"] = cache.settings.host_copy_threads
    for name in STRATEGIES:
        out[name]["gbps"] = gbps(nbytes * count, out[name]["wall_s"])
    return out


def report(results: Sequence[dict[str, Any]], device: str) -> str:
    headers = ["size", "reads"]
    for name in STRATEGIES:
        headers += [f"{name}: get µs p50 / p99", f"{name}: loop lag ms"]
    headers += ["worker threads ÷ clone (p50)", "worker threads ÷ memcpy on the loop (p50)"]
    rows = []
    for r in results:
        row: list[Any] = [f"{r['size_bytes'] / MiB:g} MiB", r["reads"]]
        for name in STRATEGIES:
            us = r[name]["get_us"]
            row += [f"{fmt(us['p50_us'], 0)} / {fmt(us['p99_us'], 0)}", fmt(r[name]["max_lag_ms"])]
        ours = r["worker threads"]["get_us"]["p50_us"]
        row += [
            fmt(ours / r["torch clone"]["get_us"]["p50_us"]),
            fmt(ours / r["memcpy on the loop"]["get_us"]["p50_us"]),
        ]
        rows.append(row)
    exact = all(r[name]["exact"] for r in results for name in STRATEGIES)
    return (
        f"### Host reads to the CPU ({device}; every read exact: {exact})\n\n"
        + markdown_table(headers, rows)
        + "\n\nRatios below 1: the default cache is faster."
    )


async def run(sizes: Sequence[float], count: int, device: str) -> list[dict[str, Any]]:
    return [await measure(size, count, device) for size in sizes]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "sim"), default=None)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 2, 8, 32])
    parser.add_argument("--reads", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 and 8 MiB, 8 reads each")
    parser.add_argument(
        "--cores",
        type=int,
        default=0,
        help="keep the process to its first N cores once torch has started (as a container "
        "or a launcher may): torch's intra-op pool keeps the size it took at start",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.ones(1).add_(1)  # torch's intra-op pool exists from here
    if args.cores:
        allowed = sorted(os.sched_getaffinity(0))[: args.cores]
        os.sched_setaffinity(0, allowed)
        print(f"kept to cores {allowed}; torch intra-op threads: {torch.get_num_threads()}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --device sim")
        return 0
    sizes, count = ([1, 8], 8) if args.quick else (args.sizes, args.reads)
    results = asyncio.run(run(sizes, count, device))
    print(report(results, device))
    write_json(args.out, {"device": device, "results": results})
    return 0 if all(r[name]["exact"] for r in results for name in STRATEGIES) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Reads of host-resident features to the CPU: latency and what they cost the event loop.

In one run, on the same features, three ways to get a CPU copy of a feature in the host
tier: (a) torch's `clone()` of the host bytes (what the cache did before; torch spreads a
large copy over its intra-op threads), (b) one memcpy on the event loop into a pinned
tensor (the cache's read before large reads were sliced), (c) the cache's
`get(device="cpu")`: copies of 1 MiB per torch intra-op thread per loop turn (one memcpy
per 1 MiB where the process may use fewer cores than torch has threads, and until a burst
of reads repays waking the threads: see mmcache.host_copy). Reports latency
p50/p99, the reads' GB/s, and the loop's longest lateness while they ran (a 1 ms
ticker). --busy-tasks N keeps N more tasks busy on the loop meanwhile (100 µs of Python
each, then a turn for the others), as a loaded server's loop is. --gap-ms G spaces the
reads by G ms of idle loop, as a server's reads of one feature now and then are.

    python benchmarks/bench_host_reads.py [--device cuda|sim] [--cores N] [--busy-tasks N]
        [--gap-ms G] [--quick] [--out F]
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
from mmcache.host_copy import copy_host_bytes, copy_threads  # noqa: E402

MiB = 1 << 20
ROW_BYTES = 4096 * 2  # a bf16 row of hidden size 4,096
STRATEGIES = ("torch clone", "memcpy on the loop", "mmcache")


def make_feature(rows: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4096, generator=g).to(torch.bfloat16).to(device)


def same_bytes(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, compared by numpy on one thread: torch's own comparison runs on
    its intra-op threads, which spin afterwards and would slow whatever is timed next."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.view(torch.uint8).numpy(), b.view(torch.uint8).numpy()))


async def busy(stop: asyncio.Event) -> None:
    """A task that always has work: 100 µs of Python, then a turn for the others."""
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < 0.0001:
            pass
        await asyncio.sleep(0)


async def timed_reads(
    read: Callable[[int], Awaitable[torch.Tensor | None]],
    expected: list[torch.Tensor],
    busy_tasks: int = 0,
    gap_s: float = 0.0,
) -> dict[str, Any]:
    """A read of every feature, one after the other (gap_s apart), under a loop-lag ticker
    that runs between them (a read that holds the loop delays it); then every result
    checked.

    A pass before the timed one holds as many results, so that on CUDA torch's pinned
    cache already has their blocks (a new pinned block takes about 0.5 ms per MiB).
    """
    count = len(expected)
    warm = [await read(i) for i in range(count)]
    del warm
    samples: list[float] = []
    values: list[torch.Tensor | None] = []
    stop = asyncio.Event()
    others = [asyncio.create_task(busy(stop)) for _ in range(busy_tasks)]
    async with LoopLag() as lag:
        start = time.perf_counter()
        idle = 0.0
        for i in range(count):
            if gap_s:  # before each read, the first too: none follows the untimed pass
                t_idle = time.perf_counter()
                await asyncio.sleep(gap_s)
                idle += time.perf_counter() - t_idle
            t0 = time.perf_counter()
            values.append(await read(i))
            samples.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # other tasks' turn, as a server's loop has them
        wall = time.perf_counter() - start - idle
    stop.set()
    await asyncio.gather(*others)
    return {
        "get_us": summary_us(samples),
        "wall_s": wall,
        "max_lag_ms": lag.max_lag_s * 1e3,
        "exact": all(same_bytes(v, e) for v, e in zip(values, expected, strict=True)),
    }


async def measure(
    size_mib: float, count: int, device: str, busy_tasks: int, gap_s: float = 0.0
) -> dict[str, Any]:
    """The three strategies on count features of size_mib each."""
    rows = max(1, int(size_mib * MiB) // ROW_BYTES)
    nbytes = rows * ROW_BYTES
    where = "cpu" if device == "sim" else device
    expected = [make_feature(rows, i, "cpu") for i in range(count)]
    out: dict[str, Any] = {"size_bytes": nbytes, "reads": count}

    # (a) and (b) read host bytes already in pinned memory where there is a GPU, as the
    # arena is, into what the cache's read returns (pinned there too, for (b)).
    pinned = [e.pin_memory() if device != "sim" else e.clone() for e in expected]

    async def clone(i: int) -> torch.Tensor:
        return pinned[i].clone()

    async def one_memcpy(i: int) -> torch.Tensor:
        result = torch.empty_like(pinned[i], pin_memory=device != "sim")
        copy_host_bytes(result, pinned[i])
        return result

    out[STRATEGIES[0]] = await timed_reads(clone, expected, busy_tasks, gap_s)
    out[STRATEGIES[1]] = await timed_reads(one_memcpy, expected, busy_tasks, gap_s)
    pinned.clear()  # the host memory back before the cache takes its own
    settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=math.ceil(count * nbytes / MiB) + 8)
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        await cache.wait_host_ready(timeout=120)
        for i in range(count):
            assert await cache.put(("f", i), expected[i].to(where))
        await cache.drain()

        async def get(i: int) -> torch.Tensor | None:
            return await cache.get(("f", i), device="cpu")

        out[STRATEGIES[2]] = await timed_reads(get, expected, busy_tasks, gap_s)
    for name in STRATEGIES:
        out[name]["gbps"] = gbps(nbytes * count, out[name]["wall_s"])
    return out


def report(results: Sequence[dict[str, Any]], device: str, gap_s: float = 0.0) -> str:
    headers = ["size", "reads"]
    for name in STRATEGIES:
        headers += [f"{name}: get µs p50 / p99", f"{name}: loop lag ms"]
    headers += ["mmcache ÷ clone (p50)", "mmcache ÷ memcpy on the loop (p50)"]
    rows = []
    for r in results:
        row: list[Any] = [f"{r['size_bytes'] / MiB:g} MiB", r["reads"]]
        for name in STRATEGIES:
            us = r[name]["get_us"]
            row += [f"{fmt(us['p50_us'], 0)} / {fmt(us['p99_us'], 0)}", fmt(r[name]["max_lag_ms"])]
        ours = r["mmcache"]["get_us"]["p50_us"]
        row += [
            fmt(ours / r["torch clone"]["get_us"]["p50_us"]),
            fmt(ours / r["memcpy on the loop"]["get_us"]["p50_us"]),
        ]
        rows.append(row)
    exact = all(r[name]["exact"] for r in results for name in STRATEGIES)
    spacing = f"; reads {gap_s * 1e3:g} ms apart" if gap_s else ""
    return (
        f"### Host reads to the CPU ({device}; every read exact: {exact}; mmcache's copy "
        f"threads: {copy_threads()} of torch's {torch.get_num_threads()}{spacing})\n\n"
        + markdown_table(headers, rows)
        + "\n\nRatios below 1: mmcache is faster."
    )


async def run(
    sizes: Sequence[float], count: int, device: str, busy_tasks: int, gap_s: float = 0.0
) -> list[dict[str, Any]]:
    return [await measure(size, count, device, busy_tasks, gap_s) for size in sizes]


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
    parser.add_argument(
        "--busy-tasks", type=int, default=0, help="tasks kept busy on the loop meanwhile"
    )
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle loop time between two reads, ms"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.gap_ms < 0:
        parser.error(f"--gap-ms must be >= 0, not {args.gap_ms:g}")
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
    gap_s = args.gap_ms / 1e3
    results = asyncio.run(run(sizes, count, device, args.busy_tasks, gap_s))
    print(report(results, device, gap_s))
    write_json(
        args.out,
        {"device": device, "busy_tasks": args.busy_tasks, "gap_s": gap_s, "results": results},
    )
    return 0 if all(r[name]["exact"] for r in results for name in STRATEGIES) else 1


if __name__ == "__main__":
    sys.exit(main())

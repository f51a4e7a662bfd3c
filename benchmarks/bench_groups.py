"""What agreeing across a tensor-parallel group adds to each lookup (FeatureCache(group=)).

Spawns TP ranks joined by a process group, each with two caches holding the same
features: one without a group and one with group= (every get is then a collective). Each
rank times get of 1 key and get_many of 16 keys, all GPU-tier hits, in both, one call at
a time and in step with the other ranks; the difference is the agreement's cost per call.
Beside it: one bare all_reduce of the agreement's 280-byte mask, made from the calling
thread (the floor any agreement pays). And the host memory a node pins for the ranks'
host tiers: each rank has its own today.

    python benchmarks/bench_groups.py                      # simulator, gloo, TP 2 and 4
    python benchmarks/bench_groups.py --device cuda        # gloo and, one GPU a rank, NCCL
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import fmt, markdown_table, spawn_ranks, summary_us, write_json

from mmcache import CacheSettings, FeatureCache

MANY = 16  # keys of a get_many: a request's images
ROWS, HIDDEN = 16, 1024  # a 32 KiB bf16 feature: the agreement does not depend on the size
HOST_MB = 64  # each rank's host tier
MASK_BYTES = 280  # one collective's buffer (mmcache.agreement: 24-byte header, 256 keys)
CALLS = ("get of 1 key", f"get_many of {MANY} keys")


def rank_main(
    rank: int, tp: int, backend: str, device: str, calls: int, store: str, outbox: Any
) -> None:
    """One rank: join the group, time both caches, report to outbox."""
    import torch.distributed as dist

    try:
        on = device
        if device.startswith("cuda"):
            gpu = rank % torch.cuda.device_count()
            torch.cuda.set_device(gpu)
            on = f"cuda:{gpu}"
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=tp,
            timeout=datetime.timedelta(seconds=60),
        )
        report = asyncio.run(_measure(rank, backend, on, calls))
    except BaseException:
        report = {"error": traceback.format_exc()}
    outbox.put((rank, report))


async def _measure(rank: int, backend: str, device: str, calls: int) -> dict[str, Any]:
    import torch.distributed as dist

    where = "cpu" if device == "sim" else device
    settings = CacheSettings(gpu_cache_mb=64, cpu_cache_mb=HOST_MB, evict_ahead=0)
    keys = [("img", i) for i in range(MANY)]
    figures: dict[str, dict[str, float]] = {}
    host_bytes = 0
    for grouped in (False, True):
        cache = FeatureCache(
            settings,
            device=device,
            name=f"rank{rank}-{grouped}",
            registry=CollectorRegistry(),
            group=dist.group.WORLD if grouped else None,
        )
        async with cache:
            await cache.wait_host_ready(30)
            for key in keys:
                await cache.put(key, torch.ones(ROWS, HIDDEN, dtype=torch.bfloat16, device=where))
            label = "with group" if grouped else "without"
            for call in CALLS:
                times: list[float] = []
                gc.disable()
                try:
                    for i in range(calls + calls // 10):  # the first tenth warms up
                        t0 = time.perf_counter()
                        if call == CALLS[0]:
                            found = [await cache.get(keys[i % MANY])]
                        else:
                            found = await cache.get_many(keys)
                        if i >= calls // 10:
                            times.append(time.perf_counter() - t0)
                        assert all(t is not None for t in found), "every key is a hit on every rank"
                finally:
                    gc.enable()
                figures[f"{call}, {label}"] = summary_us(times)
            stats = cache.stats()
            assert stats.leaked_bytes == 0 and stats.group_misses == 0
            host_bytes = stats.cpu_capacity_bytes
    figures["bare all_reduce of the mask"] = _bare_all_reduce(backend, device, calls)
    return {"figures": figures, "host_bytes": host_bytes}


def _bare_all_reduce(backend: str, device: str, calls: int) -> dict[str, float]:
    """One MIN all_reduce of the mask's 280 bytes, from this thread, as the agreement makes it."""
    import torch.distributed as dist

    mask = torch.ones(MASK_BYTES, dtype=torch.uint8)
    times: list[float] = []
    for i in range(calls + calls // 10):
        t0 = time.perf_counter()
        if backend == "nccl":
            on_device = mask.to(device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MIN)
            mask.copy_(on_device.cpu())
        else:
            dist.all_reduce(mask, op=dist.ReduceOp.MIN)
        if i >= calls // 10:
            times.append(time.perf_counter() - t0)
    return summary_us(times)


def run(tp: int, backend: str, device: str, calls: int) -> dict[str, Any]:
    """Spawn tp ranks; rank 0's figures and every rank's host tier."""
    reports = spawn_ranks(rank_main, tp, backend, device, calls)
    return {
        "figures": reports[0]["figures"],
        "host_bytes_per_node": sum(r["host_bytes"] for r in reports.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="sim", help="sim (default) or cuda")
    parser.add_argument("--tp", default="2,4", help="group sizes, comma-separated (default 2,4)")
    parser.add_argument("--calls", type=int, default=2_000, help="timed calls per operation")
    parser.add_argument("--quick", action="store_true", help="TP 2 only, 200 calls")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench_groups: no CUDA device; run with --device sim")
        return 0
    sizes = [2] if args.quick else [int(t) for t in args.tp.split(",")]
    calls = 200 if args.quick else args.calls
    backends = ["gloo", "nccl"] if cuda else ["gloo"]
    results: dict[str, Any] = {"device": args.device, "calls": calls, "runs": []}
    rows: list[list[Any]] = []
    notes: list[str] = []
    for tp in sizes:
        for backend in backends:
            if backend == "nccl" and tp > torch.cuda.device_count():
                notes.append(
                    f"NCCL at TP {tp}: skipped, it needs a GPU per rank "
                    f"({torch.cuda.device_count()} here)"
                )
                continue
            outcome = run(tp, backend, args.device, calls)
            results["runs"].append({"tp": tp, "backend": backend, **outcome})
            figures = outcome["figures"]
            bare = figures["bare all_reduce of the mask"]["p50_us"]
            for call in CALLS:
                without = figures[f"{call}, without"]
                with_group = figures[f"{call}, with group"]
                rows.append(
                    [
                        tp,
                        backend,
                        call,
                        f"{fmt(without['p50_us'], 1)} / {fmt(without['p99_us'], 1)}",
                        f"{fmt(with_group['p50_us'], 1)} / {fmt(with_group['p99_us'], 1)}",
                        fmt(with_group["p50_us"] - without["p50_us"], 1),
                        fmt(bare, 1),
                    ]
                )
    print(f"bench_groups on {args.device}: rank 0's µs per call, {calls} calls each")
    print(
        markdown_table(
            [
                "TP",
                "group",
                "call",
                "without a group, p50 / p99",
                "with the group, p50 / p99",
                "added, p50",
                "bare all_reduce, p50",
            ],
            rows,
        )
    )
    for note in notes:
        print(note)
    print()
    print("Host memory pinned per node for the ranks' host tiers (each rank holds its own):")
    host_rows = [
        [run["tp"], f"{HOST_MB} MiB", f"{run['host_bytes_per_node'] / 2**20:.0f} MiB"]
        for run in results["runs"]
        if run["backend"] == "gloo"
    ]
    print(markdown_table(["TP", "host tier per rank", "per node"], host_rows))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

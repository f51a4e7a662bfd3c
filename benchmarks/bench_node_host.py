"""Host memory a node spends on the TP ranks' host tiers, with and without host_share="node".

Spawns TP ranks joined by gloo on loopback, each with a cache on the simulator and a group
(FeatureCache(group=)): a small GPU tier and a host tier. Every rank puts the same features
(as every TP rank's encoder computes the same embedding of each image), one put at a time and
in step with the others, so most of them go to the host tier; then every rank reads them all
back (one get_many, every key an agreed hit, each compared with what was put). Once each,
host_share="rank" (each rank its own host tier) and host_share="node" (one for the node, in
/dev/shm). Reported per node: the host bytes the features take, the host arena pinned, and
the bytes copied device -> host; and rank 0's seconds for the puts and for the read.

    python benchmarks/bench_node_host.py                 # simulator, TP 2 and 4
    python benchmarks/bench_node_host.py --quick         # TP 2, fewer features
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import fmt, markdown_table, spawn_ranks, write_json

from mmcache import CacheSettings, FeatureCache

ROWS, HIDDEN = 128, 1024  # a 256 KiB bf16 feature
GPU_MB = 4  # each rank's GPU tier: most features go to the host tier
HOST_MB = 64  # each rank's host tier, or the node's
Share = Literal["rank", "node"]
SHARES: tuple[Share, ...] = ("rank", "node")


def rank_main(rank: int, tp: int, features: int, store: str, outbox: Any) -> None:
    """One rank: join the group, measure both ways, report to outbox."""
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=tp,
            timeout=datetime.timedelta(seconds=60),
        )
        report: dict[str, Any] = {
            share: asyncio.run(_measure(rank, share, features)) for share in SHARES
        }
    except BaseException:
        report = {"error": traceback.format_exc()}
    outbox.put((rank, report))


def feature(key: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(key)
    return torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16)


async def _measure(rank: int, share: Share, features: int) -> dict[str, Any]:
    import torch.distributed as dist

    settings = CacheSettings(
        gpu_cache_mb=GPU_MB, cpu_cache_mb=HOST_MB, evict_ahead=0, host_share=share
    )
    keys = [("img", i) for i in range(features)]
    values = [feature(i) for i in range(features)]
    cache = FeatureCache(
        settings,
        device="sim",
        name=f"bench-node-{share}",
        registry=CollectorRegistry(),
        group=dist.group.WORLD,
    )
    async with cache:
        assert await cache.wait_host_ready(30)
        dist.barrier()
        started = time.perf_counter()
        for key, value in zip(keys, values, strict=True):
            await cache.put(key, value.clone())
        await cache.drain()
        put_s = time.perf_counter() - started
        dist.barrier()  # every rank's copies have landed
        started = time.perf_counter()
        found = await cache.get_many(keys)
        read_s = time.perf_counter() - started
        exact = all(
            got is not None and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            for got, want in zip(found, values, strict=True)
        )
        del found
        await cache.drain()
        dist.barrier()
        stats = cache.stats()
        assert stats.leaked_bytes == 0 and stats.group_misses == 0
        dist.barrier()  # nobody leaves the node before every rank has read its figures
    return {
        "exact": exact,
        "host_bytes": stats.cpu_bytes,
        "node_host_bytes": stats.node_host_bytes,
        "pinned": stats.cpu_capacity_bytes,
        "d2h_bytes": stats.d2h_bytes,
        "put_s": put_s,
        "read_s": read_s,
    }


def run(tp: int, features: int) -> dict[str, Any]:
    """Spawn tp ranks; per share, the node's figures and rank 0's times."""
    reports = spawn_ranks(rank_main, tp, features)
    outcome: dict[str, Any] = {}
    for share in SHARES:
        each = [reports[r][share] for r in range(tp)]
        node = share == "node"
        outcome[share] = {
            "exact": all(r["exact"] for r in each),
            "host_bytes_per_node": each[0]["node_host_bytes"]
            if node
            else sum(r["host_bytes"] for r in each),
            "pinned_per_node": each[0]["pinned"] if node else sum(r["pinned"] for r in each),
            "d2h_bytes_per_node": sum(r["d2h_bytes"] for r in each),
            "put_s": each[0]["put_s"],
            "read_s": each[0]["read_s"],
        }
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tp", default="2,4", help="group sizes, comma-separated (default 2,4)")
    parser.add_argument("--features", type=int, default=160, help="features put (256 KiB each)")
    parser.add_argument("--quick", action="store_true", help="TP 2 only, 40 features")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    sizes = [2] if args.quick else [int(t) for t in args.tp.split(",")]
    features = 40 if args.quick else args.features
    results: dict[str, Any] = {"device": "sim", "features": features, "runs": []}
    rows: list[list[Any]] = []
    mib = 2**20
    for tp in sizes:
        outcome = run(tp, features)
        results["runs"].append({"tp": tp, **outcome})
        for share in SHARES:
            o = outcome[share]
            rows.append(
                [
                    tp,
                    share,
                    f"{o['host_bytes_per_node'] / mib:.1f} MiB",
                    f"{o['pinned_per_node'] / mib:.0f} MiB",
                    f"{o['d2h_bytes_per_node'] / mib:.1f} MiB",
                    fmt(o["put_s"] * 1e3, 1),
                    fmt(o["read_s"] * 1e3, 1),
                    "yes" if o["exact"] else "NO",
                ]
            )
    print(
        f"bench_node_host on the simulator: {features} features of "
        f"{ROWS * HIDDEN * 2 // 1024} KiB put on every rank ({GPU_MB} MiB GPU tier, "
        f"{HOST_MB} MiB host tier per rank or per node)"
    )
    print(
        markdown_table(
            [
                "TP",
                "host_share",
                "host bytes per node",
                "host arena pinned per node",
                "copied D2H per node",
                "puts, rank 0 (ms)",
                "get_many of all, rank 0 (ms)",
                "exact",
            ],
            rows,
        )
    )
    write_json(args.out, results)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

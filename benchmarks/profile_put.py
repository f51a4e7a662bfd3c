"""Profile the put -> offload path: where a put's time goes when the GPU tier is full.

`python benchmarks/profile_put.py --device cuda --mb 1 --count 1024` prints the
offload rate, then the functions that took the most time (cProfile, tottime).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time

import torch
from _common import concat_batches, put_in_groups, put_in_splits
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache


async def run(
    device: str, mb: float, count: int, group: int, split: bool, profile: cProfile.Profile
) -> str:
    where = "cpu" if device == "sim" else device
    rows = max(1, int(mb * 2**20 / (4096 * 2)))
    features: list[torch.Tensor | None] = [
        torch.full((rows, 4096), float(i % 7), dtype=torch.bfloat16, device=where)
        for i in range(count)
    ]
    batches = concat_batches(features, group) if split else []
    total = rows * 4096 * 2 * count
    settings = CacheSettings(gpu_cache_mb=total / 4 / 2**20, cpu_cache_mb=total * 1.1 / 2**20)
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        await cache.wait_host_ready(timeout=60)
        if device != "sim":
            torch.cuda.synchronize()
        start = time.perf_counter()
        profile.enable()
        if split:
            await put_in_splits(cache, batches, group)
        else:
            await put_in_groups(cache, features, group)
        await cache.drain()
        profile.disable()
        wall = time.perf_counter() - start
        s = cache.stats()
    size_mib = rows * 4096 * 2 / 2**20
    return (
        f"{count} x {size_mib:.2f} MiB: {s.d2h_bytes / wall / 1e9:.2f} GB/s offloaded, "
        f"{wall / count * 1e6:.1f} µs per put, {s.evictions_gpu} evictions, {s.dropped} dropped"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mb", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=1024)
    parser.add_argument("--group", type=int, default=1, help="features per put_many call")
    parser.add_argument("--split", action="store_true", help="put_split batches of --group")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (s)")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_put: no CUDA device")
        return 0
    profile = cProfile.Profile()
    print(asyncio.run(run(args.device, args.mb, args.count, args.group, args.split, profile)))
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

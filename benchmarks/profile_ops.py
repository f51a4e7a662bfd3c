"""Where one cache operation's loop-thread time goes: cProfile over many calls of one kind.

bench_serving's single-client table says what a GPU hit, a host hit brought to the device
and a put into a full tier cost the loop thread; this says which functions that time is
spent in, torch's and the driver's calls included (they show as C functions), so one
GPU call finds the costly step. The cache has a GPU tier of --gpu-features features and
a host tier for all; every feature is put once (the GPU tier fills, then each put
evicts), then each key is read twice, oldest first: a host hit brought to the GPU, then
a GPU hit. Only those calls are profiled, each classed by what the cache's counters did.

    python benchmarks/profile_ops.py [--device sim|cuda] [--size 64KB] [--features 512]
        [--gpu-features 64] [--clock cpu|wall] [--top 25] [--out F]

--clock cpu (the default) times each function by the loop thread's CPU time, as
bench_serving's single-client table does (a wait for a copy costs nothing there); wall
counts the waits too.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import DTYPE, HIDDEN, SPECS, write_json

from mmcache import CacheSettings, CacheStats, FeatureCache

#: what each class of call did to the counters
CLASSES = ("put that evicts", "host hit -> device", "GPU hit")


def _classify(before: CacheStats, after: CacheStats, put: bool) -> str | None:
    if put:
        return CLASSES[0] if after.evictions_gpu > before.evictions_gpu else None
    if after.hits_cpu > before.hits_cpu:
        return CLASSES[1]
    if after.hits_gpu > before.hits_gpu:
        return CLASSES[2]
    return None


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    """cProfile of each class of call; the calls each class got."""
    where = "cpu" if args.device == "sim" else args.device
    rows = SPECS[args.size]
    nbytes = rows * HIDDEN * torch.empty(0, dtype=DTYPE).element_size()
    settings = CacheSettings(
        gpu_cache_mb=args.gpu_features * nbytes / 2**20,
        cpu_cache_mb=(args.features + 16) * nbytes / 2**20,
    )
    calls = dict.fromkeys(CLASSES, 0)
    profiled: dict[str, list[cProfile.Profile]] = {name: [] for name in CLASSES}
    cache = FeatureCache(settings, device=args.device, registry=CollectorRegistry())

    async def timed(call: Any, put: bool) -> Any:
        before = cache.stats()
        probe = (
            cProfile.Profile(time.thread_time_ns, 1e-9)
            if args.clock == "cpu"
            else cProfile.Profile()
        )
        probe.enable()
        result = await call
        probe.disable()
        name = _classify(before, cache.stats(), put)
        if name is not None:
            calls[name] += 1
            profiled[name].append(probe)
        return result

    async with cache:
        await cache.wait_host_ready(timeout=60)
        gc.disable()  # a collection inside a profiled call is noise, not the cache's cost
        try:
            for i in range(args.features):
                value = torch.full((rows, HIDDEN), float(i), dtype=DTYPE, device=where)
                await timed(cache.put(i, value), put=True)
                del value
            await cache.drain()
            for i in range(args.features):  # oldest first: on the host
                await timed(cache.get(i), put=False)  # a host hit, brought to the GPU
                await timed(cache.get(i), put=False)  # then, where it was, a GPU hit
            if where != "cpu":
                torch.cuda.synchronize()
        finally:
            gc.enable()
        await cache.drain()
        leaked = cache.stats().leaked_bytes
    out: dict[str, Any] = {
        "device": args.device,
        "size": args.size,
        "clock": args.clock,
        "leaked_bytes": leaked,
    }
    for name in CLASSES:
        if not profiled[name]:
            out[name] = {"calls": 0}
            continue
        stats = pstats.Stats(profiled[name][0])
        for more in profiled[name][1:]:
            stats.add(more)
        text = io.StringIO()
        stats.stream = text  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(args.top)
        total_s = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
        out[name] = {
            "calls": calls[name],
            "us_per_call": total_s / calls[name] * 1e6,
            "profile": text.getvalue(),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="sim", help="sim (default) or cuda")
    parser.add_argument("--size", default="64KB", choices=sorted(SPECS))
    parser.add_argument("--features", type=int, default=512, help="features put (default 512)")
    parser.add_argument("--gpu-features", type=int, default=64, help="GPU tier, in features")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="time functions by the thread's CPU time (default) or by the wall clock",
    )
    parser.add_argument("--top", type=int, default=25, help="functions shown per class")
    parser.add_argument("--out", help="write the profiles as JSON here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_ops: no CUDA device; run with --device sim")
        return 0
    if not 0 < args.gpu_features < args.features:
        parser.error("--gpu-features must be > 0 and below --features")
    out = asyncio.run(profile(args))
    for name in CLASSES:
        figures = out[name]
        if not figures["calls"]:
            print(f"### {name}: no call of this kind\n")
            continue
        print(
            f"### {name}: {figures['calls']} calls, {figures['us_per_call']:.1f} µs of "
            f"profiled loop-thread {'CPU' if args.clock == 'cpu' else 'wall'} time a call "
            "(cProfile's own cost included)\n"
        )
        print(figures["profile"])
    print(f"leaked bytes: {out['leaked_bytes']}")
    write_json(args.out, out)
    return 1 if out["leaked_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())

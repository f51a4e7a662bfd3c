"""The engine adapters' own cost per call: SGLang's MMCacheMultimodalCache, called from a thread.

SGLang's scheduler calls its embedding cache synchronously; the adapter hands each call
to the cache's loop thread and waits, but for a GPU-tier hit, which the calling thread
reads itself (FeatureCache.get_resident_threadsafe). This times, one call at a time from
the calling thread: get_single on a GPU-tier hit (the thread path, and the same hit handed
to the loop as before it), on a miss, set of a new key (no eviction), set of a cached key,
next to the bare round trip to the loop thread (a trivial coroutine) and to
FeatureCache.get_threadsafe (thread path and hand-off). Feature: 64 KB. Targets on the
H200: a GPU hit within 10 µs (the thread path), 50 µs through the hand-off.

Without SGLang installed, the FeatureCache rows alone are timed, on a loop thread of the
same kind as the adapter's: the thread path the adapter's get takes, less its key handling.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import HIDDEN, SPECS, latency_table, summary_us, target_verdict, write_json

from mmcache import CacheSettings, FeatureCache, MMCacheError
from mmcache.integrations.loop_thread import LoopThread

HIT_TARGET_US = 10.0


async def _trivial() -> None:
    return None


def _time(fn: Callable[[int], object], n: int) -> list[float]:
    clock = time.perf_counter
    out = []
    for i in range(n):
        t0 = clock()
        fn(i)
        out.append(clock() - t0)
    return out


def _features(device: str, n: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """2n features of 64 KB on the device, a spare one, and a GPU budget that holds them."""
    where = "cpu" if device == "sim" else device
    rows = SPECS["64KB"]
    values = [torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=where) for _ in range(2 * n)]
    spare = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=where)
    return values, spare, 2 * n * spare.nbytes + (1 << 20)


def _time_all(
    calls: dict[str, Callable[[int], object]], n: int, device: str
) -> dict[str, list[float]]:
    gc.disable()  # a collection inside one timed call is noise, not adapter overhead
    try:
        results = {name: _time(fn, n) for name, fn in calls.items()}
        if device != "sim":
            torch.cuda.synchronize()
    finally:
        gc.enable()
    return results


def _check_counts(cache: FeatureCache, hits: int, misses: int) -> None:
    stats = cache.stats()  # from this thread: the loop applies the thread's hits first
    if (stats.hits_gpu, stats.misses, stats.hits_cpu) != (hits, misses, 0):
        raise MMCacheError(
            f"counted {stats.hits_gpu} GPU hits, {stats.hits_cpu} host hits and "
            f"{stats.misses} misses; expected {hits}, 0 and {misses}"
        )


def measure_cache(device: str, n: int) -> dict[str, dict[str, float]]:
    """FeatureCache's thread calls alone (no adapter), n calls each, after a warm-up."""
    values, _, budget = _features(device, n)
    settings = CacheSettings(gpu_cache_mb=budget / 2**20, cpu_cache_mb=16)
    runner = LoopThread("mmcache-bench")
    cache = FeatureCache(settings, device=device, registry=CollectorRegistry())
    try:
        runner.run(cache.start())
        stream = cache.device.current_stream()
        for i in range(n):  # warm-up: the first calls pay for code paths and allocations
            cache.put_threadsafe(-1 - i, values.pop(), stream=stream)
            cache.get_threadsafe(-1 - i, stream=stream)
        for i in range(n):
            cache.put_threadsafe(i, values.pop(), stream=stream)
        declined = [0]  # resident reads answered None (get_threadsafe would hand those off)

        def resident(i: int) -> object:
            out = cache.get_resident_threadsafe(i, stream=stream)
            declined[0] += out is None
            return out

        results = _time_all(
            {
                "round trip (trivial coroutine)": lambda i: runner.run(_trivial(), eager=True),
                "FeatureCache.get_resident_threadsafe GPU hit": resident,
                "FeatureCache.get_threadsafe GPU hit": (
                    lambda i: cache.get_threadsafe(i, stream=stream)
                ),
                "FeatureCache.get on the loop, GPU hit, handed off": (
                    lambda i: runner.run(cache.get(i, stream=stream), eager=True)
                ),
                "FeatureCache.get_threadsafe miss": (
                    lambda i: cache.get_threadsafe(10**9 + i, stream=stream)
                ),
                "FeatureCache.get_resident_threadsafe GPU hit, again": resident,
            },
            n,
            device,
        )
        if declined[0]:
            print(f"the resident path declined {declined[0]} of {2 * n} reads")
        # the warm-up's, get_threadsafe's and the loop's rows, and the resident reads served
        _check_counts(cache, hits=5 * n - declined[0], misses=n)
    finally:
        if runner.alive:
            runner.run(cache.close())
        runner.stop()
    return {name: summary_us(durations) for name, durations in results.items()}


def measure(device: str, n: int) -> dict[str, dict[str, float]]:
    """Per-call durations of each operation, n calls each, after a warm-up."""
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

    from mmcache.integrations.sglang import MMCacheMultimodalCache

    values, spare, budget = _features(device, n)
    settings = CacheSettings(cpu_cache_mb=16)
    with MMCacheMultimodalCache(
        budget, settings=settings, device=device, registry=CollectorRegistry()
    ) as cache:
        loop = cache.feature_cache
        stream = loop.device.current_stream()

        def handed_off(i: int) -> object:
            """get_single's GPU hit as the loop serves it (the path before the thread's)."""
            return cache._loop.run(cache._get(i, stream), eager=True)

        def get_threadsafe_handed_off(i: int) -> object:
            return cache._loop.run(loop.get(i, stream=stream), eager=True)

        for i in range(n):  # warm-up: the first calls pay for code paths and allocations
            cache.set(-1 - i, EmbeddingResult(embedding=values.pop()))
            cache.get_single(-1 - i)
        calls: dict[str, Callable[[int], object]] = {
            "round trip (trivial coroutine)": lambda i: cache._loop.run(_trivial(), eager=True),
            "set (new key)": lambda i: cache.set(i, EmbeddingResult(embedding=values.pop())),
            "set (cached key)": lambda i: cache.set(i, EmbeddingResult(embedding=spare)),
            "get_single GPU hit": lambda i: cache.get_single(i),
            "get_single GPU hit, handed to the loop": handed_off,
            "get_single miss": lambda i: cache.get_single(10**9 + i),
            "FeatureCache.get_resident_threadsafe GPU hit": (
                lambda i: loop.get_resident_threadsafe(i, stream=stream)
            ),
            "FeatureCache.get_threadsafe GPU hit": lambda i: loop.get_threadsafe(i),
            "FeatureCache.get on the loop, GPU hit, handed off": get_threadsafe_handed_off,
        }
        results = _time_all(calls, n, device)
        _check_counts(loop, hits=6 * n, misses=n)  # the warm-up's and five timed GPU-hit rows'
    return {name: summary_us(durations) for name, durations in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--calls", type=int, default=5_000, help="calls per operation")
    parser.add_argument("--quick", action="store_true", help="200 calls per operation")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_adapters.py: CUDA is not available; run with --device sim", file=sys.stderr)
        return 0
    try:
        import sglang.srt.mem_cache.multimodal_cache  # noqa: F401
    except ImportError as exc:
        adapter = False
        print(
            f"bench_adapters.py: sglang is not installed ({exc}): FeatureCache's thread calls "
            "alone (bash scripts/install_integrations.sh installs it)"
        )
    else:
        adapter = True
    n = 200 if args.quick else args.calls
    try:
        results = measure(args.device, n) if adapter else measure_cache(args.device, n)
    except MMCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    what = "SGLang adapter" if adapter else "FeatureCache"
    print(f"{what} on {args.device}: cost per call from a thread, {n} calls each")
    print(latency_table(results, "call"))
    hit = "get_single GPU hit" if adapter else "FeatureCache.get_threadsafe GPU hit"
    print(target_verdict("GPU hit", results[hit]["p50_us"], HIT_TARGET_US))
    if args.device == "sim":
        print("(simulator figures: the host's Python costs, not the GPU's)")
    write_json(
        args.out, {"device": args.device, "calls": n, "adapter": adapter, "results": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

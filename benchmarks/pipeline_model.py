"""The cache's own Python per offloaded feature, measured without a GPU.

A model device stands in for CUDA: its copies cost the host nothing and finish after
bytes ÷ --gbps on one serial copy engine (a thread sleeps until each is done and
reports it, as CUDA's fence waiter does), adopting a tensor is a detach, releasing
one is free (the model keeps it, as a caching allocator would). What remains of a put loop that
forces eviction (GPU tier a quarter of the workload) is the cache's bookkeeping: put,
eviction, host block, offload start and landing. When that Python is slower than the
engine, the loop bounds the offload rate, as it does on the H200 for small features.

    python benchmarks/pipeline_model.py [--quick] [--gbps 50] [--out model.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    concat_batches,
    fmt,
    markdown_table,
    put_in_groups,
    put_in_splits,
    write_json,
)

from mmcache import CacheSettings, FeatureCache  # noqa: E402
from mmcache.device.base import Fence, Stream, packed_shape  # noqa: E402
from mmcache.device.sim import SimDevice  # noqa: E402

HIDDEN = 4096
#: (label, MiB per feature, features, features per put call; negative: put_split batches)
CONFIGS = (
    ("1 MB, put", 1.0, 2048, 1),
    ("1 MB, put_many of 8", 1.0, 2048, 8),
    ("64 KB, put_many of 128", 1 / 16, 16384, 128),
    ("1 MB, put_split of 8", 1.0, 2048, -8),
    ("64 KB, put_split of 128", 1 / 16, 16384, -128),
)


class EngineFence(Fence):
    """Done once the model engine has finished the copy; callbacks come from a thread."""

    __slots__ = ("_at", "_waiter")

    def __init__(self, at: float, waiter: _Waiter) -> None:
        self._at = at  # time.perf_counter() at which the copy is done
        self._waiter = waiter

    def done(self) -> bool:
        return time.perf_counter() >= self._at

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        if self.done():
            fn()
        else:
            self._waiter.add(self._at, fn)

    def wait(self, timeout: float | None = None) -> bool:
        left = self._at - time.perf_counter()
        if timeout is not None and left > timeout:
            time.sleep(timeout)
            return False
        time.sleep(max(0.0, left))
        return True


class _Waiter:
    """Like CUDA's fence waiters: a thread runs each callback once its copy is done,
    none held behind a later copy (they hand the landing to the loop thread-safely)."""

    def __init__(self) -> None:
        self._jobs: list[tuple[float, int, Callable[[], None]]] = []  # a heap by time
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="model-fences", daemon=True)
        self._thread.start()

    def add(self, at: float, fn: Callable[[], None]) -> None:
        with self._changed:
            heapq.heappush(self._jobs, (at, next(self._order), fn))
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._jobs or self._jobs[0][0] > time.perf_counter():
                    if self._closed and not self._jobs:
                        return
                    wait = self._jobs[0][0] - time.perf_counter() if self._jobs else None
                    self._changed.wait(wait)
                _, _, fn = heapq.heappop(self._jobs)
            fn()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()


class ModelDevice(SimDevice):
    """Copies take bytes / bandwidth on one engine and no host time; nothing is poisoned."""

    poisons_host = False

    def __init__(self, gbps: float) -> None:
        super().__init__()
        self._bytes_per_s = gbps * 1e9
        self._engine_free_at = 0.0
        self._waiter = _Waiter()
        self._released: list[torch.Tensor] = []

    def _engine(self, nbytes: int) -> EngineFence:
        start = max(self._engine_free_at, time.perf_counter())
        self._engine_free_at = start + nbytes / self._bytes_per_s
        return EngineFence(self._engine_free_at, self._waiter)

    def copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> Fence:
        return self._engine(sum(src.nbytes for src in srcs))

    def copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        return self._engine(src.nbytes)

    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        return tensor.detach()

    def pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        # The packing kernel runs on the device: the host pays only for the call.
        return torch.empty(packed_shape(srcs), dtype=srcs[0].dtype), self.completed_fence()

    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        # Kept until close, as a caching allocator keeps a freed block: freeing host
        # memory here would time the C library (a 32 MB free unmaps), not the cache.
        self._released.append(tensor)

    def record(self, stream: Stream) -> Fence:
        return self.completed_fence()

    def close(self) -> None:
        self._waiter.close()
        self._released.clear()
        super().close()


async def run(mib: float, count: int, group: int, gbps: float) -> dict[str, float]:
    """One put loop through the cache on the model device; µs per feature and GB/s."""
    rows = max(1, round(mib * 2**20 / (HIDDEN * 2)))
    features: list[torch.Tensor | None] = [
        torch.empty(rows, HIDDEN, dtype=torch.bfloat16) for _ in range(count)
    ]
    total = rows * HIDDEN * 2 * count
    settings = CacheSettings(gpu_cache_mb=total / 4 / 2**20, cpu_cache_mb=total * 1.1 / 2**20)
    device = ModelDevice(gbps)
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        await cache.wait_host_ready(timeout=60)
        gc.collect()
        gc.disable()  # a collection inside the loop is noise here, not bookkeeping
        try:
            if group < 0:  # the batches exist before the timed part, as features do
                batches = concat_batches(features, -group)
            start = time.perf_counter()
            if group < 0:
                await put_in_splits(cache, batches, -group)
            else:
                await put_in_groups(cache, features, group)
            await cache.drain()
            wall = time.perf_counter() - start
        finally:
            gc.enable()
        offloaded = cache.stats().d2h_bytes
    device.close()  # the cache closes only devices it made
    return {
        "us_per_feature": wall / count * 1e6,
        "gbps": offloaded / wall / 1e9,
        "engine_us_per_feature": offloaded / count / (gbps * 1e9) * 1e6,
    }


async def measure(quick: bool, gbps: float, repeats: int) -> list[dict[str, Any]]:
    results = []
    for label, mib, count, group in CONFIGS:
        n = count // 8 if quick else count
        runs = [await run(mib, n, group, gbps) for _ in range(repeats)]
        best = min(runs, key=lambda r: r["us_per_feature"])
        results.append({"config": label, "features": n, "best": best, "runs": runs})
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gbps", type=float, default=50.0, help="the model engine's rate")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--quick", action="store_true", help="an eighth of the features")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.quick, args.gbps, args.repeats))
    rows = [
        [
            r["config"],
            r["features"],
            fmt(r["best"]["us_per_feature"]),
            fmt(r["best"]["engine_us_per_feature"]),
            fmt(r["best"]["gbps"]),
        ]
        for r in results
    ]
    print(f"model device: copies free for the host, {args.gbps:g} GB/s on one engine")
    headers = ["workload", "features", "µs per feature (best run)", "engine µs", "GB/s"]
    print(markdown_table(headers, rows))
    write_json(args.out, {"gbps": args.gbps, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

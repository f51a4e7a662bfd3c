"""Trace the offload pipeline on the GPU timeline: where the copy engine idles, and why.

Every device-to-host copy gets timing events before and after it on the D2H stream;
the script also records when each copy was enqueued, when the fence waiter saw it
land and when the cache's event loop handled the landing. Idle gaps of the copy
engine are then split into "starved" (the next copy was enqueued after the engine
ran dry) and the latency chain that made it late.

    python benchmarks/trace_offload.py --mb 8 --count 256            # through FeatureCache
    python benchmarks/trace_offload.py --mb 8 --count 256 --depth 4  # device only, 4 in flight
    python benchmarks/trace_offload.py --mb 1 --count 2048 --group 8 # put_many of 8
    python benchmarks/trace_offload.py --mb 0.0625 --count 16384 --group 128 --split

CUDA only (the simulator has no GPU timeline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    SelectorWaits,
    burst_features,
    concat_batches,
    put_in_groups,
    put_in_splits,
    timing_event,
)

from mmcache import CacheSettings, FeatureCache  # noqa: E402
from mmcache.device.base import Fence  # noqa: E402
from mmcache.device.cuda import CudaDevice, CudaFence  # noqa: E402
from mmcache.waiting import FenceWatcher  # noqa: E402

HIDDEN = 4096


@dataclass
class CopyTrace:
    """One enqueued copy (or batch) and what happened to it."""

    nbytes: int
    enqueued: float  # perf_counter when copy_d2h was called
    enqueue_s: float  # seconds the call took
    start: torch.cuda.Event
    end: torch.cuda.Event
    seen_by_waiter: float = 0.0
    seen_by_loop: float = 0.0


@dataclass
class Timeline:
    """CPU and GPU times on one clock: GPU events are placed relative to a synced base event."""

    base_event: torch.cuda.Event
    base_cpu: float
    copies: list[CopyTrace] = field(default_factory=list)

    @classmethod
    def start(cls, stream: torch.cuda.Stream) -> Timeline:
        base = timing_event()
        stream.synchronize()
        base.record(stream)
        base.synchronize()  # a spinning (non-blocking) event: returns within microseconds
        return cls(base, time.perf_counter())

    def gpu_time(self, event: torch.cuda.Event) -> float:
        return self.base_cpu + float(self.base_event.elapsed_time(event)) / 1e3


class TracingCudaDevice(CudaDevice):
    """CudaDevice that brackets every D2H copy with timing events while timeline is set."""

    timeline: Timeline | None = None

    def copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        if self.timeline is None:  # untraced: exactly the plain device's work
            return super().copy_d2h(src, dst, after)
        return self._traced(
            src.nbytes, lambda: super(TracingCudaDevice, self).copy_d2h(src, dst, after)
        )

    def copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> CudaFence:
        if self.timeline is None:
            return super().copy_d2h_batch(srcs, host, offsets, after, owned=owned)
        nbytes = sum(src.nbytes for src in srcs)
        return self._traced(
            nbytes,
            lambda: super(TracingCudaDevice, self).copy_d2h_batch(
                srcs, host, offsets, after, owned=owned
            ),
        )

    def _traced(self, nbytes: int, enqueue: Callable[[], CudaFence]) -> CudaFence:
        t0 = time.perf_counter()
        start = timing_event()
        start.record(self.d2h_stream)
        fence = enqueue()
        end = timing_event()
        end.record(self.d2h_stream)
        t1 = time.perf_counter()
        if self.timeline is None:
            return fence
        trace = CopyTrace(nbytes, t0, t1 - t0, start, end)
        self.timeline.copies.append(trace)

        def seen() -> None:
            trace.seen_by_waiter = time.perf_counter()

        fence.add_done_callback(seen)  # queued before the caller's callback on the same waiter
        fence_traces[id(fence)] = trace
        return fence


fence_traces: dict[int, CopyTrace] = {}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def analyse(timeline: Timeline, wall: float) -> dict[str, Any]:
    """Busy fraction, idle gaps and the latency chain, in microseconds."""
    copies = timeline.copies
    starts = [timeline.gpu_time(c.start) for c in copies]
    ends = [timeline.gpu_time(c.end) for c in copies]
    durations = [(e - s) * 1e6 for s, e in zip(starts, ends, strict=True)]
    busy = sum(e - s for s, e in zip(starts, ends, strict=True))
    span = ends[-1] - starts[0]
    gaps, starved, starved_by = [], 0, []
    for k in range(1, len(copies)):
        gap = starts[k] - ends[k - 1]
        gaps.append(gap * 1e6)
        if gap > 5e-6 and copies[k].enqueued > ends[k - 1]:
            starved += 1
            starved_by.append((copies[k].enqueued - ends[k - 1]) * 1e6)
    depth = []
    for k, c in enumerate(copies):
        depth.append(sum(1 for j in range(k) if ends[j] > c.enqueued))
    waiter = [
        (c.seen_by_waiter - e) * 1e6 for c, e in zip(copies, ends, strict=True) if c.seen_by_waiter
    ]
    loop = [
        (c.seen_by_loop - c.seen_by_waiter) * 1e6
        for c in copies
        if c.seen_by_loop and c.seen_by_waiter
    ]
    nbytes = sum(c.nbytes for c in copies)

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "p50": _pct(values, 0.5),
            "p90": _pct(values, 0.9),
            "max": max(values) if values else float("nan"),
            "mean": statistics.fmean(values) if values else float("nan"),
        }

    return {
        "copies": len(copies),
        "bytes": nbytes,
        "wall_gbps": nbytes / wall / 1e9,
        "engine_gbps_while_busy": nbytes / busy / 1e9,
        "busy_fraction_of_span": busy / span,
        "span_fraction_of_wall": span / wall,
        "copy_us": summary(durations),
        "gap_us": summary(gaps),
        "starved_gaps": starved,
        "starved_by_us": summary(starved_by),
        "depth_at_enqueue": summary([float(d) for d in depth]),
        "enqueue_call_us": summary([c.enqueue_s * 1e6 for c in copies]),
        "landed_to_waiter_us": summary(waiter),
        "waiter_to_loop_us": summary(loop),
    }


async def through_cache(args: argparse.Namespace, device: TracingCudaDevice) -> dict[str, Any]:
    rows = max(1, int(args.mb * 2**20 / (HIDDEN * 2)))
    nbytes = rows * HIDDEN * 2
    total = nbytes * args.count
    settings = CacheSettings(
        gpu_cache_mb=total * args.gpu_fraction / 2**20,
        cpu_cache_mb=total * 1.1 / 2**20 + 16,
        evict_ahead=args.evict_ahead,
    )
    features: list[torch.Tensor | None] = [
        torch.full((rows, HIDDEN), float(i % 7), dtype=torch.bfloat16, device=device.name)
        for i in range(args.count)
    ]
    # put_split takes an encoder's batch output: the batches exist before the clock runs.
    batches = concat_batches(features, args.group) if args.split else []
    cache = FeatureCache(settings, device)
    async with cache:
        await cache.wait_host_ready(timeout=60)
        original: Callable[..., None] = getattr(cache, "_offloads_done")  # noqa: B009

        def offloads_done(batch: list[Any], *rest: Any) -> None:
            trace = fence_traces.get(id(batch[0].copy_fence))  # the batch shares one fence
            if trace is not None and not trace.seen_by_loop:
                trace.seen_by_loop = time.perf_counter()
            original(batch, *rest)

        setattr(cache, "_offloads_done", offloads_done)  # noqa: B010
        idle = SelectorWaits(asyncio.get_running_loop())
        timeline = Timeline.start(device.d2h_stream)
        device.timeline = timeline
        begin = time.perf_counter()
        idle.start()
        # --burst-mb: yield to the loop between bursts, as bench_offload.py's producers do.
        burst = 0 if args.burst_mb is None else burst_features(args.burst_mb * 2**20, nbytes)
        if args.split:
            calls = await put_in_splits(cache, batches, args.group, burst=burst > 0)
        else:
            calls = await put_in_groups(cache, features, args.group, burst=burst)
        put_waits = [s * 1e6 for s in calls]
        await cache.drain()
        wall = time.perf_counter() - begin
        idle.stop()
        device.timeline = None
    result = analyse(timeline, wall)
    # Idle: the loop blocked in select, nothing to run. High idle with a starved copy
    # engine means latency (landings reported late); low idle means Python is the limit.
    result["loop_idle_fraction"] = idle.seconds / wall
    result["put_us"] = {
        "p50": _pct(put_waits, 0.5),
        "p90": _pct(put_waits, 0.9),
        "max": max(put_waits),
    }
    return result


async def device_only(args: argparse.Namespace, device: TracingCudaDevice) -> dict[str, Any]:
    """Keep depth copies in flight; enqueue the next when the loop sees one land."""
    rows = max(1, int(args.mb * 2**20 / (HIDDEN * 2)))
    sources = [
        torch.full((rows, HIDDEN), float(i % 7), dtype=torch.bfloat16, device=device.name)
        for i in range(args.depth + 1)
    ]
    nbytes = sources[0].nbytes
    arena = device.host_arena(nbytes * (args.depth + 1))
    torch.cuda.synchronize()
    loop = asyncio.get_running_loop()
    watcher = FenceWatcher(loop)
    done = loop.create_future()
    issued = landed = 0
    timeline = Timeline.start(device.d2h_stream)
    device.timeline = timeline

    def issue() -> None:
        nonlocal issued
        slot = issued % (args.depth + 1)
        dst = arena[slot * nbytes : (slot + 1) * nbytes]
        fence = device.copy_d2h(sources[slot], dst, after=())
        trace = fence_traces[id(fence)]
        issued += 1

        def on_landed() -> None:
            nonlocal landed
            trace.seen_by_loop = time.perf_counter()
            landed += 1
            if issued < args.count:
                issue()
            elif landed == args.count and not done.done():
                done.set_result(None)

        watcher.when_done([fence], on_landed)

    begin = time.perf_counter()
    for _ in range(min(args.depth, args.count)):
        issue()
    await done
    wall = time.perf_counter() - begin
    device.timeline = None
    return analyse(timeline, wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--gpu-fraction", type=float, default=0.25)
    parser.add_argument("--evict-ahead", type=float, default=0.125)
    parser.add_argument("--depth", type=int, default=0, help="device only: copies in flight")
    parser.add_argument("--group", type=int, default=1, help="through the cache: put_many size")
    parser.add_argument("--split", action="store_true", help="put_split batches of --group")
    parser.add_argument(
        "--burst-mb",
        type=float,
        default=None,
        help="through the cache: yield to the event loop after each this many MiB of features "
        "(default: never yield)",
    )
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (s)")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("trace_offload: needs a CUDA device")
        return 0
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    device = TracingCudaDevice(0)
    run = device_only if args.depth else through_cache
    result = asyncio.run(run(args, device))
    device.close()
    result["args"] = vars(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

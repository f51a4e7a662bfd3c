"""Offload benchmark: sync .cpu(), torch's pinned non_blocking copies and mmcache, one workload.

Run from the repository root (about two minutes on an H200; --quick: under a minute):

    python benchmarks/bench_offload.py --out bench.json [--quick] [--device cuda|sim]

It first probes each core's Python speed (on shared hosts some cores run far slower,
and which ones changes from minute to minute) and reports the cores the event loop's
thread ran on; --loop-cores fast keeps the run on the cores the probe found fast. The
objects of start-up are frozen out of the garbage collector's reach first, as serving
engines do after warm-up (SGLang's freeze_gc, vLLM's freeze after warm-up); a full
collection over torch's objects would stall a phase by ~100 ms. Each mmcache offload
phase runs --rounds times (default 3) and reports its median round: a round's timed part
can be as short as 15 ms, which one scheduling hiccup moves by a third. Every strategy's
producer hands over its features in batches of 8 MiB (an encoder batch; an 8 MB feature
alone) and yields to the event loop between batches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# Run as a script from a checkout: make the package and the sibling helpers importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    DTYPE,
    HIDDEN,
    HOST_READY_TIMEOUT_S,
    SPECS,
    LoopLag,
    MiB,
    burst_features,
    concat_batches,
    copy_to_slot,
    core_speeds,
    cuda_elapsed_s,
    current_core,
    describe_cores,
    gbps,
    host_speed,
    markdown_table,
    pin_to_fast_cores,
    pinned_pool_bytes,
    put_in_groups,
    put_in_splits,
    summary_us,
    timing_event,
    write_json,
)

from mmcache.device.cuda import CudaDevice  # noqa: E402

if TYPE_CHECKING:
    from mmcache import FeatureCache

GET_SAMPLES = 50
PHASE_TIMEOUT_S = 120.0
#: put_many groups: about this many bytes of features a call (a few images, a video's
#: frames); also the producers' default burst between yields, so a call is one burst.
GROUP_BYTES = 8 * MiB


@dataclass
class Workload:
    """count features of rows x HIDDEN bf16, each a fresh tensor with its own storage.

    Every strategy's producer hands them over burst_bytes at a time (an encoder batch)
    and yields to the event loop between bursts, as a serving loop goes on to other work.
    """

    name: str
    rows: int
    count: int
    base: torch.Tensor
    burst_bytes: int = GROUP_BYTES

    @classmethod
    def build(
        cls,
        name: str,
        rows: int,
        total_bytes: int,
        device: torch.device,
        burst_bytes: int = GROUP_BYTES,
    ) -> Workload:
        """A workload of about total_bytes; values come from one random base tensor."""
        nbytes = rows * HIDDEN * DTYPE.itemsize
        base = torch.randn(rows + 256, HIDDEN, device=device).to(DTYPE)
        return cls(name, rows, max(8, total_bytes // nbytes), base, burst_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of one feature."""
        return self.rows * HIDDEN * DTYPE.itemsize

    @property
    def burst(self) -> int:
        """Features handed over between yields to the event loop (at least one)."""
        return burst_features(self.burst_bytes, self.nbytes)

    @property
    def total_bytes(self) -> int:
        """Bytes of all features."""
        return self.nbytes * self.count

    def expected(self, i: int) -> torch.Tensor:
        """The value of feature i (a view of the base tensor)."""
        return self.base[i % 256 : i % 256 + self.rows]

    def make(self, i: int) -> torch.Tensor:
        """A fresh copy of feature i, as an encoder would produce it."""
        return self.expected(i).clone()

    def make_all(self) -> list[torch.Tensor]:
        """Every feature, produced up front so that only the offload is timed."""
        features = [self.make(i) for i in range(self.count)]
        if self.base.is_cuda:
            torch.cuda.synchronize(self.base.device)
        return features

    def check(self, i: int, value: torch.Tensor | None) -> bool:
        """value is bit-for-bit feature i."""
        expected = self.expected(i)
        return value is not None and torch.equal(value.to(expected.device), expected)


# --- baselines (CUDA only) ------------------------------------------------------------------


def raw_pinned(w: Workload) -> dict[str, float]:
    """The ceiling: the same copies into one pinned buffer in a tight loop; one big copy."""
    features = w.make_all()
    pinned = torch.empty(w.total_bytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for i, feature in enumerate(features):
            # Inline, not copy_to_slot: the ceiling's host loop must not pay a call more.
            pinned[i * w.nbytes : (i + 1) * w.nbytes].copy_(
                feature.view(-1).view(torch.uint8), non_blocking=True
            )
        stream.synchronize()
        best = min(best, time.perf_counter() - start)
    big = min(w.total_bytes, 256 * MiB)
    flat = torch.empty(big, dtype=torch.uint8, device=w.base.device)
    host = pinned[:big]

    def one_big_copy() -> None:
        host.copy_(flat, non_blocking=True)

    peak = max(gbps(big, cuda_elapsed_s(one_big_copy, stream)) for _ in range(3))
    return {
        "loop_gbps": gbps(w.total_bytes, best),
        "peak_gbps": peak,
        "engine_gbps": engine_rate_per_feature(w, features, pinned, stream),
    }


def engine_rate_per_feature(
    w: Workload, features: list[torch.Tensor], pinned: torch.Tensor, stream: torch.cuda.Stream
) -> float:
    """The copy engine's own rate for one copy per feature, host overhead left out.

    Each group of copies is queued behind a GPU sleep, so the engine runs them back to
    back: the span between the group's first and last timing event is engine time only.
    """
    group = max(1, min(len(features), (64 * MiB) // w.nbytes, 512))
    busy_s = 0.0
    copied = 0
    for first in range(0, len(features), group):
        chunk = features[first : first + group]
        begin, end = timing_event(), timing_event()
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # ~25 ms > queueing
        begin.record(stream)
        for i, feature in enumerate(chunk, start=first):
            copy_to_slot(pinned, i, feature)
        end.record(stream)
        stream.synchronize()
        busy_s += float(begin.elapsed_time(end)) / 1e3
        copied += len(chunk) * w.nbytes
    return gbps(copied, busy_s)


async def sync_cpu(w: Workload) -> dict[str, Any]:
    """Baseline (a): t.cpu() per eviction (pageable, host-synchronous)."""
    features = w.make_all()
    hosts: list[torch.Tensor] = []
    async with LoopLag() as lag:
        start = time.perf_counter()
        for i, feature in enumerate(features, 1):
            hosts.append(feature.cpu())
            if i % w.burst == 0:
                await asyncio.sleep(0)
        wall = time.perf_counter() - start
    exact = all(w.check(i, hosts[i]) for i in range(0, w.count, max(1, w.count // 16)))
    return {"gbps": gbps(w.total_bytes, wall), "max_lag_ms": lag.max_lag_s * 1e3, "exact": exact}


async def nonblocking_pinned(w: Workload) -> dict[str, Any]:
    """Baseline (b): t.to("cpu", non_blocking=True) via torch's pinned caching allocator."""
    results: dict[str, Any] = {}
    for attempt in ("cold", "warm"):
        features = w.make_all()
        pool_before = pinned_pool_bytes() or 0
        hosts: list[torch.Tensor] = []
        async with LoopLag() as lag:
            start = time.perf_counter()
            for i, feature in enumerate(features, 1):
                hosts.append(feature.to("cpu", non_blocking=True))
                if i % w.burst == 0:
                    await asyncio.sleep(0)
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record()
            await asyncio.get_running_loop().run_in_executor(None, done.synchronize)
            wall = time.perf_counter() - start
        pool_after = pinned_pool_bytes() or 0
        exact = all(w.check(i, hosts[i]) for i in range(0, w.count, max(1, w.count // 16)))
        results[attempt] = {
            "gbps": gbps(w.total_bytes, wall),
            "max_lag_ms": lag.max_lag_s * 1e3,
            "exact": exact,
            # The caching host allocator rounds each block up to a power of two.
            "pinned_pool_bytes": pool_after,
            "pinned_pool_growth_bytes": pool_after - pool_before,
            "bytes_held": w.total_bytes,
        }
        del hosts, features
        gc.collect()
    return results


# --- mmcache ------------------------------------------------------------------------------------


class CopyTimingCudaDevice(CudaDevice):
    """CudaDevice that brackets each device-to-host DMA copy with timing events.

    Only while marks is a list; the gather kernel that packs a batch stays outside the
    brackets, a host delay between the first event and the copy stays inside. A batch
    queued by one driver call is one bracket.
    """

    marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] | None = None

    def __init__(self, index: int) -> None:
        super().__init__(index)
        # The device's copy parts call these through their instances: wrap them there.
        copies, batches = self._copies, self._batches
        copy_bytes, queue_batch = copies.copy_bytes, batches.queue_batch

        def timed_copy_bytes(dst: torch.Tensor, src: torch.Tensor, *, host: torch.Tensor) -> None:
            with self._bracket(src.nbytes if src.is_cuda else None):
                copy_bytes(dst, src, host=host)

        def timed_queue_batch(
            dsts: list[int], srcs: list[int], sizes: list[int], stream: torch.cuda.Stream
        ) -> None:
            with self._bracket(sum(sizes)):
                queue_batch(dsts, srcs, sizes, stream)

        copies.copy_bytes = timed_copy_bytes  # type: ignore[method-assign]
        batches.queue_batch = timed_queue_batch  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _bracket(self, nbytes: int | None) -> Iterator[None]:
        """Timing events on the D2H stream around the copy queued inside (nbytes None: not
        a device-to-host copy, left untimed)."""
        marks = self.marks
        if marks is None or nbytes is None:
            yield
            return
        stream = self.d2h_stream
        begin, end = timing_event(), timing_event()
        begin.record(stream)
        yield
        end.record(stream)
        marks.append((nbytes, begin, end))


def cache_settings_mb(w: Workload, gpu_fraction: float) -> tuple[int, int]:
    """(gpu_cache_mb, cpu_cache_mb): a GPU tier that forces eviction, a host tier that fits all."""
    total_mb = math.ceil(w.total_bytes / MiB)
    gpu_mb = max(1, math.floor(total_mb * gpu_fraction)) if gpu_fraction > 0 else 0
    return gpu_mb, total_mb + 4 * math.ceil(w.nbytes / MiB) + 16


async def drain(cache: FeatureCache) -> None:
    """Wait until every queued copy has landed (bounded by the phase timeout)."""
    await asyncio.wait_for(cache.drain(), PHASE_TIMEOUT_S)


def steady_state_prefill(cache: FeatureCache, w: Workload) -> int:
    """How many features fill the GPU tier up to where eviction starts (the low-water mark)."""
    capacity = cache.stats().gpu_capacity_bytes
    ahead = int(capacity * cache.settings.evict_ahead)
    return max(0, min(w.count - 1, (capacity - ahead) // w.nbytes - 1))


async def warm_up(cache: FeatureCache, w: Workload, puts: int) -> bool:
    """Wait for the whole host arena to be pinned, then evict through the cache until the
    host tier takes entries.

    The arena serves each chunk as soon as it is pinned, and pinning the rest goes on in
    the background: a phase timed meanwhile would measure the cold start (CUDA calls of
    the loop queued behind each chunk's registration), not the steady state.
    """
    if not await cache.wait_host_ready(timeout=HOST_READY_TIMEOUT_S):
        return False
    deadline = time.perf_counter() + 30.0
    for attempt in range(1000):
        keys = [("warm", attempt, j) for j in range(puts)]
        for j, key in enumerate(keys):
            await cache.put(key, w.make(j))
        await drain(cache)
        ready = cache.stats().cpu_entries > 0
        for key in keys:
            cache.discard(key)
        if ready or time.perf_counter() > deadline:
            return ready
        await asyncio.sleep(0.05)
    return False


def discard_phase(cache: FeatureCache, w: Workload, tag: str) -> None:
    """Drop every feature an offload phase put under tag."""
    for i in range(w.count):
        cache.discard(_tagged(tag, i))


def _tagged(tag: str, i: int) -> tuple[str, int]:
    return (tag, i)


async def offload_phase(
    cache: FeatureCache,
    w: Workload,
    tag: str,
    features: list[torch.Tensor | None],
    group: int = 1,
    split: bool = False,
) -> dict[str, Any]:
    """put every feature (handing over ownership), then wait for the offloads; time both.

    The producer yields to the loop after each w.burst features, as the baselines do;
    put_many and put_split calls are bursts of their own.

    The features that fit the GPU tier without eviction go in first, untimed and put
    the same way (the timed evictions move what the timed part puts): the timed part
    is a full tier's steady state, every put making room by offloading,
    until the last offload lands. group > 1: put_many of group features a call, or
    with split, put_split of a batch tensor of group features a call.
    """
    prefill = steady_state_prefill(cache, w)
    key = functools.partial(_tagged, tag)
    if split:  # the batches exist before the timed part, as features do for the others
        prefill -= prefill % group  # whole batches
        batches = concat_batches(features, group)
        await put_in_splits(cache, batches, group, stop=prefill // group, key=key, burst=True)
    else:
        await put_in_groups(cache, features, group, stop=prefill, key=key, burst=w.burst)
    await drain(cache)
    before = cache.stats()
    async with LoopLag() as lag:
        start = time.perf_counter()
        if split:
            put_latency = await put_in_splits(
                cache, batches, group, start=prefill // group, key=key, burst=True
            )
        else:
            put_latency = await put_in_groups(
                cache, features, group, start=prefill, key=key, burst=w.burst
            )
        puts_s = time.perf_counter() - start
        await drain(cache)
        wall = time.perf_counter() - start
    after = cache.stats()
    d2h = after.d2h_bytes - before.d2h_bytes
    return {
        "prefill": prefill,
        "timed_puts": w.count - prefill,
        "wall_s": wall,
        "puts_s": puts_s,
        "d2h_bytes": d2h,
        "gbps": gbps(d2h, wall),
        "put": summary_us(put_latency),
        "max_lag_ms": lag.max_lag_s * 1e3,
        "max_gc_pause_ms": lag.max_gc_pause_s * 1e3,
        "gc_collections": lag.gc_collections,
        "dropped": after.dropped - before.dropped,
    }


async def offload_rounds(
    cache: FeatureCache,
    w: Workload,
    tag: str,
    rounds: int,
    group: int = 1,
    split: bool = False,
) -> dict[str, Any]:
    """offload_phase rounds times on fresh features; the median round by GB/s (the lower
    middle one for an even count).

    Every round but the last discards its keys; the last one's stay, under tag.
    """
    phases = []
    for r in range(rounds):
        last = r == rounds - 1
        round_tag = tag if last else f"{tag}{r}"
        features: list[torch.Tensor | None] = list(w.make_all())
        phases.append(await offload_phase(cache, w, round_tag, features, group, split))
        del features
        if not last:
            discard_phase(cache, w, round_tag)
            await drain(cache)
    median = sorted(phases, key=lambda phase: phase["gbps"])[(len(phases) - 1) // 2]
    return {**median, "rounds_gbps": [phase["gbps"] for phase in phases]}


async def get_latencies(cache: FeatureCache, w: Workload, tag: str) -> dict[str, Any]:
    """get latency on GPU hits, host hits (to host and to GPU) and their exactness."""
    stats = cache.stats()
    on_gpu = min(stats.gpu_entries, w.count)
    n_gpu = min(GET_SAMPLES, on_gpu)
    n_host = min(GET_SAMPLES, max(0, (w.count - on_gpu) // 2))
    gpu_keys = list(range(w.count - n_gpu, w.count))
    host_keys = list(range(n_host))
    cpu_keys = list(range(n_host, 2 * n_host))
    cuda = w.base.is_cuda
    results: dict[str, Any] = {}
    exact = True
    async with LoopLag() as lag:
        samples: list[float] = []
        for i in gpu_keys:
            start = time.perf_counter()
            value = await cache.get((tag, i))
            samples.append(time.perf_counter() - start)
            exact &= w.check(i, value)
        results["gpu_hit"] = summary_us(samples)
        samples = []
        for i in cpu_keys:
            start = time.perf_counter()
            value = await cache.get((tag, i), device="cpu")
            samples.append(time.perf_counter() - start)
            exact &= w.check(i, value)
        results["host_hit_to_cpu"] = summary_us(samples)
        samples, ready = [], []
        for i in host_keys:
            start = time.perf_counter()
            value = await cache.get((tag, i))
            samples.append(time.perf_counter() - start)
            if cuda:  # the promoted tensor is stream-ordered: time until it is really there
                torch.cuda.current_stream().synchronize()
            ready.append(time.perf_counter() - start)
            exact &= w.check(i, value)
        results["host_hit_to_gpu"] = summary_us(samples)
        results["host_hit_to_gpu_ready"] = summary_us(ready)
    results["max_lag_ms"] = lag.max_lag_s * 1e3
    results["exact"] = exact
    return results


async def pending_get_latency(w: Workload, device: str) -> dict[str, Any]:
    """get(device="cpu") right after put with the GPU tier off: it awaits the queued D2H copy."""
    from mmcache import CacheSettings, FeatureCache

    settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=4 * math.ceil(w.nbytes / MiB) + 16)
    samples: list[float] = []
    exact = True
    cache = FeatureCache(settings, device=device)
    async with cache:
        await warm_up(cache, w, 2)
        for j in range(min(GET_SAMPLES, w.count)):
            feature = w.make(j)
            if w.base.is_cuda:
                torch.cuda.current_stream().synchronize()
            await cache.put(("pending", j), feature)
            del feature
            start = time.perf_counter()
            value = await cache.get(("pending", j), device="cpu")
            samples.append(time.perf_counter() - start)
            exact &= w.check(j, value)
            cache.discard(("pending", j))
    return {"pending_offload_to_cpu": summary_us(samples), "exact": exact}


def matmul_operands(quick: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Square bf16 operands for the compute stream's matmul."""
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda").to(DTYPE)
    b = torch.randn(n, n, device="cuda").to(DTYPE)
    return a, b, torch.empty(n, n, device="cuda", dtype=DTYPE)


async def mmcache_column(w: Workload, device: str, quick: bool, rounds: int) -> dict[str, Any]:
    """mmcache through its public API: offload, gets, pending gets, matmul interference."""
    from mmcache import CacheSettings, FeatureCache

    gpu_mb, cpu_mb = cache_settings_mb(w, 0.25)
    settings = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb)
    cuda = device != "sim"
    pool_before = pinned_pool_bytes() if cuda else None
    results: dict[str, Any] = {"gpu_cache_mb": gpu_mb, "cpu_cache_mb": cpu_mb}
    # On CUDA the device can bracket its D2H copies with timing events (only while its
    # marks list is set: the other phases run untraced).
    traced = CopyTimingCudaDevice(0) if cuda else None
    cache = FeatureCache(settings, device=traced if traced is not None else device)
    try:
        async with cache:
            results["host_tier_ready"] = await warm_up(
                cache, w, min(w.count, gpu_mb * MiB // w.nbytes + 4)
            )
            group = GROUP_BYTES // w.nbytes
            if group > 1:  # the same workload through put_many, first (its keys are discarded)
                results["offload_many"] = await offload_rounds(cache, w, "g", rounds, group)
                results["offload_many"]["group"] = group
                discard_phase(cache, w, "g")
                await drain(cache)
                results["offload_split"] = await offload_rounds(cache, w, "s", rounds, group, True)
                results["offload_split"]["group"] = group
                discard_phase(cache, w, "s")
                await drain(cache)
            results["offload"] = await offload_rounds(cache, w, "a", rounds)
            results["gets"] = await get_latencies(cache, w, "a")
            stats = cache.stats()
            results["stats"] = {
                name: getattr(stats, name)
                for name in (
                    "gpu_bytes",
                    "cpu_bytes",
                    "gpu_capacity_bytes",
                    "cpu_capacity_bytes",
                    "gpu_entries",
                    "cpu_entries",
                    "pending_copies",
                    "d2h_bytes",
                    "h2d_bytes",
                    "dropped",
                    "leaked_bytes",
                )
            }
            results["pinned"] = {
                "budget_bytes": stats.cpu_capacity_bytes,
                # Growth of torch's pinned pool while mmcache ran: its own arena is outside it.
                "torch_pool_growth_bytes": (
                    (pinned_pool_bytes() or 0) - (pool_before or 0) if cuda else None
                ),
            }
            discard_phase(cache, w, "a")
            if traced is not None:
                results["copy_engine"] = await copy_engine_phase(cache, w, traced)
                results["matmul"] = await matmul_interference(cache, w, quick, results["offload"])
    finally:
        if traced is not None:
            traced.close()
    results["pending"] = await pending_get_latency(w, device)
    return results


async def copy_engine_phase(
    cache: FeatureCache, w: Workload, traced: CopyTimingCudaDevice
) -> dict[str, Any]:
    """The same offload again, every D2H copy bracketed: the copy engine's rate on it.

    The events add host work per copy, so this phase's wall rate is not the headline.
    """
    features: list[torch.Tensor | None] = list(w.make_all())
    marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
    traced.marks = marks
    try:
        phase = await offload_phase(cache, w, "e", features)
    finally:
        traced.marks = None
    discard_phase(cache, w, "e")
    busy_s = sum(float(begin.elapsed_time(end)) for _, begin, end in marks) / 1e3
    nbytes = sum(n for n, _, _ in marks)
    return {
        "copies": len(marks),
        "bytes": nbytes,
        "features_per_copy": (phase["d2h_bytes"] / w.nbytes / len(marks)) if marks else None,
        "engine_gbps": gbps(nbytes, busy_s),
        "wall_gbps_traced": phase["gbps"],
    }


class ComputeLoad:
    """bf16 matmuls queued on their own stream, timed alone and beside other work."""

    def __init__(self, quick: bool) -> None:
        self.a, self.b, self.c = matmul_operands(quick)
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.matmuls(3)  # warm-up (cuBLAS handles, clocks)
        self.alone_s = cuda_elapsed_s(lambda: self.matmuls(20), self.stream) / 20

    def matmuls(self, k: int) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(k):
                torch.mm(self.a, self.b, out=self.c)

    def calibrate(self, seconds: float) -> int:
        """How many matmuls cover seconds of GPU time (and re-time one alone)."""
        k = max(5, min(5000, math.ceil(seconds / self.alone_s)))
        self.alone_s = cuda_elapsed_s(lambda: self.matmuls(k), self.stream) / k
        return k

    def start(self, k: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue k matmuls between two timing events; returns the events."""
        begin = timing_event()
        end = timing_event()
        begin.record(self.stream)
        self.matmuls(k)
        end.record(self.stream)
        return begin, end

    def slowdown(self, events: tuple[torch.cuda.Event, torch.cuda.Event], k: int) -> float:
        """Time per matmul beside the other work, over time per matmul alone."""
        begin, end = events
        return float(begin.elapsed_time(end)) / 1e3 / k / self.alone_s


def matmul_under_raw_copies(w: Workload, quick: bool) -> dict[str, Any]:
    """The physical baseline: the matmuls beside a bare pinned copy loop of the features.

    Copies repeat on a side stream until the last matmul ends, so every matmul overlaps
    D2H traffic at the raw loop's rate; whatever slowdown this shows, no offload
    strategy running at that rate can avoid.
    """
    load = ComputeLoad(quick)
    k = load.calibrate(0.5)
    features = w.make_all()
    pinned = torch.empty(w.total_bytes, dtype=torch.uint8, pin_memory=True)
    copies = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    events = load.start(k)
    copied = 0
    with torch.cuda.stream(copies):
        while not events[1].query():  # type: ignore[no-untyped-call]
            for i, feature in enumerate(features):
                copy_to_slot(pinned, i, feature)
            copies.synchronize()
            copied += w.total_bytes
    events[1].synchronize()
    return {"slowdown": load.slowdown(events, k), "bytes_copied": copied}


async def matmul_interference(
    cache: FeatureCache, w: Workload, quick: bool, alone: dict[str, Any]
) -> dict[str, Any]:
    """bf16 matmuls on a compute stream, alone and while the same offload runs."""
    load = ComputeLoad(quick)
    # Enough matmuls to cover the whole offload, so every copy overlaps compute.
    k = load.calibrate(1.5 * alone["wall_s"])
    features: list[torch.Tensor | None] = list(w.make_all())
    events = load.start(k)
    offload = await offload_phase(cache, w, "m", features)
    await asyncio.get_running_loop().run_in_executor(None, events[1].synchronize)
    discard_phase(cache, w, "m")
    return {
        "matmul_ms_alone": load.alone_s * 1e3,
        "slowdown": load.slowdown(events, k),
        "overlap": min(1.0, k * load.alone_s / offload["wall_s"]),
        "offload_gbps_under_compute": offload["gbps"],
    }


# --- driver -------------------------------------------------------------------------------------


async def run(
    device: str, quick: bool, cores: dict[str, Any], rounds: int, burst_bytes: int
) -> dict[str, Any]:
    """Every column for every feature size."""
    cuda = device != "sim"
    total = (256 if quick else 1024) * MiB if cuda else 32 * MiB
    torch_device = torch.device("cuda") if cuda else torch.device("cpu")
    results: dict[str, Any] = {
        "device": device,
        "quick": quick,
        "rounds": rounds,
        "burst_bytes": burst_bytes,
        "sizes": {},
        "cores": cores,
    }
    ran_on = {current_core()}
    if cuda:
        props = torch.cuda.get_device_properties(torch_device)
        results["gpu"] = props.name
        results["torch"] = torch.__version__
        results["cuda"] = torch.version.cuda
    results["host"] = host_speed(cuda)
    try:
        from mmcache import FeatureCache  # noqa: F401
    except ImportError as exc:
        mmcache_error: str | None = f"mmcache public API unavailable: {exc}"
    else:
        mmcache_error = None
    for name, rows in SPECS.items():
        w = Workload.build(name, rows, total, torch_device, burst_bytes)
        print(f"[{name}] {w.count} features, {w.total_bytes / MiB:.0f} MiB", file=sys.stderr)
        row: dict[str, Any] = {
            "count": w.count,
            "feature_bytes": w.nbytes,
            "burst_features": w.burst,
        }
        if cuda:
            row["raw"] = raw_pinned(w)
            row["raw"]["matmul"] = matmul_under_raw_copies(w, quick)
            row["sync_cpu"] = await sync_cpu(w)
            row["nonblocking"] = await nonblocking_pinned(w)
        if mmcache_error is None:
            ran_on.add(current_core())
            row["mmcache"] = await mmcache_column(w, device, quick, rounds)
            ran_on.add(current_core())
        else:
            row["mmcache"] = {"error": mmcache_error}
        results["sizes"][name] = row
        del w
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    cores["loop_ran_on"] = sorted(ran_on)
    return results


def _get(d: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return float(a) / float(b)
    return None


def report(results: dict[str, Any]) -> str:
    """Detail tables, then the summary table with ratios against the baselines (last)."""
    sizes: dict[str, dict[str, Any]] = results["sizes"]
    out = []
    speed = results.get("host", {})
    out.append(
        "host speed, µs per op (lower is faster): "
        + ", ".join(f"{k.removesuffix('_us')} {v:.3f}" for k, v in speed.items())
    )
    cores = results.get("cores", {})
    if cores.get("speeds"):
        speeds = {int(core): us for core, us in cores["speeds"].items()}
        pinned = cores.get("pinned_to")
        out.append(
            f"cores (python probe each): {describe_cores(speeds)}; "
            + (f"pinned to cores {', '.join(map(str, pinned))}; " if pinned else "")
            + "the event loop's thread was seen on cores "
            + ", ".join(
                f"{c} ({speeds[c]:.3f} µs)" if c in speeds else str(c)
                for c in cores.get("loop_ran_on", [])
            )
        )
    frozen = results.get("gc_frozen_objects")
    out.append(
        f"garbage collector: {frozen:,} objects of start-up frozen"
        if frozen
        else "garbage collector: nothing frozen (--no-gc-freeze)"
    )
    out.append("### get latency, µs (p50 / p99)")
    rows: list[list[Any]] = []
    for name, r in sizes.items():
        m = r.get("mmcache", {})

        def cell(*path: str, m: dict[str, Any] = m) -> str:
            s = _get(m, *path)
            return f"{s['p50_us']:.0f} / {s['p99_us']:.0f}" if s else "-"

        rows.append(
            [
                name,
                cell("gets", "gpu_hit"),
                cell("gets", "host_hit_to_cpu"),
                cell("gets", "host_hit_to_gpu"),
                cell("gets", "host_hit_to_gpu_ready"),
                cell("pending", "pending_offload_to_cpu"),
                cell("offload", "put"),
            ]
        )
    out.append(
        markdown_table(
            [
                "size",
                "GPU hit",
                "host hit -> cpu",
                "host hit -> GPU (API)",
                "host hit -> GPU (ready)",
                "pending offload -> cpu",
                "put",
            ],
            rows,
        )
    )
    out.append(
        "\n### Copy engine: GB/s of D2H copy time (raw: one copy per feature, queued back "
        "to back behind a GPU sleep; mmcache: timing events around each of its offload copies)"
    )
    rows = []
    for name, r in sizes.items():
        raw_engine = _get(r, "raw", "engine_gbps")
        mm_engine = _get(r, "mmcache", "copy_engine", "engine_gbps")
        rows.append(
            [
                name,
                raw_engine,
                mm_engine,
                _get(r, "mmcache", "copy_engine", "features_per_copy"),
                _ratio(mm_engine, raw_engine),
                _get(r, "raw", "peak_gbps"),
            ]
        )
    out.append(
        markdown_table(
            [
                "size",
                "raw: copy per feature",
                "mmcache: batched copies",
                "features per mmcache copy",
                "mmcache ÷ raw",
                "raw peak (one 256 MiB copy)",
            ],
            rows,
        )
    )
    out.append("\n### pinned host memory and compute interference")
    rows = []
    for name, r in sizes.items():
        rows.append(
            [
                name,
                _get(r, "nonblocking", "cold", "bytes_held"),
                _get(r, "nonblocking", "cold", "pinned_pool_growth_bytes"),
                _get(r, "mmcache", "pinned", "budget_bytes"),
                _get(r, "mmcache", "pinned", "torch_pool_growth_bytes"),
                _get(r, "raw", "matmul", "slowdown"),
                _get(r, "mmcache", "matmul", "slowdown"),
                _get(r, "mmcache", "matmul", "offload_gbps_under_compute"),
            ]
        )
    out.append(
        markdown_table(
            [
                "size",
                "non_blocking: bytes held",
                "non_blocking: pinned pool growth",
                "mmcache: pinned arena (budget)",
                "mmcache: torch pool growth",
                "matmul slowdown beside the raw copy loop (x)",
                "matmul slowdown beside mmcache (x)",
                "mmcache GB/s under compute",
            ],
            rows,
        )
    )
    out.append(
        "\n### Offload summary (GB/s; ratios are mmcache / baseline; "
        "mmcache: one put per feature, put_many: 8 MiB of features a call, "
        f"put_split: 8 MiB batch tensors a call; mmcache: median of {results.get('rounds', 1)} "
        f"rounds; every strategy's producer yields to the event loop after each "
        f"{results.get('burst_bytes', 0) / MiB:g} MiB of features, at least one)"
    )
    rows = []
    for name, r in sizes.items():
        mm = _get(r, "mmcache", "offload", "gbps")
        many = _get(r, "mmcache", "offload_many", "gbps")
        split = _get(r, "mmcache", "offload_split", "gbps")
        rows.append(
            [
                name,
                _get(r, "raw", "loop_gbps"),
                _get(r, "raw", "peak_gbps"),
                _get(r, "sync_cpu", "gbps"),
                _get(r, "nonblocking", "warm", "gbps"),
                mm,
                many,
                split,
                _ratio(mm, _get(r, "raw", "loop_gbps")),
                _ratio(many, _get(r, "raw", "loop_gbps")),
                _ratio(split, _get(r, "raw", "loop_gbps")),
                _ratio(mm, _get(r, "raw", "peak_gbps")),
                _ratio(mm, _get(r, "sync_cpu", "gbps")),
                _ratio(mm, _get(r, "nonblocking", "warm", "gbps")),
                "/".join(
                    f"{v:.1f}" if isinstance(v, float) else "-"
                    for v in (
                        _get(r, "sync_cpu", "max_lag_ms"),
                        _get(r, "nonblocking", "warm", "max_lag_ms"),
                        _get(r, "mmcache", "offload", "max_lag_ms"),
                    )
                ),
                _get(r, "mmcache", "offload", "max_gc_pause_ms"),
                "/".join(f"{v:.1f}" for v in _get(r, "mmcache", "offload", "rounds_gbps") or []),
            ]
        )
    out.append(
        markdown_table(
            [
                "size",
                "raw pinned loop",
                "raw pinned peak",
                "sync .cpu()",
                "non_blocking (warm)",
                "mmcache",
                "mmcache put_many",
                "mmcache put_split",
                "÷ raw loop",
                "put_many ÷ raw loop",
                "put_split ÷ raw loop",
                "÷ raw peak",
                "÷ sync",
                "÷ non_blocking",
                "loop lag ms sync/nb/mmcache",
                "mmcache: longest GC pause ms",
                "mmcache one put: each round's GB/s",
            ],
            rows,
        )
    )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse arguments, run, print tables (summary last), write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", help="write results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="256 MiB per size, smaller matmul")
    parser.add_argument(
        "--device",
        choices=("cuda", "sim"),
        default="cuda",
        help="sim: only the mmcache column, on the CPU simulator (exercises the script)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of each mmcache offload phase; the median round is reported",
    )
    parser.add_argument(
        "--loop-cores",
        choices=("all", "fast"),
        default="all",
        help="fast: keep the benchmark's main thread (its event loop), and the threads it "
        "starts from then on, on the cores whose probe ran within 15%% of the fastest one",
    )
    parser.add_argument(
        "--burst-mb",
        type=float,
        default=GROUP_BYTES / MiB,
        help="MiB of features every strategy's producer hands over between yields to the "
        "event loop (an encoder batch; 0: yield after every feature)",
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the objects of start-up (torch's among them) to the garbage collector",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.burst_mb >= 0:
        parser.error("--burst-mb must be 0 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: bench_offload compares GPU offload paths; nothing to do")
        print("(use --device sim to run the mmcache column on the simulator)")
        write_json(args.out, {"skipped": "no CUDA device"})
        return 0
    cores: dict[str, Any] = {"speeds": core_speeds()}
    if args.loop_cores == "fast":
        cores["pinned_to"] = pin_to_fast_cores(cores["speeds"])
    frozen = 0
    if not args.no_gc_freeze:
        # As serving engines do once started: with torch loaded, a full collection scans
        # about 180,000 objects and takes ~100 ms, which one 15 ms phase cannot absorb.
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    start = time.perf_counter()
    burst_bytes = int(args.burst_mb * MiB)
    results = asyncio.run(run(args.device, args.quick, cores, args.rounds, burst_bytes))
    results["gc_frozen_objects"] = frozen
    results["elapsed_s"] = time.perf_counter() - start
    print(report(results))
    print(f"\nbench took {results['elapsed_s']:.1f} s", file=sys.stderr)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Serving workload: concurrent scheduler requests through mmcache and the designs it replaces.

C request tasks (default 64) share one event loop. Each request looks up 1-4 images drawn
with Zipf popularity from a catalogue; a miss "encodes" on the GPU (a matmul loop of about
--encode-ms GPU time, sized at start-up by timing it, then a feature made from the image
id) and stores the feature. Every feature a request gets back is consumed by a kernel on
the current stream that checks it against its expected value on the device; the mismatch
count is read once per run, so no operation synchronises the host. In the same run, on
the same seeded request sequence, five designs serve it:

1. a plain dict that never evicts (unlimited GPU memory: the floor no cache can beat);
2. a GPU LRU whose evictions are copied with a synchronous `.cpu()` into a host LRU, a
   host hit uploaded with `.to(device)`;
3. SGLang-style: the GPU LRU evicts with `to("cpu", non_blocking=True)` (torch's caching
   host allocator) and one completion event, synchronised before the host copy is read;
4. mmcache, one `get_or_compute` per image;
5. mmcache, `get_many` for a request's images (misses through `get_or_compute`), where
   FeatureCache has it.

The GPU tier of 2-5 is --gpu-fraction of the working set, the host tier --cpu-fraction;
mmcache's pinned arena is ready before the warm-up. After --warmup seconds, a window of
--seconds measures requests per second (the GPU's backlog at the window's end counted in
its length), request latency (from the request's arrival, which waits for a turn of the
loop, to its features consumed), the loop thread's CPU time per feature served, the lateness
of a 1 ms ticker task, and the work units a front-end task completed (a small fixed piece
of Python between yields, as tokenising and HTTP handling are: the loop's availability).
A single-client phase then times mmcache's calls one at a time (loop-thread CPU, which
leaves out copy and wait time) and classes them by what the cache's counters did.

On a shared host a design's window can land on a slow core or a busy moment: --rounds N
runs each design's window N times, the designs taking turns, and reports each design's
median round with its range; --loop-cores fast keeps the process on the cores a Python
probe finds fastest.

    python benchmarks/bench_serving.py [--device cuda|sim] [--sizes 64KB 1MB 8MB] [--quick]
        [--concurrency C] [--catalogue N] [--zipf S] [--encode-ms MS] [--gpu-fraction F]
        [--cpu-fraction F] [--seconds S] [--warmup S] [--rounds N] [--loop-cores fast]
        [--out F]

On --device sim the cache runs on the simulator and the baselines on plain CPU tensors,
with no encode kernel: the figures exercise the script and its checks, not a GPU. Exits
non-zero when any design served a wrong value or mmcache leaked a byte.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import gc
import itertools
import math
import random
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    DTYPE,
    GB,
    HIDDEN,
    HOST_READY_TIMEOUT_S,
    SPECS,
    LoopLag,
    MiB,
    core_speeds,
    cuda_elapsed_s,
    describe_cores,
    fmt,
    gbps,
    markdown_table,
    median,
    percentile,
    pin_to_fast_cores,
    summary_us,
    write_json,
)
from prometheus_client import CollectorRegistry  # noqa: E402

from mmcache import CacheSettings, CacheStats, FeatureCache  # noqa: E402
from mmcache.device import Device  # noqa: E402

FLOOR = "plain dict, never evicts (floor)"
SYNC_CPU = "sync .cpu() LRU"
SGLANG = "SGLang-style (non_blocking + event)"
MM_GET = "mmcache get"
MM_MANY = "mmcache get_many"
STRATEGIES = (FLOOR, SYNC_CPU, SGLANG, MM_GET, MM_MANY)
NO_GET_MANY = "n/a (no get_many)"
#: Loop-thread CPU per call that mmcache aims at, in µs, by operation class.
#: A put that evicts offloads a batch ahead (evict_ahead), so its own figure says little per
#: feature: this one is the CPU of every put from the first eviction on over what they evicted.
FULL_TIER_PUTS = "put into a full tier, per feature evicted"
OP_TARGETS_US = {"GPU hit": 10.0, "host hit -> device": 40.0, FULL_TIER_PUTS: 30.0}
OP_CLASSES = ("GPU hit", "host hit -> device", "miss", "put that evicts", "put (no eviction)")
#: Pattern values and image ids stay below this, so their int16 sum cannot overflow.
PATTERN_LIMIT = 1 << 14
REQUEST_POOL = 1 << 16
FRONT_END_LOOPS = 100
TICK_S = 0.001


@dataclass(frozen=True, slots=True)
class Config:
    """What one run measures (sizes by name: 64KB, 1MB, 8MB or any <number>KB|MB)."""

    device: str
    sizes: tuple[str, ...] = ("64KB", "1MB", "8MB")
    concurrency: int = 64
    catalogue: int = 400
    zipf: float = 0.8
    encode_ms: float = 1.0
    gpu_fraction: float = 0.2
    cpu_fraction: float = 1.1
    seconds: float = 5.0
    warmup_s: float = 1.0
    op_calls: int = 2000
    seed: int = 0
    rounds: int = 1
    profile_dir: str | None = None

    @property
    def simulated(self) -> bool:
        """Whether the cache runs on the CPU simulator (and the baselines on CPU tensors)."""
        return self.device == "sim"

    @property
    def tensor_device(self) -> torch.device:
        """Where the workload's "device" tensors live."""
        return torch.device("cpu" if self.simulated else self.device)


DEFAULTS = Config(device="cuda")


def feature_rows(size: str) -> int:
    """Rows of HIDDEN bf16 values of a feature named like 64KB or 1MB (at least one)."""
    if size in SPECS:
        return SPECS[size]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(KB|MB)", size)
    if match is None:
        raise ValueError(f"feature size {size!r}: give it as <number>KB or <number>MB, e.g. 1MB")
    nbytes = float(match[1]) * (1024 if match[2] == "KB" else MiB)
    return max(1, int(nbytes) // (HIDDEN * DTYPE.itemsize))


# --- the workload ---------------------------------------------------------------------------


class EncodeKernel:
    """A matmul loop of about target_s of GPU time on the current stream, sized by timing it."""

    def __init__(self, target_s: float, device: torch.device) -> None:
        self.reps = 0
        self.gpu_s = 0.0
        self.n = 0
        if target_s <= 0:
            return
        stream = torch.cuda.current_stream(device)
        n, seconds = 128, 0.0
        while True:
            a = torch.randn(n, n, device=device).to(DTYPE)
            self.a, self.b, self.out = a, a.clone(), torch.empty_like(a)
            self._once()  # cuBLAS picks and loads its kernel on the first call
            seconds = min(cuda_elapsed_s(self._once, stream) for _ in range(3))
            if seconds >= target_s / 8 or n >= 8192:
                break
            n *= 2
        self.reps = max(1, round(target_s / seconds))
        self.gpu_s = self.reps * seconds
        self.n = n

    def describe(self) -> str:
        """What one encode queues, e.g. '4 bf16 matmuls of 4096x4096'."""
        return f"{self.reps} bf16 matmuls of {self.n}x{self.n}" if self.reps else "nothing"

    def _once(self) -> None:
        torch.matmul(self.a, self.b, out=self.out)

    def __call__(self) -> None:
        for _ in range(self.reps):
            self._once()


class Features:
    """The features of one size: the encoder, and the check that consumes what a request got.

    Image i's feature is pattern + i as int16, seen as bf16: any other image's bytes, a
    zero-filled or poisoned (NaN) buffer, or a half-written one differs from it.
    """

    def __init__(self, rows: int, cfg: Config, kernel: EncodeKernel | None) -> None:
        generator = torch.Generator().manual_seed(cfg.seed + rows)
        pattern = torch.randint(
            0, PATTERN_LIMIT, (rows, HIDDEN), dtype=torch.int16, generator=generator
        )
        self.pattern = pattern.to(cfg.tensor_device)
        self.rows = rows
        self.kernel = kernel
        self._wrong = torch.zeros((), dtype=torch.int64, device=cfg.tensor_device)
        self._wrong_on_host = 0

    @property
    def nbytes(self) -> int:
        """Bytes of one feature."""
        return self.rows * HIDDEN * DTYPE.itemsize

    def encode(self, image: int) -> torch.Tensor:
        """Image's feature, made on the current stream after the encoder's kernel."""
        if self.kernel is not None:
            self.kernel()
        return torch.add(self.pattern, image).view(DTYPE)

    def consume(self, image: int, feature: torch.Tensor | None) -> None:
        """Check feature on the current stream, counting a wrong one on the device."""
        if feature is None or feature.shape != self.pattern.shape or feature.dtype != DTYPE:
            self._wrong_on_host += 1
            return
        differs = torch.sub(feature.view(torch.int16), self.pattern).ne_(image)
        self._wrong.add_(differs.any())

    def take_wrong(self) -> int:
        """Wrong features consumed since the last call (synchronises the host once)."""
        wrong = int(self._wrong.item()) + self._wrong_on_host
        self._wrong.zero_()
        self._wrong_on_host = 0
        return wrong


class Requests:
    """The seeded request sequence: each request 1-4 distinct images, Zipf-popular."""

    def __init__(self, cfg: Config) -> None:
        rng = random.Random(cfg.seed)
        images = range(cfg.catalogue)
        weights = list(itertools.accumulate(1.0 / (k + 1) ** cfg.zipf for k in images))
        self.pool = [
            tuple(dict.fromkeys(rng.choices(images, cum_weights=weights, k=rng.randint(1, 4))))
            for _ in range(REQUEST_POOL)
        ]
        self._next = 0

    def restart(self) -> None:
        """From the first request again (each design serves the same sequence)."""
        self._next = 0

    def next(self) -> tuple[int, ...]:
        """The next request's images."""
        request = self.pool[self._next % REQUEST_POOL]
        self._next += 1
        return request


# --- the designs ----------------------------------------------------------------------------


class Strategy(Protocol):
    """One design under test."""

    async def start(self) -> None:
        """Get ready to serve (mmcache: its host arena pinned)."""

    async def fetch(self, images: Sequence[int]) -> list[torch.Tensor | None]:
        """The features of a request's images, encoding and storing the misses."""

    async def finish(self) -> dict[str, Any]:
        """Settle, release everything, and return the design's own figures."""


@dataclass(slots=True)
class Counts:
    """Lookups by where they were served from."""

    gpu_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    dropped: int = 0


class PlainDict:
    """The floor: every feature stays on the GPU, never evicted."""

    def __init__(self, features: Features) -> None:
        self.features = features
        self.table: dict[int, torch.Tensor] = {}
        self.counts = Counts()

    async def start(self) -> None:
        """Nothing to prepare."""

    async def fetch(self, images: Sequence[int]) -> list[torch.Tensor | None]:
        """A dict lookup per image; a miss is encoded and kept for ever."""
        out: list[torch.Tensor | None] = []
        for image in images:
            feature = self.table.get(image)
            if feature is None:
                self.counts.misses += 1
                feature = self.table[image] = self.features.encode(image)
            else:
                self.counts.gpu_hits += 1
            out.append(feature)
        return out

    async def finish(self) -> dict[str, Any]:
        """Let go of the features."""
        self.table.clear()
        return {"counts": _as_dict(self.counts)}


class TwoTierLru:
    """A GPU LRU of a byte budget over a host LRU of another; subclasses move the bytes.

    Tiers are exclusive: a host hit is uploaded and moves back to the GPU LRU, evicting
    its least recently used features to the host LRU, which drops its own beyond budget.
    """

    def __init__(self, features: Features, cfg: Config, gpu_bytes: int, cpu_bytes: int) -> None:
        self.features = features
        self.device = cfg.tensor_device
        self.gpu_slots = gpu_bytes // features.nbytes
        self.host_slots = cpu_bytes // features.nbytes
        self.gpu: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.host: OrderedDict[int, Any] = OrderedDict()
        self.counts = Counts()

    def offload(self, feature: torch.Tensor) -> Any:
        """What the host LRU keeps of an evicted feature."""
        raise NotImplementedError

    def upload(self, held: Any) -> torch.Tensor:
        """A device tensor made from what the host LRU kept."""
        raise NotImplementedError

    async def start(self) -> None:
        """Nothing to prepare."""

    async def fetch(self, images: Sequence[int]) -> list[torch.Tensor | None]:
        """Per image: a GPU hit, a host hit uploaded, or a miss encoded."""
        out: list[torch.Tensor | None] = []
        counts, gpu = self.counts, self.gpu
        for image in images:
            feature = gpu.get(image)
            if feature is not None:
                counts.gpu_hits += 1
                gpu.move_to_end(image)
                out.append(feature)
                continue
            held = self.host.pop(image, None)
            if held is None:
                counts.misses += 1
                feature = self.features.encode(image)
            else:
                counts.host_hits += 1
                feature = self.upload(held)
            del held
            self._insert(image, feature)
            out.append(feature)
        return out

    def _insert(self, image: int, feature: torch.Tensor) -> None:
        self.gpu[image] = feature
        while len(self.gpu) > self.gpu_slots:
            evicted, value = self.gpu.popitem(last=False)
            self.host[evicted] = self.offload(value)
            while len(self.host) > self.host_slots:
                self.host.popitem(last=False)
                self.counts.dropped += 1

    async def finish(self) -> dict[str, Any]:
        """Let go of both tiers."""
        self.gpu.clear()
        self.host.clear()
        return {"counts": _as_dict(self.counts)}


class SyncCpuLru(TwoTierLru):
    """Evicts with a synchronous `.cpu()` (pageable), uploads with `.to(device)`."""

    def offload(self, feature: torch.Tensor) -> torch.Tensor:
        """A host copy, made before returning."""
        return feature.cpu()

    def upload(self, held: torch.Tensor) -> torch.Tensor:
        """A device copy of the host one."""
        return held.to(self.device)


class _NoEvent:
    """Stands in for a CUDA event where there is no GPU (the simulated run)."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


class SglangStyle(TwoTierLru):
    """Evicts with `to("cpu", non_blocking=True)` (torch's caching host allocator) and one
    completion event per copy; a host hit synchronises that event before reading."""

    def offload(self, feature: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The pinned copy, queued, and the event that marks it done."""
        host = feature.to("cpu", non_blocking=True)
        if self.device.type != "cuda":
            return host, _NoEvent()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        return host, done

    def upload(self, held: tuple[torch.Tensor, Any]) -> torch.Tensor:
        """Wait (blocking the loop) for the offload copy, then queue the upload."""
        host, done = held
        done.synchronize()
        return host.to(self.device, non_blocking=True)


class MMCache:
    """mmcache through its public API: get_or_compute per image, or get_many per request."""

    def __init__(
        self,
        features: Features,
        cfg: Config,
        gpu_bytes: int,
        cpu_bytes: int,
        many: bool,
        *,
        device: str | Device | None = None,
        pinned_first: bool = True,
    ) -> None:
        self.features = features
        self.settings = CacheSettings(gpu_cache_mb=gpu_bytes / MiB, cpu_cache_mb=cpu_bytes / MiB)
        self.cache = FeatureCache(
            self.settings, device=device or cfg.device, registry=CollectorRegistry()
        )
        self.many = many
        self.pinned_first = pinned_first
        self.host_ready = False
        self.lookups = 0  # images requested: each is one lookup of the workload

    async def start(self) -> None:
        """Start the cache; unless told to serve cold, wait for its pinned host arena."""
        await self.cache.start()
        if self.pinned_first:
            self.host_ready = await self.cache.wait_host_ready(timeout=HOST_READY_TIMEOUT_S)

    async def fetch(self, images: Sequence[int]) -> list[torch.Tensor | None]:
        """The request's features, each through the cache; misses computed once for all."""
        cache, encode = self.cache, self.features.encode
        self.lookups += len(images)
        if self.many:
            # get_many is looked up through Any: FeatureCache may not have it yet.
            found: list[torch.Tensor | None] = list(await cast(Any, cache).get_many(images))
            for i, feature in enumerate(found):
                if feature is None:
                    image = images[i]
                    found[i] = await cache.get_or_compute(image, functools.partial(encode, image))
            return found
        return [
            await cache.get_or_compute(image, functools.partial(encode, image)) for image in images
        ]

    async def finish(self) -> dict[str, Any]:
        """Wait for every copy, audit the ledger, close."""
        await asyncio.wait_for(self.cache.drain(), HOST_READY_TIMEOUT_S)
        stats = self.cache.stats()
        await self.cache.close()
        return {
            "host_ready": self.host_ready,
            "leaked_bytes": stats.leaked_bytes,
            "lookups": self.lookups,
            "stats": stats.as_dict(),
        }


def _as_dict(counts: Counts) -> dict[str, int]:
    return {
        "gpu_hits": counts.gpu_hits,
        "host_hits": counts.host_hits,
        "misses": counts.misses,
        "dropped": counts.dropped,
    }


# --- one design, one size -------------------------------------------------------------------


@dataclass(slots=True)
class Window:
    """What the clients and the front-end task did while the timed window was open."""

    open: bool = False
    stopped: bool = False
    requests: int = 0
    features: int = 0
    units: int = 0
    latencies: list[float] = field(default_factory=list)
    first_request: asyncio.Event = field(default_factory=asyncio.Event)

    def completed(self, issued: float, done: float, features: int) -> None:
        """Count a request that completed now."""
        if self.open:
            self.first_request.set()
            self.requests += 1
            self.features += features
            self.latencies.append(done - issued)


async def client(strategy: Strategy, features: Features, requests: Requests, w: Window) -> None:
    """Serve requests one after the other until the window closes."""
    fetch, consume, clock = strategy.fetch, features.consume, time.perf_counter
    while not w.stopped:
        images = requests.next()
        issued = clock()
        await asyncio.sleep(0)  # the request arrives: the scheduler takes it on its next turn
        got = await fetch(images)
        for image, feature in zip(images, got, strict=True):
            consume(image, feature)
        del got
        w.completed(issued, clock(), len(images))


def front_end_unit() -> int:
    """A small fixed piece of Python, as one step of tokenising or HTTP handling is."""
    total = 0
    for i in range(FRONT_END_LOOPS):
        total += i * i
    return total


async def front_end(w: Window) -> None:
    """One unit of work, then a turn for the others, until the window closes."""
    while not w.stopped:
        front_end_unit()
        if w.open:
            w.units += 1
        await asyncio.sleep(0)


def settle_device(cfg: Config) -> float:
    """Seconds until the GPU has finished what was queued (0 on the simulator)."""
    if cfg.simulated:
        return 0.0
    start = time.perf_counter()
    torch.cuda.synchronize(cfg.tensor_device)
    return time.perf_counter() - start


async def serve(
    strategy: Strategy,
    features: Features,
    requests: Requests,
    cfg: Config,
    profile_to: str | None = None,
) -> dict[str, Any]:
    """Run the workload through strategy: warm-up, then the timed window (cProfile'd into
    the pstats file profile_to where given: where the loop thread's time goes)."""
    requests.restart()
    await strategy.start()
    w = Window()
    clients = [
        asyncio.create_task(client(strategy, features, requests, w)) for _ in range(cfg.concurrency)
    ]
    front = asyncio.create_task(front_end(w))
    await asyncio.sleep(cfg.warmup_s)
    settle_device(cfg)  # the window starts with no GPU backlog and ends counting its own
    probe = cProfile.Profile() if profile_to is not None else None
    async with LoopLag(TICK_S) as lag:
        w.open = True
        cpu_start, start = time.thread_time(), time.perf_counter()
        if probe is not None:
            probe.enable()
        await asyncio.sleep(cfg.seconds)
        # A window in which no request finished measures nothing (a short one on a busy
        # host): it stays open until one does, and the rate is over the time it was open.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(w.first_request.wait(), max(10 * cfg.seconds, 5.0))
        w.open = False
        if probe is not None and profile_to is not None:
            probe.disable()
            probe.dump_stats(profile_to)
        cpu_s, wall_s = time.thread_time() - cpu_start, time.perf_counter() - start
        lags_ms = [lag_s * 1e3 for lag_s in lag.lags]
        backlog_s = settle_device(cfg)
    w.stopped = True
    await asyncio.gather(*clients, front)
    extra = await strategy.finish()
    settle_device(cfg)
    elapsed = wall_s + backlog_s
    latency = summary_us(w.latencies)
    return {
        "requests": w.requests,
        "features": w.features,
        "requests_per_s": w.requests / elapsed,
        "latency_ms": {"p50": latency["p50_us"] / 1e3, "p99": latency["p99_us"] / 1e3},
        "loop_cpu_us_per_feature": cpu_s / w.features * 1e6 if w.features else math.nan,
        "loop_busy": cpu_s / wall_s,
        "loop_lag_ms": {
            "p50": percentile(lags_ms, 50),
            "p99": percentile(lags_ms, 99),
            "max": max(lags_ms, default=math.nan),
        },
        "front_end_units": w.units,
        "front_end_units_per_s": w.units / wall_s,
        "gpu_backlog_ms": backlog_s * 1e3,
        "wrong_values": features.take_wrong(),
        "gpu_hit_share": gpu_hit_share(extra),
        **extra,
    }


def gpu_hit_share(figures: dict[str, Any]) -> float:
    """The share of the workload's lookups (images requested) served from GPU-resident
    memory, over the whole run (warm-up included). The baselines count their own;
    mmcache's are its GPU-tier hits over the images requested (get_many's miss and the
    get_or_compute that follows it are one lookup, served from the GPU tier where a
    concurrent request computed the feature meanwhile)."""
    if "counts" in figures:
        counts = figures["counts"]
        gpu, others = counts["gpu_hits"], counts["host_hits"] + counts["misses"]
        return gpu / (gpu + others) if gpu + others else math.nan
    lookups = figures["lookups"]
    return figures["stats"]["hits_gpu"] / lookups if lookups else math.nan


# --- mmcache's calls one at a time ----------------------------------------------------------


def _get_class(before: CacheStats, after: CacheStats) -> str:
    if after.hits_gpu > before.hits_gpu:
        return "GPU hit"
    if after.hits_cpu > before.hits_cpu:
        return "host hit -> device"
    return "miss"


def _put_class(before: CacheStats, after: CacheStats) -> str:
    return "put that evicts" if after.evictions_gpu > before.evictions_gpu else "put (no eviction)"


async def operation_costs(
    features: Features, requests: Requests, cfg: Config, gpu_bytes: int, cpu_bytes: int
) -> dict[str, Any]:
    """Loop-thread CPU of mmcache's get and put, one call at a time, classed by stats().

    Every image is put once, least popular first (filling the GPU tier, then evicting),
    then cfg.op_calls images are looked up in the workload's order, a miss encoded and
    put. Each call is timed with thread_time_ns around its await: time the loop spends
    waiting for a copy is not the thread's CPU time. Encoding and checking stay outside
    the timed calls; stats() runs between them.
    """
    settings = CacheSettings(gpu_cache_mb=gpu_bytes / MiB, cpu_cache_mb=cpu_bytes / MiB)
    samples: dict[str, list[float]] = {name: [] for name in OP_CLASSES}
    full_tier = [0.0, 0]  # µs of every put since the first eviction, features they evicted
    clock = time.thread_time_ns
    cache = FeatureCache(settings, device=cfg.device, registry=CollectorRegistry())
    async with cache:
        host_ready = await cache.wait_host_ready(timeout=HOST_READY_TIMEOUT_S)

        async def put(image: int) -> None:
            pending = [features.encode(image)]
            features.consume(image, pending[0])
            before = cache.stats()
            t0 = clock()
            await cache.put(image, pending.pop())
            t1 = clock()
            after = cache.stats()
            samples[_put_class(before, after)].append((t1 - t0) / 1e3)
            if after.evictions_gpu:
                full_tier[0] += (t1 - t0) / 1e3
                full_tier[1] += after.evictions_gpu - before.evictions_gpu

        gc.disable()  # a collection inside one timed call is noise, not the cache's cost
        try:
            for image in reversed(range(cfg.catalogue)):  # the GPU tier ends with the popular
                await put(image)
            requests.restart()
            looked_up = 0
            while looked_up < cfg.op_calls:
                for image in requests.next():
                    before = cache.stats()
                    t0 = clock()
                    got = await cache.get(image)
                    t1 = clock()
                    samples[_get_class(before, cache.stats())].append((t1 - t0) / 1e3)
                    if got is None:
                        await put(image)
                    else:
                        features.consume(image, got)
                    del got
                    looked_up += 1
        finally:
            gc.enable()
        await cache.drain()
        leaked = cache.stats().leaked_bytes
    settle_device(cfg)
    return {
        "host_ready": host_ready,
        "leaked_bytes": leaked,
        "wrong_values": features.take_wrong(),
        "classes": {
            name: {
                "median_us": median(values),
                "p99_us": percentile(values, 99),
                "calls": len(values),
                "target_us": OP_TARGETS_US.get(name),
            }
            for name, values in samples.items()
        },
        "full_tier_puts": {
            "us_per_feature_evicted": full_tier[0] / full_tier[1] if full_tier[1] else math.nan,
            "features_evicted": full_tier[1],
            "target_us": OP_TARGETS_US[FULL_TIER_PUTS],
        },
    }


# --- the run --------------------------------------------------------------------------------


def make_strategy(
    name: str, features: Features, cfg: Config, gpu_bytes: int, cpu_bytes: int
) -> Strategy:
    """A fresh instance of the named design."""
    if name == FLOOR:
        return PlainDict(features)
    if name == SYNC_CPU:
        return SyncCpuLru(features, cfg, gpu_bytes, cpu_bytes)
    if name == SGLANG:
        return SglangStyle(features, cfg, gpu_bytes, cpu_bytes)
    return MMCache(features, cfg, gpu_bytes, cpu_bytes, many=name == MM_MANY)


def release_memory(cfg: Config) -> None:
    """What the last design held back to the system before the next one starts."""
    gc.collect()
    if not cfg.simulated:
        torch.cuda.empty_cache()
        empty_host_cache: Callable[[], None] | None = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


async def measure_size(
    size: str, cfg: Config, kernel: EncodeKernel | None, requests: Requests
) -> dict[str, Any]:
    """Every design on one feature size, then mmcache's calls one at a time."""
    features = Features(feature_rows(size), cfg, kernel)
    working_set = cfg.catalogue * features.nbytes
    gpu_bytes = int(working_set * cfg.gpu_fraction)
    cpu_bytes = int(working_set * cfg.cpu_fraction)
    out: dict[str, Any] = {
        "feature_bytes": features.nbytes,
        "working_set_bytes": working_set,
        "gpu_budget_bytes": gpu_bytes,
        "cpu_budget_bytes": cpu_bytes,
        "strategies": {},
    }
    has_get_many = hasattr(FeatureCache, "get_many")
    names = [name for name in STRATEGIES if name != MM_MANY or has_get_many]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for turn in range(cfg.rounds):  # designs alternate: a host that drifts favours none
        for name in names:
            strategy = make_strategy(name, features, cfg, gpu_bytes, cpu_bytes)
            profile_to = None
            if cfg.profile_dir and turn == 0:
                slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
                profile_to = str(Path(cfg.profile_dir) / f"{size}-{slug}.prof")
            runs[name].append(await serve(strategy, features, requests, cfg, profile_to))
            del strategy
            release_memory(cfg)
    for name in STRATEGIES:
        out["strategies"][name] = (
            median_round(runs[name]) if name in runs else {"skipped": NO_GET_MANY}
        )
    out["ratios"] = ratios(out["strategies"])
    if cfg.rounds > 1:
        out["paired_ratios"] = paired_ratios(runs, cfg.rounds)
    if not cfg.simulated:
        out["h2d_gbps"] = h2d = h2d_gbps(features.nbytes, cfg.tensor_device)
        release_memory(cfg)
        for name in (MM_GET, MM_MANY):
            row = out["strategies"][name]
            ceiling = None if "skipped" in row else bus_ceiling(row, features.nbytes, h2d)
            row["bus_ceiling_req_s"] = ceiling
            out["ratios"][f"{name} / bus ceiling"] = (
                row["requests_per_s"] / ceiling if ceiling else None
            )
    out["operations"] = await operation_costs(features, requests, cfg, gpu_bytes, cpu_bytes)
    release_memory(cfg)
    return out


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A design's round of median req/s (the lower middle one of an even count), with every
    round's req/s beside it; wrong values and leaked bytes of all rounds."""
    row = dict(sorted(rounds, key=lambda r: r["requests_per_s"])[(len(rounds) - 1) // 2])
    row["rounds_requests_per_s"] = [r["requests_per_s"] for r in rounds]
    row["wrong_values"] = sum(r["wrong_values"] for r in rounds)
    if "leaked_bytes" in row:
        row["leaked_bytes"] = sum(r["leaked_bytes"] for r in rounds)
    return row


def h2d_gbps(nbytes: int, device: torch.device) -> float:
    """Pinned host-to-device GB/s of back-to-back copies of nbytes each (GPU time, median of
    three rounds of about 256 MiB): what the bus can upload at this feature size."""
    count = min(4096, max(4, (256 * MiB) // nbytes))
    host = torch.empty(count * nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def copies() -> None:
        for i in range(0, count * nbytes, nbytes):
            on_device[i : i + nbytes].copy_(host[i : i + nbytes], non_blocking=True)

    cuda_elapsed_s(copies, stream)  # the first round pays for what is loaded on first use
    return gbps(count * nbytes, median([cuda_elapsed_s(copies, stream) for _ in range(3)]))


def bus_ceiling(row: dict[str, Any], feature_bytes: int, h2d: float) -> float | None:
    """The req/s at which mmcache's host hits alone would fill the H2D bus: its host-hit
    share of lookups (whole run) x bytes per feature x features per request, against h2d
    GB/s. Past it no cache serving that share from the host can go."""
    lookups, requests = row.get("lookups"), row.get("requests")
    if not lookups or not requests:
        return None
    per_request = row["stats"]["hits_cpu"] / lookups * feature_bytes * row["features"] / requests
    return h2d * GB / per_request if per_request else None


def paired_ratios(
    runs: dict[str, list[dict[str, Any]]], rounds: int
) -> dict[str, dict[str, float]]:
    """ratios() of each round's windows (the designs' windows of one round ran minutes
    apart at most, so a host that drifts between rounds moves both sides): each ratio's
    median over the rounds and its range."""
    per_round: dict[str, list[float]] = {}
    for turn in range(rounds):
        rows = {name: runs[name][turn] if name in runs else {} for name in STRATEGIES}
        for key, value in ratios(rows).items():
            if value is not None:
                per_round.setdefault(key, []).append(value)
    return {
        key: {"median": median(values), "min": min(values), "max": max(values)}
        for key, values in per_round.items()
    }


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """req/s of each mmcache row over the floor's and over SGLang-style's."""
    out: dict[str, float | None] = {}
    for ours in (MM_GET, MM_MANY):
        for theirs, label in ((FLOOR, "floor"), (SGLANG, "SGLang-style")):
            mine, base = rows[ours].get("requests_per_s"), rows[theirs].get("requests_per_s")
            out[f"{ours} / {label}"] = mine / base if mine is not None and base else None
    return out


async def run(cfg: Config) -> dict[str, Any]:
    """The whole benchmark: every size, every design."""
    kernel = None if cfg.simulated else EncodeKernel(cfg.encode_ms / 1e3, cfg.tensor_device)
    requests = Requests(cfg)
    results: dict[str, Any] = {
        "device": cfg.device,
        "device_name": "simulated" if cfg.simulated else torch.cuda.get_device_name(),
        "simulated": cfg.simulated,
        "config": {
            "sizes": list(cfg.sizes),
            "concurrency": cfg.concurrency,
            "catalogue": cfg.catalogue,
            "zipf": cfg.zipf,
            "encode_ms": cfg.encode_ms,
            "encode_gpu_ms": kernel.gpu_s * 1e3 if kernel is not None else None,
            "encode_kernel": kernel.describe() if kernel is not None else None,
            "gpu_fraction": cfg.gpu_fraction,
            "cpu_fraction": cfg.cpu_fraction,
            "seconds": cfg.seconds,
            "warmup_s": cfg.warmup_s,
            "op_calls": cfg.op_calls,
            "seed": cfg.seed,
            "rounds": cfg.rounds,
        },
        "has_get_many": hasattr(FeatureCache, "get_many"),
        "sizes": {},
    }
    for size in cfg.sizes:
        results["sizes"][size] = await measure_size(size, cfg, kernel, requests)
    results["wrong_values"], results["leaked_bytes"] = failures(results)
    return results


def failures(results: dict[str, Any]) -> tuple[int, int]:
    """Wrong values served by any design, and bytes mmcache leaked, over the whole run."""
    wrong = leaked = 0
    for size in results["sizes"].values():
        for row in [*size["strategies"].values(), size["operations"]]:
            wrong += row.get("wrong_values", 0)
            leaked += row.get("leaked_bytes") or 0
    return wrong, leaked


def report(results: dict[str, Any]) -> str:
    """One table per size, then mmcache's calls one at a time."""
    cfg = results["config"]
    where = (
        "simulated: the cache on the CPU simulator, the baselines on CPU tensors, no encode "
        "kernel (the figures exercise the script, not a GPU)"
        if results["simulated"]
        else f"{results['device_name']}, encode {fmt(cfg['encode_gpu_ms'])} ms of GPU time: "
        f"{cfg['encode_kernel']}"
    )
    lines = [
        f"bench_serving on {results['device']} ({where}); {cfg['concurrency']} clients, "
        f"{cfg['catalogue']} images, Zipf {cfg['zipf']:g}, GPU tier {cfg['gpu_fraction']:g} "
        f"and host tier {cfg['cpu_fraction']:g} of the working set, {cfg['seconds']:g} s "
        f"after {cfg['warmup_s']:g} s of warm-up"
        + (
            f"; {cfg['rounds']} rounds, designs alternated: the median round (req/s range)"
            if cfg.get("rounds", 1) > 1
            else ""
        )
    ]
    headers = [
        "design",
        "req/s",
        "GPU-tier hits",
        "latency ms p50 / p99",
        "loop CPU µs / feature",
        "loop busy",
        "loop lag ms p50 / p99 / max",
        "front-end units/s",
        "wrong",
        "leaked bytes",
    ]
    for size, r in results["sizes"].items():
        rows: list[list[Any]] = []
        for name, row in r["strategies"].items():
            if "skipped" in row:
                rows.append([name, row["skipped"], *["-"] * (len(headers) - 2)])
                continue
            lat, lag = row["latency_ms"], row["loop_lag_ms"]
            rates = row.get("rounds_requests_per_s", [])
            spread = f" ({fmt(min(rates), 0)}-{fmt(max(rates), 0)})" if len(rates) > 1 else ""
            rows.append(
                [
                    name,
                    fmt(row["requests_per_s"], 0) + spread,
                    f"{row['gpu_hit_share']:.1%}",
                    f"{fmt(lat['p50'])} / {fmt(lat['p99'])}",
                    fmt(row["loop_cpu_us_per_feature"], 0),
                    f"{row['loop_busy']:.0%}",
                    f"{fmt(lag['p50'])} / {fmt(lag['p99'])} / {fmt(lag['max'])}",
                    fmt(row["front_end_units_per_s"], 0),
                    row["wrong_values"],
                    row.get("leaked_bytes", "-"),
                ]
            )
        lines += [
            "",
            f"### {size} features ({r['feature_bytes']:,} bytes; GPU tier "
            f"{r['gpu_budget_bytes'] / MiB:.1f} MiB, "
            f"host tier {r['cpu_budget_bytes'] / MiB:.1f} MiB)",
            "",
            markdown_table(headers, rows),
            "",
            "req/s ratios: "
            + "; ".join(f"{k} {fmt(v)}" for k, v in r["ratios"].items() if v is not None),
        ]
        if "paired_ratios" in r:
            lines.append(
                "each round's ratio, median (range): "
                + "; ".join(
                    f"{k} {fmt(v['median'])} ({fmt(v['min'])}-{fmt(v['max'])})"
                    for k, v in r["paired_ratios"].items()
                )
            )
        if "h2d_gbps" in r:
            ceilings = (r["strategies"][n].get("bus_ceiling_req_s") for n in (MM_GET, MM_MANY))
            lines.append(
                f"bus ceiling (host hits x bytes against {fmt(r['h2d_gbps'], 1)} GB/s pinned "
                f"H2D at this size): `get` / `get_many` {' / '.join(fmt(c, 0) for c in ceilings)}"
                " req/s"
            )
    op_headers = [
        "size",
        *(f"{name} µs (calls)" for name in OP_CLASSES),
        f"{FULL_TIER_PUTS} µs (features)",
    ]
    op_rows: list[list[Any]] = []
    for size, r in results["sizes"].items():
        classes = r["operations"]["classes"]
        full = r["operations"]["full_tier_puts"]
        op_rows.append(
            [size]
            + [f"{fmt(classes[n]['median_us'], 1)} ({classes[n]['calls']})" for n in OP_CLASSES]
            + [f"{fmt(full['us_per_feature_evicted'], 1)} ({full['features_evicted']})"]
        )
    targets = ", ".join(f"{name} <= {us:g} µs" for name, us in OP_TARGETS_US.items())
    lines += [
        "",
        "### mmcache loop-thread CPU per call, median, one client (copy time excluded); "
        "puts into a full tier: their CPU summed over the features they evicted",
        "",
        markdown_table(op_headers, op_rows),
        "",
        f"targets: {targets}",
        f"wrong values: {results['wrong_values']}; mmcache leaked bytes: {results['leaked_bytes']}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse arguments, run, print the tables, write JSON; 1 on a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "sim"), default=None)
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULTS.sizes))
    parser.add_argument("--concurrency", type=int, default=None, help="clients (default 64)")
    parser.add_argument("--catalogue", type=int, default=None, help="images (default 400)")
    parser.add_argument("--zipf", type=float, default=DEFAULTS.zipf, help="popularity exponent")
    parser.add_argument("--encode-ms", type=float, default=DEFAULTS.encode_ms)
    parser.add_argument("--gpu-fraction", type=float, default=DEFAULTS.gpu_fraction)
    parser.add_argument("--cpu-fraction", type=float, default=DEFAULTS.cpu_fraction)
    parser.add_argument("--seconds", type=float, default=None, help="timed window (default 5)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default 1)")
    parser.add_argument(
        "--op-calls", type=int, default=None, help="lookups timed one at a time (default 2000)"
    )
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULTS.rounds,
        help="windows of each design, alternated; the median is reported (default 1)",
    )
    parser.add_argument(
        "--loop-cores",
        choices=("any", "fast"),
        default="any",
        help="fast: keep the process on the cores a Python probe finds fastest (shared hosts)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 clients, 64 images, 1 s windows after 0.5 s of warm-up, 300 single calls",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile each design's first timed window into DIR/<size>-<design>.prof "
        "(its figures then carry the profiler's cost)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_serving: no CUDA device here; run with --device sim")
        return 0

    def pick(value: Any, quick: Any, default: Any) -> Any:
        return value if value is not None else quick if args.quick else default

    cfg = Config(
        device=device,
        sizes=tuple(args.sizes),
        concurrency=pick(args.concurrency, 16, DEFAULTS.concurrency),
        catalogue=pick(args.catalogue, 64, DEFAULTS.catalogue),
        zipf=args.zipf,
        encode_ms=args.encode_ms,
        gpu_fraction=args.gpu_fraction,
        cpu_fraction=args.cpu_fraction,
        seconds=pick(args.seconds, 1.0, DEFAULTS.seconds),
        warmup_s=pick(args.warmup, 0.5, DEFAULTS.warmup_s),
        op_calls=pick(args.op_calls, 300, DEFAULTS.op_calls),
        seed=args.seed,
        rounds=args.rounds,
        profile_dir=args.profile,
    )
    problem = check_config(cfg)
    if problem:
        parser.error(problem)
    if cfg.profile_dir:
        Path(cfg.profile_dir).mkdir(parents=True, exist_ok=True)
    if args.loop_cores == "fast":
        speeds = core_speeds()
        fast = pin_to_fast_cores(speeds)
        print(f"bench_serving: kept to cores {fast} ({describe_cores(speeds)})")
    if cfg.simulated:
        # The checks then run on the loop's own thread: torch's intra-op threads would spin
        # against whatever else keeps the cores busy and slow each one several times over.
        torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as serving engines do after start-up: collections then skip torch's objects
    results = asyncio.run(run(cfg))
    print(report(results))
    write_json(args.out, results)
    return 1 if results["wrong_values"] or results["leaked_bytes"] else 0


def check_config(cfg: Config) -> str | None:
    """What is wrong with cfg, or None."""
    for size in cfg.sizes:
        try:
            feature_rows(size)
        except ValueError as e:
            return str(e)
    if not 1 <= cfg.catalogue <= PATTERN_LIMIT:
        return f"--catalogue must be 1..{PATTERN_LIMIT}, not {cfg.catalogue}"
    if cfg.concurrency < 1:
        return f"--concurrency must be at least 1, not {cfg.concurrency}"
    if cfg.rounds < 1:
        return f"--rounds must be at least 1, not {cfg.rounds}"
    if not cfg.seconds > 0 or not cfg.warmup_s >= 0 or cfg.op_calls < 0:
        return "--seconds must be > 0, --warmup and --op-calls >= 0"
    if not cfg.gpu_fraction > 0 or not cfg.cpu_fraction >= 0 or not cfg.encode_ms >= 0:
        return "--gpu-fraction must be > 0, --cpu-fraction and --encode-ms >= 0"
    if cfg.catalogue * cfg.gpu_fraction < 2:
        return "--gpu-fraction of the catalogue must hold at least two features"
    return None


if __name__ == "__main__":
    sys.exit(main())

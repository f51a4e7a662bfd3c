"""The `mmcache demo` workload: a vision-language scheduler serving requests through the cache.

Requests carry a few images (1120x700 is 1,000 tokens) and now and then a video
(several thousand tokens), drawn with a Zipf popularity from a catalogue so that
images recur. Each request is admitted (its features fetched, or encoded on a
miss through get_or_compute), then prefilled in token chunks that read each
feature's rows with get(key, rows=...). Every read is compared with the bytes
the encoder produced. Only the public API is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import statistics
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import torch

from mmcache import CacheSettings, CacheStats, FeatureCache
from mmcache.core.machine import check_budgets_fit
from mmcache.device import Device, SimDevice, resolve_device
from mmcache.metrics import start_metrics_server
from mmcache.settings import redact_url

__all__ = ["DemoConfig", "DemoError", "demo_settings", "format_table", "run_demo"]

#: ViT patch merging in Qwen2-VL style: one token per 28x28 pixels.
PIXELS_PER_TOKEN_SIDE: Final = 28
#: Image sizes seen in the catalogue, most often the 1120x700 screenshot.
IMAGE_SIZES: Final = ((1120, 700), (1120, 700), (1120, 700), (840, 560), (1400, 840))
VIDEO_TOKENS: Final = (3000, 6000)
ENCODE_S_PER_1K_TOKENS: Final = 0.003
FORWARD_S_PER_CHUNK: Final = 0.001
PROGRESS_PERIOD_S: Final = 2.0
TICK_PERIOD_S: Final = 0.005
GB: Final = 1e9
MiB: Final = 1024 * 1024
#: Tier budgets when neither a flag nor the environment sets one: small enough for a
#: laptop, small enough that features are offloaded, promoted and evicted from both tiers.
DEMO_GPU_MB: Final = 256
DEMO_CPU_MB: Final = 512
#: The budgets' flags, by settings field.
BUDGET_FLAGS: Final = {"gpu_cache_mb": "--gpu-mb", "cpu_cache_mb": "--cpu-mb"}


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What `mmcache demo` runs; budgets left None come from the settings (environment)."""

    device: str = "auto"
    requests: int = 500
    concurrency: int = 8
    seed: int = 0
    gpu_mb: float | None = None
    cpu_mb: float | None = None
    hidden: int = 3584
    images: int = 600
    videos: int = 24
    video_ratio: float = 0.1
    host_read_ratio: float = 0.125
    chunk_tokens: int = 2048
    zipf_s: float = 1.0
    metrics_port: int | None = None
    linger_s: float = 0.0
    quiet: bool = False
    #: a Redis/Valkey URL: features evicted here, or put by an earlier run, come back from it
    remote_url: str | None = None
    #: both tiers' eviction policy (None: MMCACHE_EVICTION_POLICY if set, else lru)
    eviction_policy: str | None = None
    #: Simulated PCIe link of the sim device (near what pinned copies reach on a real GPU).
    sim_bandwidth_gbps: float = 50.0
    sim_latency_s: float = 10e-6


@dataclass(frozen=True, slots=True)
class Item:
    """One image or video: its cache key and where its rows sit in the reference buffer."""

    key: str
    offset: int
    rows: int

    @property
    def encode_s(self) -> float:
        """Simulated encoder time, proportional to the tokens produced."""
        return ENCODE_S_PER_1K_TOKENS * self.rows / 1000


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt: text runs and multimodal items, laid out as (start token, item) spans."""

    rid: int
    spans: tuple[tuple[int, Item], ...]
    tokens: int
    host_reads: bool


class Catalogue:
    """Every image and video the workload may show, and the exact features of each.

    The encoder's output for an item is a window of one seeded random buffer
    starting at the item's own row offset, so regenerating the expected bytes of
    any rows costs a view, and two items never share a window.
    """

    def __init__(self, config: DemoConfig, device: str) -> None:
        self.images, self.videos = catalogue_items(config)
        max_rows = max((it.rows for it in (*self.images, *self.videos)), default=0)
        generator = torch.Generator().manual_seed(config.seed)
        total_rows = config.images + config.videos + max_rows
        host = torch.randn(total_rows, config.hidden, generator=generator).to(torch.bfloat16)
        self.host_reference = host
        self.device_reference = host if device == "cpu" else host.to(device)

    def reference(self, item: Item, start: int, stop: int, on_host: bool) -> torch.Tensor:
        """The bytes the encoder produced for rows start..stop of item."""
        buf = self.host_reference if on_host else self.device_reference
        return buf[item.offset + start : item.offset + stop]


def catalogue_items(config: DemoConfig) -> tuple[tuple[Item, ...], tuple[Item, ...]]:
    """The catalogue's images and videos (keys and row counts), fixed by the seed: cheap,
    where the features' reference buffer is not."""
    rng = random.Random(config.seed)
    images = []
    for i in range(config.images):
        width, height = rng.choice(IMAGE_SIZES)
        rows = (width // PIXELS_PER_TOKEN_SIDE) * (height // PIXELS_PER_TOKEN_SIDE)
        images.append(Item(f"image/{i:05d}", i, rows))
    videos = [
        Item(f"video/{j:03d}", config.images + j, rng.randint(*VIDEO_TOKENS))
        for j in range(config.videos)
    ]
    return tuple(images), tuple(videos)


def _zipf_weights(n: int, s: float) -> list[float]:
    """Cumulative Zipf weights over n ranks (rank 0 most popular)."""
    return list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))


def make_requests(config: DemoConfig, catalogue: Catalogue) -> list[Request]:
    """The whole request stream, fixed by the seed."""
    rng = random.Random(config.seed + 1)
    image_weights = _zipf_weights(len(catalogue.images), config.zipf_s)
    video_weights = _zipf_weights(len(catalogue.videos), config.zipf_s)
    requests: list[Request] = []
    for rid in range(config.requests):
        items: list[Item] = []
        if catalogue.images:
            count = rng.choice((1, 1, 2, 2, 3, 4, 6))
            # A prompt shows an image once: duplicates within one request are redrawn.
            chosen = rng.choices(catalogue.images, cum_weights=image_weights, k=count)
            items.extend(dict.fromkeys(chosen))
        if catalogue.videos and rng.random() < config.video_ratio:
            items.extend(rng.choices(catalogue.videos, cum_weights=video_weights, k=1))
        tokens = rng.randint(16, 256)  # system prompt
        spans: list[tuple[int, Item]] = []
        for item in items:
            spans.append((tokens, item))
            tokens += item.rows + rng.randint(8, 96)  # the text around each item
        host = rng.random() < config.host_read_ratio
        requests.append(Request(rid, tuple(spans), tokens, host))
    return requests


@dataclass(slots=True)
class Verifier:
    """Compares every read with the encoder's bytes; device reads are checked on the device."""

    catalogue: Catalogue
    device_is_host: bool
    executor: Executor
    mismatches: int = 0
    messages: list[str] = field(default_factory=list)
    chunks: int = 0
    nbytes: int = 0
    _device_bad: torch.Tensor | None = None

    async def check(
        self, item: Item, start: int, stop: int, got: torch.Tensor, on_host: bool
    ) -> None:
        """Record a mismatch unless got holds exactly rows start..stop of item."""
        self.chunks += 1
        self.nbytes += got.numel() * got.element_size()
        want = self.catalogue.reference(item, start, stop, on_host or self.device_is_host)
        if got.shape != want.shape or got.dtype != want.dtype:
            self._fail(item, start, stop, f"got {tuple(got.shape)} {got.dtype}")
            return
        # Bitwise, as int16: exact even for NaN (the simulator's poison), and three times
        # faster than a bf16 compare on the CPU.
        got16, want16 = got.view(torch.int16), want.view(torch.int16)
        if on_host or self.device_is_host:
            # On a worker thread (torch releases the GIL): comparing on the loop would
            # show up as event-loop lag and get latency that are the demo's, not the cache's.
            loop = asyncio.get_running_loop()
            if not await loop.run_in_executor(self.executor, torch.equal, got16, want16):
                differ = int(torch.count_nonzero(got16 != want16))
                self._fail(item, start, stop, f"{differ} of {got.numel()} values differ")
            return
        # On a GPU, compare on the caller's stream and look at the sum once at the end:
        # a host sync per chunk would stall the loop and hide the cache's own timing.
        bad = (got16 != want16).any()
        self._device_bad = bad.long() if self._device_bad is None else self._device_bad + bad

    def warm_up(self) -> None:
        """Launch the device comparison's kernels once, before the timed run: CUDA loads a
        kernel on its first launch, which would otherwise show up as event-loop lag of
        the cache's."""
        if self.device_is_host:
            return
        rows = self.catalogue.device_reference[:1].view(torch.int16)
        bad = (rows != rows).any()
        (bad.long() + bad).item()

    def settle(self) -> None:
        """Fold the device-side comparisons into the count (synchronises once)."""
        if self._device_bad is not None:
            bad = int(self._device_bad.item())
            self._device_bad = None
            if bad:
                self.mismatches += bad
                self.messages.append(f"{bad} device reads differ from the encoder's output")

    def _fail(self, item: Item, start: int, stop: int, why: str) -> None:
        self.mismatches += 1
        if len(self.messages) < 10:
            self.messages.append(f"{item.key} rows {start}:{stop}: {why}")


@dataclass(slots=True)
class LoopLag:
    """A ticker task that measures how late the event loop wakes it (its worst oversleep)."""

    period_s: float = TICK_PERIOD_S
    max_lag_s: float = 0.0

    async def tick(self) -> None:
        """Sleep period_s again and again, keeping the worst oversleep; run it as a task."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - started - self.period_s)


@dataclass(slots=True)
class Scheduler:
    """Admits requests, encodes misses, and prefills in chunks that read feature rows."""

    cache: FeatureCache
    catalogue: Catalogue
    verifier: Verifier
    chunk_tokens: int
    done: int = 0
    encodes: int = 0
    reencodes: int = 0
    get_s: list[float] = field(default_factory=list)
    host_get_s: list[float] = field(default_factory=list)

    async def encode(self, item: Item) -> torch.Tensor:
        """The vision encoder: deterministic output, at a cost proportional to its tokens."""
        self.encodes += 1
        await asyncio.sleep(item.encode_s)
        # A tensor of its own, as an encoder's output would be.
        reference = self.catalogue.reference(item, 0, item.rows, on_host=False)
        if not self.verifier.device_is_host:
            return reference.clone()  # a kernel queued on the current stream: no wait
        # A CPU copy would hold the loop, which a GPU encoder does not: copy off the loop.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.verifier.executor, reference.clone)

    async def serve(self, requests: Iterator[Request]) -> None:
        """Serve requests from a shared iterator until it runs out (one per worker task)."""
        for request in requests:
            await self.admit(request)
            await self.prefill(request)
            self.done += 1

    async def admit(self, request: Request) -> None:
        """Fetch every item's feature, encoding misses (and promoting host-tier hits)."""
        for _, item in request.spans:
            got = await self.cache.get_or_compute(item.key, functools.partial(self.encode, item))
            await self.verifier.check(item, 0, item.rows, got, on_host=False)
            del got  # hold nothing across awaits: the cache's budget is what it keeps

    async def prefill(self, request: Request) -> None:
        """Run the prompt through in chunks; each chunk reads the rows of items it covers."""
        device = "cpu" if request.host_reads else None
        for chunk_start in range(0, request.tokens, self.chunk_tokens):
            chunk_stop = chunk_start + self.chunk_tokens
            for item_start, item in request.spans:
                start = max(chunk_start, item_start) - item_start
                stop = min(chunk_stop, item_start + item.rows) - item_start
                if start >= stop:
                    continue
                rows = slice(start, stop)
                began = time.perf_counter()
                got = await self.cache.get(item.key, rows=rows, device=device)
                (self.host_get_s if request.host_reads else self.get_s).append(
                    time.perf_counter() - began
                )
                if got is None:  # dropped or evicted since admission: encode it again
                    self.reencodes += 1
                    encode = functools.partial(self.encode, item)
                    got = await self.cache.get_or_compute(
                        item.key, encode, rows=rows, device=device
                    )
                await self.verifier.check(item, start, stop, got, on_host=request.host_reads)
                del got
            await asyncio.sleep(FORWARD_S_PER_CHUNK)  # the model's forward pass on this chunk


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table with aligned columns."""
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def _resolve(spec: str) -> tuple[str, bool]:
    """The device to run on ("sim" or a CUDA name) and whether it is the simulator."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "sim"
    return spec, spec == "sim"


async def _progress(
    cache: FeatureCache, scheduler: Scheduler, total: int, started: float, out: TextIO
) -> None:
    while True:
        await asyncio.sleep(PROGRESS_PERIOD_S)
        s = cache.stats()
        moved = (s.d2h_bytes + s.h2d_bytes) / GB
        print(
            f"[{time.perf_counter() - started:6.1f}s] {scheduler.done}/{total} requests  "
            f"hit {s.hit_ratio:6.1%}  moved {moved:6.2f} GB  pending copies {s.pending_copies}",
            file=out,
            flush=True,
        )


#: Where this machine reaches a server bound to all its interfaces.
_LOCAL_HOSTS: Final = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}


@contextlib.contextmanager
def _metrics_server(port: int | None, addr: str, out: TextIO) -> Iterator[None]:
    """Serve /metrics on addr:port for the duration of the block (nothing when port is None)."""
    if port is None:
        yield
        return
    server, thread = start_metrics_server(port, addr=addr)
    host = _LOCAL_HOSTS.get(addr, f"[{addr}]" if ":" in addr else addr)
    print(f"metrics: http://{host}:{server.server_port}/metrics", file=out, flush=True)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def demo_settings(config: DemoConfig) -> CacheSettings:
    """The cache's settings: a budget flag over its environment variable over the demo's own.

    Every value is validated as the library validates it: an invalid one raises
    SettingsError naming the variable (or the field) it came from.
    """
    flags = _budget_flags(config)
    demo_defaults = {"gpu_cache_mb": DEMO_GPU_MB, "cpu_cache_mb": DEMO_CPU_MB}
    overrides: dict[str, Any] = {}
    for name, value in flags.items():
        if value is not None:
            overrides[name] = value
        elif not CacheSettings.env_sets(name):
            overrides[name] = demo_defaults[name]
    if config.remote_url is not None:
        overrides["remote_url"] = config.remote_url
    if config.eviction_policy is not None:
        overrides["eviction_policy"] = config.eviction_policy
    settings = CacheSettings(**overrides)
    if settings.remote_url is None:
        return settings
    # The demo's keys name catalogue entries, whose features depend on the seed and the
    # width: runs that differ in either must not read each other's values.
    namespace = f"{settings.remote_namespace}:demo:seed={config.seed}:hidden={config.hidden}"
    return CacheSettings(**overrides, remote_namespace=namespace)


def _budget_flags(config: DemoConfig) -> dict[str, float | None]:
    """The budget flags given (None: not given), by settings field."""
    return {"gpu_cache_mb": config.gpu_mb, "cpu_cache_mb": config.cpu_mb}


def _budget_source(config: DemoConfig, settings: CacheSettings, field: str) -> str:
    """The flag or environment variable a budget came from, as the user would change it."""
    if _budget_flags(config)[field] is None and CacheSettings.env_sets(field):
        return settings.env_name(field)
    return BUDGET_FLAGS[field]


def _check_fits(config: DemoConfig, settings: CacheSettings) -> None:
    """Refuse tiers too small for the largest feature, naming where the budget came from:
    before the catalogue's features are made (with a wide --hidden, gigabytes)."""
    images, videos = catalogue_items(config)
    largest = max((it.rows for it in (*images, *videos)), default=0) * config.hidden * 2
    for name in BUDGET_FLAGS:
        mb = float(getattr(settings, name))
        if 0 < mb * MiB < largest:
            source = _budget_source(config, settings, name)
            raise DemoError(
                f"{source} {mb:g} is smaller than the largest feature ({largest / MiB:.1f} MiB); "
                f"raise {source} or set it to 0 to turn that tier off"
            )


class DemoError(ValueError):
    """The demo was asked for something it cannot run."""


@dataclass(slots=True)
class _Outcome:
    """What a finished run measured."""

    scheduler: Scheduler
    elapsed_s: float
    max_lag_s: float


@contextlib.asynccontextmanager
async def _background(*jobs: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run jobs as tasks for the duration of the block, then cancel them."""
    tasks = [asyncio.create_task(job) for job in jobs]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _serve_all(
    config: DemoConfig,
    cache: FeatureCache,
    scheduler: Scheduler,
    requests: list[Request],
    err: TextIO,
) -> _Outcome:
    """Run every request through concurrency workers; drain the cache's copies after."""
    lag = LoopLag()
    started = time.perf_counter()
    jobs = [lag.tick()]
    if not config.quiet:
        jobs.append(_progress(cache, scheduler, len(requests), started, err))
    async with _background(*jobs):
        stream = iter(requests)
        async with asyncio.TaskGroup() as group:
            for _ in range(config.concurrency):
                group.create_task(scheduler.serve(stream))
        elapsed = time.perf_counter() - started
        await cache.drain()
    return _Outcome(scheduler, elapsed, lag.max_lag_s)


#: Marks the rows that the simulator's timing decides, not the cache's work.
SIMULATED: Final = " *"


def _report(
    config: DemoConfig,
    settings: CacheSettings,
    device: str,
    outcome: _Outcome,
    stats: CacheStats,
    is_sim: bool,
) -> str:
    """The closing table; on the simulator, timed rows are marked as simulated."""
    scheduler, elapsed = outcome.scheduler, outcome.elapsed_s
    verifier = scheduler.verifier
    lookups = stats.hits_gpu + stats.hits_cpu + stats.misses
    moved = stats.d2h_bytes + stats.h2d_bytes
    timed = SIMULATED if is_sim else ""

    def share(n: int) -> str:
        return f"{n / lookups:.1%} ({n})" if lookups else "-"

    def latency(values: Sequence[float]) -> str:
        if not values:
            return "-"
        p50, p99 = statistics.median(values) * 1e3, _percentile(values, 99) * 1e3
        return f"{p50:.3f} / {p99:.3f} ms ({len(values)} gets)"

    rows = [
        ("device", device),
        ("requests", f"{scheduler.done}, concurrency {config.concurrency}"),
        ("run time" + timed, f"{elapsed:.1f} s"),
        ("GPU / CPU tier", f"{settings.gpu_cache_mb:g} MiB / {settings.cpu_cache_mb:g} MiB"),
        ("lookups", str(lookups)),
        ("hit ratio gpu", share(stats.hits_gpu)),
        ("hit ratio cpu", share(stats.hits_cpu)),
        ("miss ratio", share(stats.misses)),
        ("encodes (re-encodes)", f"{scheduler.encodes} ({scheduler.reencodes})"),
        ("evictions gpu / cpu", f"{stats.evictions_gpu} / {stats.evictions_cpu}"),
        ("dropped / promotions", f"{stats.dropped} / {stats.promotions}"),
        ("offloaded d2h", f"{stats.d2h_bytes / GB:.2f} GB"),
        ("uploaded h2d", f"{stats.h2d_bytes / GB:.2f} GB"),
        ("copy rate" + timed, f"{moved / GB / elapsed:.2f} GB/s" if elapsed > 0 else "-"),
        ("get p50 / p99 device" + timed, latency(scheduler.get_s)),
        ("get p50 / p99 host" + timed, latency(scheduler.host_get_s)),
        ("event loop max lag" + timed, f"{outcome.max_lag_s * 1e3:.1f} ms"),
        ("verified", f"{verifier.chunks} reads, {verifier.nbytes / GB:.2f} GB"),
        ("mismatches", str(verifier.mismatches)),
        ("leaked bytes", str(stats.leaked_bytes)),
    ]
    if settings.remote_url is not None:
        rows[9:9] = [
            ("remote hits / misses", f"{stats.remote_hits} / {stats.remote_misses}"),
            (
                "remote read / written",
                f"{stats.remote_read_bytes / GB:.2f} GB / {stats.remote_written_bytes / GB:.2f} GB",
            ),
            (
                "remote errors / rejected / dropped writes",
                f"{stats.remote_errors} / {stats.remote_rejected} / {stats.remote_dropped_writes}",
            ),
        ]
    table = format_table(("metric", "value"), rows)
    if is_sim:
        note = (
            f"{SIMULATED.strip()} simulated: on `sim` the copies and the comparisons run on "
            "this machine's CPU, so these times say nothing about a GPU; the counts, the "
            "verification and the leak check are real."
        )
        table += "\n" + textwrap.fill(note, width=80)
    return table


def verdict(reads: int, mismatches: int, leaked_bytes: int) -> tuple[bool, str]:
    """Whether the run passed, and the one line that says so with the counts that decide it."""
    passed = reads > 0 and mismatches == 0 and leaked_bytes == 0
    word = "PASS" if passed else "FAIL"
    return passed, (
        f"{word}: {reads - mismatches} of {reads} reads exact, {mismatches} differ from what "
        f"was encoded, {leaked_bytes} bytes leaked"
    )


async def _run(config: DemoConfig, out: TextIO, err: TextIO) -> int:
    spec, is_sim = _resolve(config.device)
    settings = demo_settings(config)
    port = config.metrics_port if config.metrics_port is not None else settings.metrics_port
    # The demo serves /metrics itself (it lingers, then shuts the server down), on the
    # library's address: the cache must not start a second server on the same port.
    cache_settings = settings.model_copy(update={"metrics_port": None})
    with contextlib.ExitStack() as resources:
        device: Device
        if is_sim:
            device = SimDevice(
                bandwidth_gbps=config.sim_bandwidth_gbps, latency_s=config.sim_latency_s
            )
        else:
            device = resolve_device(spec)
        # Ours, not the cache's: a cache closes only the devices it created itself.
        resources.callback(device.close)
        # Here too, before the cache's own check, to name the flag a budget came from.
        check_budgets_fit(settings, device, functools.partial(_budget_source, config, settings))
        _check_fits(config, settings)
        executor = resources.enter_context(
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="mmcache-demo")
        )
        resources.enter_context(_metrics_server(port, settings.metrics_addr, out))
        async with FeatureCache(cache_settings, device, name="demo") as cache:
            await cache.wait_host_ready(timeout=60)
            device_name = "cpu" if is_sim else cache.device.name
            catalogue = Catalogue(config, device_name)
            requests = make_requests(config, catalogue)
            verifier = Verifier(catalogue, device_is_host=is_sim, executor=executor)
            verifier.warm_up()
            scheduler = Scheduler(cache, catalogue, verifier, config.chunk_tokens)
            outcome = await _serve_all(config, cache, scheduler, requests, err)
            verifier.settle()
            stats = cache.stats()
            if is_sim:
                shown = (
                    f"sim (the CPU simulator; copies paced as a {config.sim_bandwidth_gbps:g} "
                    "GB/s link)"
                )
            else:
                shown = f"{device_name} ({torch.cuda.get_device_name(device_name)})"
            report = _report(config, settings, shown, outcome, stats, is_sim)
            print(report, file=out, flush=True)
            if port is not None and config.linger_s > 0:
                # Before close(): a closed cache takes its series out of the registry.
                print(
                    f"metrics: serving final values for {config.linger_s:g} s", file=out, flush=True
                )
                await asyncio.sleep(config.linger_s)
    for message in verifier.messages:
        print(f"MISMATCH: {message}", file=err)
    passed, line = verdict(verifier.chunks, verifier.mismatches, stats.leaked_bytes)
    unreached = _remote_unreached(settings, stats)
    if unreached is not None:
        passed, line = False, f"FAIL: {unreached}"
    print(line, file=out, flush=True)
    return 0 if passed else 1


def _remote_unreached(settings: CacheSettings, stats: CacheStats) -> str | None:
    """Why a configured remote tier fails the run: it never answered (None: it did, or
    there is none). Every feature is served locally then, so the reads alone would pass."""
    if settings.remote_url is None:
        return None
    answered = stats.remote_hits + stats.remote_misses + stats.remote_rejected
    if answered or stats.remote_written_bytes:
        return None
    return (
        f"the remote tier ({redact_url(settings.remote_url)}) never answered: "
        f"{stats.remote_errors} errors, 0 reads or writes; is the server running there?"
    )


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of an exception group (a worker's error, as the user should see it)."""
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def run_demo(config: DemoConfig, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the workload; 0 when every read verified and nothing leaked, else 1."""
    try:
        return asyncio.run(_run(config, out or sys.stdout, err or sys.stderr))
    except BaseExceptionGroup as group:
        raise _first_error(group) from group

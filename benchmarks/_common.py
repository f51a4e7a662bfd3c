"""Small helpers shared by the benchmark scripts (timing, percentiles, tables, JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mmcache import FeatureCache

MiB = 1 << 20
GB = 1e9
HIDDEN = 4096
DTYPE = torch.bfloat16
#: feature name -> rows of HIDDEN bf16 values (8 MB is a 1000-token image embedding).
SPECS = {"8MB": 1000, "1MB": 128, "64KB": 8}
#: How long a benchmark waits for the host arena to be pinned whole before timing.
HOST_READY_TIMEOUT_S = 120.0


def gbps(nbytes: float, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second, as copy engines are quoted)."""
    return nbytes / seconds / GB if seconds > 0 else math.inf


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_us(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max / mean of durations given in seconds, reported in microseconds."""
    us = [s * 1e6 for s in seconds]
    return {
        "p50_us": percentile(us, 50),
        "p99_us": percentile(us, 99),
        "max_us": max(us) if us else math.nan,
        "mean_us": statistics.fmean(us) if us else math.nan,
        "n": float(len(us)),
    }


def median(values: Sequence[float]) -> float:
    """statistics.median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def fmt(value: Any, digits: int = 2) -> str:
    """A number for a table cell; dashes for missing values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def latency_table(figures: dict[str, dict[str, float]], first: str) -> str:
    """A markdown table of per-call latencies (summary_us figures per operation)."""
    rows = [[name, fmt(f["p50_us"]), fmt(f["p99_us"]), int(f["n"])] for name, f in figures.items()]
    return markdown_table([first, "median µs", "p99 µs", "calls"], rows)


def target_verdict(what: str, median_us: float, target_us: float) -> str:
    """One line saying whether a median latency meets its target."""
    verdict = "meets" if median_us <= target_us else "misses"
    return f"{what} median {median_us:.2f} µs {verdict} the {target_us:.0f} µs target"


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write results as JSON (NaN and inf become null) when a path was given."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_finite(data), indent=2, default=str) + "\n")
    print(f"wrote {target}", file=sys.stderr)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def timing_event() -> torch.cuda.Event:
    """A CUDA event that records a timestamp (elapsed_time works on it)."""
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def copy_to_slot(host: torch.Tensor, slot: int, feature: torch.Tensor) -> None:
    """feature's bytes into slot `slot` (of feature's size) of a flat uint8 host buffer,
    non-blocking: the bare per-feature copy the baselines time."""
    nbytes = feature.nbytes
    host[slot * nbytes : (slot + 1) * nbytes].copy_(
        feature.view(-1).view(torch.uint8), non_blocking=True
    )


def cuda_elapsed_s(fn: Callable[[], object], stream: torch.cuda.Stream) -> float:
    """GPU time of the work fn() queues on stream, by timing events (host-synchronises)."""
    start = timing_event()
    end = timing_event()
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def gpu_sleep(cycles: int, stream: torch.cuda.Stream) -> None:
    """Queue a kernel that spins for cycles GPU clocks on stream (holds the stream)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(cycles))  # type: ignore[no-untyped-call]


def sleep_cycles_per_second(stream: torch.cuda.Stream) -> float:
    """Clock rate seen by torch.cuda._sleep, to hold a stream for a chosen time."""
    cycles = 20_000_000
    gpu_sleep(1_000, stream)  # warm-up: the first launch loads the kernel
    stream.synchronize()
    elapsed = cuda_elapsed_s(lambda: gpu_sleep(cycles, stream), stream)
    return cycles / elapsed


def _best_us_per_op(fn: Callable[[int], object], ops: int, repeats: int = 5) -> float:
    """Fastest of repeats runs of fn(ops), in µs per op."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(ops)
        best = min(best, time.perf_counter() - start)
    return best / ops * 1e6


def _bookkeeping(ops: int) -> None:
    index: dict[int, tuple[int, int]] = {}
    lru: OrderedDict[int, int] = OrderedDict()
    for i in range(ops):
        index[i] = (i, i + 1)
        lru[i] = i
        if len(lru) > 1024:
            lru.popitem(last=False)


def host_speed(cuda: bool) -> dict[str, float]:
    """How fast this host runs the kind of work the cache's event loop does, in µs per op.

    The cache's offload rate for small features is bound by Python and driver calls on
    one thread, so a slower host (or a busier neighbour) moves it; these figures let
    runs on different hosts be compared. python: a dict insert, an LRU insert and
    eviction (like the cache's per-feature bookkeeping); with CUDA, record: one
    event.record on a side stream; copy: enqueueing one 64 KiB device-to-pinned copy.
    """
    speed = {"python_us": _best_us_per_op(_bookkeeping, 50_000)}
    if not cuda:
        return speed
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def record(ops: int) -> None:
        for _ in range(ops):
            event.record(stream)
        stream.synchronize()

    src = torch.ones(2**16, dtype=torch.uint8, device="cuda")
    dst = torch.empty(2**16, dtype=torch.uint8, pin_memory=True)

    def copy(ops: int) -> None:
        with torch.cuda.stream(stream):
            for _ in range(ops):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    speed["record_us"] = _best_us_per_op(record, 2_000)
    speed["copy_us"] = _best_us_per_op(copy, 1_000)
    return speed


def core_speeds() -> dict[int, float]:
    """µs per op of the Python bookkeeping probe on each core this process may use.

    On shared hosts some cores give far less than others (on one H200 host five of
    sixteen ran it 1.5-2.5x slower than the rest), and the cache's event loop is one
    Python thread: which core it lands on moves the small-feature rates between runs.
    """
    allowed = os.sched_getaffinity(0)
    speeds: dict[int, float] = {}
    try:
        for core in sorted(allowed):
            os.sched_setaffinity(0, {core})
            speeds[core] = _best_us_per_op(_bookkeeping, 5_000, repeats=3)
    finally:
        os.sched_setaffinity(0, allowed)
    return speeds


def pin_to_fast_cores(speeds: dict[int, float], slack: float = 1.15) -> list[int]:
    """Restrict the calling thread, and the threads it starts from now on, to the cores
    whose probe ran within slack of the fastest; returns them."""
    best = min(speeds.values())
    fast = sorted(core for core, us in speeds.items() if us <= best * slack)
    os.sched_setaffinity(0, fast)
    return fast


def current_core() -> int:
    """The core the calling thread last ran on (Linux), or -1 where unknown."""
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[36])  # field 39 of stat(5); the split starts at field 3


def describe_cores(speeds: dict[int, float], slack: float = 1.25) -> str:
    """'11 cores at 0.170-0.182 µs, 5 slower at 0.252-0.426' (the probe's spread)."""
    best = min(speeds.values())
    fast = sorted(us for us in speeds.values() if us <= best * slack)
    slow = sorted(us for us in speeds.values() if us > best * slack)
    text = f"{_cores(len(fast))} at {fast[0]:.3f}-{fast[-1]:.3f} µs"
    return text + (f", {_cores(len(slow))} slower at {slow[0]:.3f}-{slow[-1]:.3f}" if slow else "")


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """Wall time of a with-block, in seconds, in the yielded list's first item."""
    box = [0.0]
    start = time.perf_counter()
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - start


class LoopLag:
    """Measures the event loop's lateness with a ticker task (async context manager).

    max_lag_s is the worst lateness; lags holds every tick's, in seconds.

    It also records the longest pause of Python's cyclic garbage collector inside the
    window, so a stall can be told apart from one the collector caused.
    """

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.max_lag_s = 0.0
        self.lags: list[float] = []
        self.ticks = 0
        self.max_gc_pause_s = 0.0
        self.gc_collections = 0
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_collections += 1
            self.max_gc_pause_s = max(self.max_gc_pause_s, time.perf_counter() - self._gc_started)

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.period_s)
            lag = time.perf_counter() - start - self.period_s
            self.max_lag_s = max(self.max_lag_s, lag)
            self.lags.append(lag)
            self.ticks += 1


def pinned_pool_bytes() -> int | None:
    """Bytes torch's caching host (pinned) allocator holds, if it reports them."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def burst_features(burst_bytes: float, nbytes: int) -> int:
    """Features of nbytes a producer hands over between yields to the event loop when it
    hands over burst_bytes at a time (at least one)."""
    return max(1, int(burst_bytes) // nbytes)


async def put_in_groups(
    cache: FeatureCache,
    features: list[torch.Tensor | None],
    group: int,
    *,
    start: int = 0,
    stop: int | None = None,
    key: Callable[[int], Any] = lambda i: i,
    burst: int = 0,
) -> list[float]:
    """put (group == 1) or put_many features[start:stop] under key(index), handing each over.

    The list's slots are emptied as the cache takes the tensors, so nothing here keeps
    them alive past their release. burst > 0: yield to the event loop after each burst
    features (an encoder batch), untimed. Returns each call's seconds.
    """
    calls: list[float] = []
    end = len(features) if stop is None else stop
    since_yield = 0
    for first in range(start, end, group):
        items = []
        for i in range(first, min(first + group, end)):
            value, features[i] = features[i], None
            assert value is not None
            items.append((key(i), value))
        del value
        t0 = time.perf_counter()
        if group == 1:
            await cache.put(*items[0])
        else:
            await cache.put_many(items)
        calls.append(time.perf_counter() - t0)
        since_yield += len(items)
        del items
        if burst and since_yield >= burst:
            since_yield = 0
            await asyncio.sleep(0)
    return calls


#: An encoder's batch output: one tensor and the rows of each feature in it, in order.
Batch = tuple[torch.Tensor, list[int]]


def concat_batches(features: list[torch.Tensor | None], group: int) -> list[Batch | None]:
    """features concatenated group at a time, as encoder batch outputs; lets go of them."""
    batches: list[Batch | None] = []
    for first in range(0, len(features), group):
        last = min(first + group, len(features))
        parts = [features[i] for i in range(first, last)]
        features[first:last] = [None] * (last - first)
        rows = [part.shape[0] for part in parts if part is not None]
        batches.append((torch.cat([part for part in parts if part is not None]), rows))
        del parts
    return batches


async def put_in_splits(
    cache: FeatureCache,
    batches: list[Batch | None],
    group: int,
    *,
    start: int = 0,
    stop: int | None = None,
    key: Callable[[int], Any] = lambda i: i,
    burst: bool = False,
) -> list[float]:
    """put_split batches[start:stop], batch b's features under key(b * group + j).

    The list's slots are emptied as the cache takes the batches. burst: yield to the
    event loop after each call, untimed. Returns each call's seconds.
    """
    calls: list[float] = []
    for b in range(start, len(batches) if stop is None else stop):
        batch, batches[b] = batches[b], None
        assert batch is not None
        tensor, rows = batch
        del batch
        keys = [key(b * group + j) for j in range(len(rows))]
        t0 = time.perf_counter()
        await cache.put_split(keys, tensor, rows)
        calls.append(time.perf_counter() - t0)
        del tensor
        if burst:
            await asyncio.sleep(0)
    return calls


def spawn_ranks(target: Callable[..., None], tp: int, *args: Any) -> dict[int, dict[str, Any]]:
    """Run target(rank, tp, *args, store, outbox) in tp spawned processes, the ranks of one
    group meeting at a file store; each rank's report, by rank (a rank that failed
    reports its traceback under "error": raised here)."""
    ctx = multiprocessing.get_context("spawn")
    outbox = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        ranks = [
            ctx.Process(target=target, args=(r, tp, *args, store, outbox), daemon=True)
            for r in range(tp)
        ]
        for process in ranks:
            process.start()
        reports: dict[int, dict[str, Any]] = dict(outbox.get(timeout=600) for _ in range(tp))
        for process in ranks:
            process.join(30)
    for rank, report in sorted(reports.items()):
        if "error" in report:
            raise RuntimeError(f"rank {rank} of TP {tp} failed:\n{report['error']}")
    return reports

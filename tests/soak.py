"""Soak: many concurrent operations for a while, with holds, cancellations and faults.

Hundreds of asyncio workers put (one or a group), get (device, host, rows),
get_or_compute and discard random keys of a small hot key space, so puts wait for
budget, offloads and promotions run all the time, and entries are replaced under
readers. On the simulator a second task holds every copy back for random windows and a
third injects faults (copies that fail, allocations that fail); some operations are
cancelled at random points.

Every value encodes its version and its element index (int64 `version << 24 | index`,
viewed as the value's dtype), so every read is checked bit for bit: it must be a
version of that key that the read may return (not one replaced or discarded before the
read began), at the rows asked for. After a warm-up the resident set size is sampled;
at the end the cache is drained and must own every byte it holds (leaked_bytes == 0,
simulated device memory == the GPU entries' bytes).

    python tests/soak.py --device sim --seconds 30
    python tests/soak.py --device cuda --seconds 120 --json soak-h200.json

tests/api/test_soak.py runs it briefly on the simulator; the command line runs it longer,
or on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import random
import sys
import time
import types
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

# Runnable as a script from anywhere: the checkout's mmcache, and the benchmarks' tables.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import markdown_table, write_json

from mmcache import (
    CacheSettings,
    CopyFailedError,
    DeviceOutOfMemoryError,
    FeatureCache,
    InvalidRowsError,
)
from mmcache.core.entry import Entry, State
from mmcache.device import Device, SimDevice

MiB = 1 << 20
ROW_BYTES = 1024  # 128 int64 a row before the dtype view
ROW_INTS = ROW_BYTES // 8
# Element indices take the low 24 bits (values up to 128 MiB), versions the other 39.
INDEX_BITS = 24
DTYPES = (torch.int64, torch.float32, torch.bfloat16, torch.uint8)
SIM_FAULTS = ("copy_fails", "alloc_fails")
#: How long the audit lets callbacks that device threads queued run before it counts the
#: entry objects still alive beyond the index (one that stays longer is retained).
RETAIN_SETTLE_S = 1.0


@dataclass
class SoakConfig:
    """What to run: device, duration, load and faults."""

    device: str = "sim"
    seconds: float = 30.0
    #: RSS is measured from the end of the warm-up; default: a quarter of the run, <= 10 s
    warmup_s: float | None = None
    workers: int = 256
    keys: int = 512
    gpu_mb: float = 8.0
    cpu_mb: float = 16.0
    #: most values are 1..64 KiB; one in `large_every` is 64 KiB..max_kib
    max_kib: int = 1024
    large_every: int = 10
    #: simulator only: faults to inject, and how often (per second, each kind)
    faults: tuple[str, ...] = SIM_FAULTS
    fault_rate_hz: float = 40.0
    #: simulator only: hold windows (how often, how long at most)
    hold_rate_hz: float = 20.0
    hold_max_s: float = 0.01
    cancel_probability: float = 0.05
    #: simulated copy speed (0: instant) and latency: copies take time, so reads race them
    sim_bandwidth_gbps: float = 10.0
    sim_latency_s: float = 50e-6
    seed: int = 0
    #: stop collecting mismatch descriptions after this many
    max_reports: int = 20


@dataclass
class SoakReport:
    """What happened, and whether anything was lost, wrong or leaked."""

    device: str
    seconds: float
    ops: Counter[str] = field(default_factory=Counter)
    reads_checked: int = 0
    misses: int = 0
    cancelled: int = 0
    holds: int = 0
    expected_errors: Counter[str] = field(default_factory=Counter)
    faults_injected: Counter[str] = field(default_factory=Counter)
    faults_fired: int = 0
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    budget_violations: int = 0
    max_leaked_bytes_in_flight: int = 0
    rss_baseline_mib: float = 0.0
    rss_max_growth_mib: float = 0.0
    rss_end_growth_mib: float = 0.0
    rss_samples: int = 0
    #: RSS growth over the baseline, one figure a second after the warm-up (MiB)
    rss_trace_mib: list[float] = field(default_factory=list)
    leaked_bytes: int = 0
    pending_copies_after_drain: int = 0
    device_bytes: int = 0
    gpu_entry_bytes: int = 0
    #: versions the read model still tracks at the end (it must stay small)
    model_versions: int = 0
    #: Entry objects alive after the drain beyond those in the index (timers, closures...)
    entries_retained: int = 0
    #: the types of what refers to each of them
    retained_by: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def device_bytes_unowned(self) -> int:
        return self.device_bytes - self.gpu_entry_bytes

    @property
    def ok(self) -> bool:
        """No wrong data, no unexpected error, budgets held and nothing leaked."""
        return (
            self.mismatches == 0
            and not self.errors
            and self.budget_violations == 0
            and self.leaked_bytes == 0
            and self.pending_copies_after_drain == 0
            and self.entries_retained == 0
            and (self.device_bytes_unowned == 0 or not self.device.startswith("sim"))
        )

    def rows(self) -> list[list[Any]]:
        """The summary table's rows."""
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items()))
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults_injected.items()))
        expected = ", ".join(f"{k} {v}" for k, v in sorted(self.expected_errors.items()))
        s = self.stats
        return [
            ["device", self.device],
            ["seconds", f"{self.seconds:.1f}"],
            ["operations", f"{self.total_ops} ({self.total_ops / self.seconds:.0f}/s)"],
            ["  by kind", ops or "-"],
            ["reads checked bit-exact", self.reads_checked],
            ["misses (absent, dropped or discarded)", self.misses],
            ["cancelled operations", self.cancelled],
            ["hold windows", self.holds],
            ["faults injected", f"{faults or '-'} (fired {self.faults_fired})"],
            ["errors raised to callers (expected)", expected or "-"],
            [
                "entries dropped / copy failures",
                f"{s.get('dropped', 0)} / {s.get('copy_failures', 0)}",
            ],
            ["evictions gpu / cpu", f"{s.get('evictions_gpu', 0)} / {s.get('evictions_cpu', 0)}"],
            ["max RSS growth after warm-up (MiB)", f"{self.rss_max_growth_mib:.1f}"],
            ["RSS growth at the end (MiB)", f"{self.rss_end_growth_mib:.1f}"],
            ["budget violations", self.budget_violations],
            ["max leaked bytes while running", self.max_leaked_bytes_in_flight],
            ["leaked bytes after drain", self.leaked_bytes],
            [
                "device bytes not owned by an entry"
                + ("" if self.device.startswith("sim") else " (incl. allocator rounding)"),
                self.device_bytes_unowned,
            ],
            [
                "entry objects retained after drain",
                f"{self.entries_retained}"
                + (f" (referred to by {', '.join(self.retained_by)})" if self.retained_by else ""),
            ],
            ["mismatches", self.mismatches],
            ["unexpected errors", len(self.errors)],
            ["verdict", "PASS" if self.ok else "FAIL"],
        ]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["total_ops"] = self.total_ops
        out["ok"] = self.ok
        return out


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- the model of what a read may return ------------------------------------------------


@dataclass(slots=True)
class _Version:
    """One value offered to the cache under a key (by put or get_or_compute)."""

    vid: int
    dtype: torch.dtype
    rows: int
    ended: int | None = None  # event number when its put finished (None: in flight)
    stored: bool = False


@dataclass(slots=True)
class _KeyModel:
    versions: dict[int, _Version] = field(default_factory=dict)
    floor: int = -1  # a read that began later returns nothing that finished before this
    oldest_kept: int = 0  # versions below this were pruned


class _Model:
    """Which versions a read of a key may return, by the order of events."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self.per_key = [_KeyModel() for _ in range(keys)]
        self.clock = 0
        self.next_vid = 1
        self.running: dict[int, tuple[int, int]] = {}  # start event -> (key, floor) of a read

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def new_version(self, key: int, dtype: torch.dtype, rows: int) -> _Version:
        # The key's index is in the version number: another key's data is recognised.
        vid = self.next_vid * self.keys + key
        self.next_vid += 1
        version = _Version(vid, dtype, rows)
        self.per_key[key].versions[vid] = version
        return version

    def finished(self, key: int, version: _Version, stored: bool, *, exact: bool = True) -> None:
        """version's put finished; exact: at this very event (not observed later)."""
        if version.ended is not None:
            return
        version.ended = self.tick()
        version.stored = stored
        if stored and exact:
            self.per_key[key].floor = version.ended

    def discarded(self, key: int) -> None:
        self.per_key[key].floor = self.tick()

    def read_started(self, key: int) -> tuple[int, int]:
        start = self.tick()
        floor = self.per_key[key].floor
        self.running[start] = (key, floor)
        return start, floor

    def read_ended(self, start: int) -> None:
        del self.running[start]

    def check(self, key: int, start: int, floor: int, vid: int) -> tuple[_Version | None, str]:
        """The version a read that began at start may have returned as vid, or why not."""
        if vid == -1:
            return None, "poison (0xFF): read before its copy landed, or after it was recycled"
        if vid <= 0 or vid % self.keys != key:
            owner = vid % self.keys if vid > 0 else None
            return None, f"not a version of key {key} (vid {vid}, key {owner})"
        km = self.per_key[key]
        version = km.versions.get(vid)
        if version is None:
            if vid < km.oldest_kept:
                return None, f"version {vid} was superseded long before the read"
            return None, f"version {vid} was never put"
        if version.ended is not None and version.ended < start:
            if not version.stored:
                return None, f"version {vid}'s put did not store it"
            if version.ended < floor:
                return None, f"version {vid} was replaced or discarded before the read"
        return version, ""

    def prune(self) -> None:
        """Forget versions no running or future read may return (keeps the model's size flat).

        A version that finished before the floor a read began with is not that read's to
        return, and floors only rise: below the lowest floor of the key's running reads (or
        its floor now, if none is running) nothing is returnable any more.
        """
        lowest = [km.floor for km in self.per_key]
        for key, floor in self.running.values():
            lowest[key] = min(lowest[key], floor)
        for key, km in enumerate(self.per_key):
            old = [
                v.vid
                for v in km.versions.values()
                if v.ended is not None and (v.ended < lowest[key] or not v.stored)
            ]
            for vid in old:
                del km.versions[vid]
            if old:
                km.oldest_kept = min(km.versions, default=max(old) + 1)


# --- values -------------------------------------------------------------------------


def make_value(vid: int, rows: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """rows x 1 KiB encoding (vid << INDEX_BITS | element index), viewed as dtype."""
    assert rows * ROW_INTS <= 1 << INDEX_BITS and vid < 1 << (63 - INDEX_BITS)
    ints = torch.arange(rows * ROW_INTS, dtype=torch.int64, device=device)
    ints += vid << INDEX_BITS
    return ints.view(rows, ROW_INTS).view(dtype)


def decode(got: torch.Tensor, first_row: int) -> tuple[int, bool]:
    """(vid, exact) of a read: its version, and whether every element is that version's."""
    ints = got.reshape(-1).view(torch.int64)
    vid = int(ints[0].item()) >> INDEX_BITS
    want = torch.arange(ints.numel(), dtype=torch.int64, device=ints.device)
    want += (vid << INDEX_BITS) + first_row * ROW_INTS
    return vid, bool(torch.equal(ints, want))


# --- the run ------------------------------------------------------------------------


class _Soak:
    def __init__(self, config: SoakConfig, device: Device) -> None:
        self.cfg = config
        self.dev = device
        self.sim = device if isinstance(device, SimDevice) else None
        self.where: str | torch.device = "cpu" if self.sim else device.name
        self.rng = random.Random(config.seed)
        self.model = _Model(config.keys)
        self.report = SoakReport(device=device.name, seconds=0.0)
        # Zipf-like popularity: a few hot keys, a long tail.
        self.weights = [1 / (k + 1) ** 0.8 for k in range(config.keys)]
        settings = CacheSettings(gpu_cache_mb=config.gpu_mb, cpu_cache_mb=config.cpu_mb)
        self.cache = FeatureCache(settings, device, name="soak", registry=CollectorRegistry())
        self.stop = asyncio.Event()
        self.expected: tuple[type[BaseException], ...] = (DeviceOutOfMemoryError,)
        if self.sim is not None and "copy_fails" in config.faults:
            self.expected = (DeviceOutOfMemoryError, CopyFailedError)
        self.ops_done = 0

    # workers ----------------------------------------------------------------------------

    def pick_key(self) -> int:
        return self.rng.choices(range(self.cfg.keys), self.weights)[0]

    def pick_rows(self) -> int:
        if self.rng.randrange(self.cfg.large_every) == 0:
            return self.rng.randint(64, max(64, self.cfg.max_kib))
        return max(1, int(math.exp(self.rng.uniform(0, math.log(64)))))

    def new_value(self, key: int) -> tuple[_Version, torch.Tensor]:
        rows = self.pick_rows()
        dtype = self.rng.choice(DTYPES)
        version = self.model.new_version(key, dtype, rows)
        return version, make_value(version.vid, rows, dtype, self.where)

    async def worker(self) -> None:
        while not self.stop.is_set():
            key = self.pick_key()
            roll = self.rng.random()
            if roll < 0.26:
                kind, op = self.op_put(key, wait=self.rng.random() > 0.1)
            elif roll < 0.30:
                kind, op = "put_many", self.op_put_many(key)
            elif roll < 0.45:
                kind, op = "get_device", self.op_get(key, None, None)
            elif roll < 0.60:
                kind, op = "get_host", self.op_get(key, "cpu", None)
            elif roll < 0.70:
                kind, op = "get_rows", self.op_get(key, self.rng.choice(("cpu", None)), True)
            elif roll < 0.95:
                kind, op = "get_or_compute", self.op_compute(key)
            else:
                kind, op = "discard", self.op_discard(key)
            await self.run_op(kind, op)

    async def run_op(self, kind: str, op: Awaitable[None]) -> None:
        self.report.ops[kind] += 1
        task = asyncio.ensure_future(op)
        if self.rng.random() < self.cfg.cancel_probability:
            await asyncio.sleep(self.rng.choice((0, 0, 0.0005, 0.002)))
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # this worker itself is being cancelled
            self.report.cancelled += 1
        except self.expected as e:
            self.report.expected_errors[type(e).__name__] += 1
        except Exception as e:
            self.report.errors.append(f"{kind}: {type(e).__name__}: {e}")
        self.ops_done += 1
        if self.ops_done % 2000 == 0:
            self.model.prune()

    def op_put(self, key: int, wait: bool) -> tuple[str, Awaitable[None]]:
        version, value = self.new_value(key)
        if self.rng.random() < 0.1:
            # A view of a larger batch: the cache compacts it (an allocation and a copy).
            batch = torch.cat([value, value[:1]])
            value = batch[: version.rows]

        async def put() -> None:
            stored = False
            try:
                stored = await self.cache.put(key, value, wait=wait)
            finally:
                self.model.finished(key, version, stored)

        return ("put" if wait else "put_nowait"), put()

    def op_put_many(self, key: int) -> Awaitable[None]:
        """key and one or two other keys in one put_many: all stored or none."""
        keys = [key]
        wanted = self.rng.randint(2, 3)
        for _ in range(16):
            if len(keys) == wanted:
                break
            other = self.pick_key()
            if other not in keys:
                keys.append(other)
        group = [(k, *self.new_value(k)) for k in keys]

        async def put_many() -> None:
            stored = False
            try:
                stored = await self.cache.put_many([(k, value) for k, _, value in group])
            finally:
                for k, version, _ in group:
                    self.model.finished(k, version, stored)

        return put_many()

    async def op_get(self, key: int, device: str | None, rows: bool | None) -> None:
        span = None
        if rows:
            a = self.rng.randrange(0, 8)
            span = slice(a, a + self.rng.randint(1, 8))
        start, floor = self.model.read_started(key)
        try:
            got = await self.cache.get(key, device=device, rows=span)
            if got is None:
                self.report.misses += 1
                return
            self.verify(key, start, floor, got, span, f"get(device={device})")
        except InvalidRowsError:
            if span is None:
                raise
            # the value has fewer rows than asked for
        finally:
            self.model.read_ended(start)

    async def op_compute(self, key: int) -> None:
        version, value = self.new_value(key)
        holder = [value]
        del value
        called = False

        def computed(task: asyncio.Future[Any]) -> None:
            # Seen a little after the shared task stored it (another put may have replaced
            # it meanwhile): no point of order for the key, so the floor stays.
            stored = not task.cancelled() and task.exception() is None
            self.model.finished(key, version, stored, exact=False)

        async def encode() -> torch.Tensor:
            nonlocal called
            called = True
            # This runs inside the cache's shared task, which outlives cancelled callers.
            shared = asyncio.current_task()
            assert shared is not None
            shared.add_done_callback(computed)
            await asyncio.sleep(0)
            return holder.pop()

        start, floor = self.model.read_started(key)
        try:
            got = await self.cache.get_or_compute(key, encode)
            how = "get_or_compute (computed here)" if called else "get_or_compute"
            self.verify(key, start, floor, got, None, how)
        finally:
            if not called:
                self.model.finished(key, version, False)
            self.model.read_ended(start)

    async def op_discard(self, key: int) -> None:
        self.cache.discard(key)
        self.model.discarded(key)

    def verify(
        self,
        key: int,
        start: int,
        floor: int,
        got: torch.Tensor,
        span: slice | None,
        how: str,
    ) -> None:
        self.report.reads_checked += 1
        first = 0 if span is None else span.start
        problem = ""
        if not got.is_contiguous():
            problem = "not contiguous"
        else:
            vid, exact = decode(got, first)
            version, problem = self.model.check(key, start, floor, vid)
            if version is not None:
                shape = (version.rows, ROW_BYTES // version.dtype.itemsize)
                if span is not None:
                    shape = (len(range(*span.indices(version.rows))), shape[1])
                if got.dtype != version.dtype or tuple(got.shape) != shape:
                    problem = (
                        f"dtype/shape {got.dtype} {tuple(got.shape)} != {version.dtype} {shape}"
                    )
                elif not exact:
                    problem = f"bytes differ from version {vid} (poison or a torn copy)"
        if problem:
            self.report.mismatches += 1
            if len(self.report.mismatch_examples) < self.cfg.max_reports:
                self.report.mismatch_examples.append(f"{how} of key {key}, rows {span}: {problem}")

    # adversaries ------------------------------------------------------------------------

    async def holder(self) -> None:
        assert self.sim is not None
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.expovariate(self.cfg.hold_rate_hz))
            with self.sim.hold():
                self.report.holds += 1
                await asyncio.sleep(self.rng.uniform(0, self.cfg.hold_max_s))

    async def injector(self) -> None:
        assert self.sim is not None
        kinds = [k for k in self.cfg.faults if k in SIM_FAULTS]
        if not kinds or self.cfg.fault_rate_hz <= 0:
            return
        while not self.stop.is_set():
            await asyncio.sleep(self.rng.expovariate(self.cfg.fault_rate_hz * len(kinds)))
            kind = self.rng.choice(kinds)
            self.sim.inject(kind, 1)  # type: ignore[arg-type]
            self.report.faults_injected[kind] += 1

    async def sampler(self, warmup_s: float, started: float) -> None:
        baseline: int | None = None
        peak = 0
        last = 0
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
            s = self.cache.stats()
            if s.gpu_bytes > s.gpu_capacity_bytes or s.cpu_bytes > s.cpu_capacity_bytes:
                self.report.budget_violations += 1
            self.report.max_leaked_bytes_in_flight = max(
                self.report.max_leaked_bytes_in_flight, s.leaked_bytes
            )
            if time.monotonic() - started < warmup_s:
                continue
            last = rss_bytes()
            if baseline is None:
                baseline = last
            peak = max(peak, last)
            if self.report.rss_samples % 10 == 0:
                self.report.rss_trace_mib.append(round((last - baseline) / MiB, 1))
            self.report.rss_samples += 1
            self.report.rss_baseline_mib = baseline / MiB
            self.report.rss_max_growth_mib = (peak - baseline) / MiB
            self.report.rss_end_growth_mib = (last - baseline) / MiB

    # the whole run -------------------------------------------------------------------------

    async def run(self) -> SoakReport:
        cfg = self.cfg
        warmup = cfg.warmup_s if cfg.warmup_s is not None else min(10.0, cfg.seconds / 4)
        started = time.monotonic()
        async with self.cache:
            await self.cache.wait_host_ready()
            workers = [asyncio.create_task(self.worker()) for _ in range(cfg.workers)]
            helpers = [asyncio.create_task(self.sampler(warmup, started))]
            if self.sim is not None:
                helpers += [asyncio.create_task(self.holder())]
                helpers += [asyncio.create_task(self.injector())]
            await asyncio.sleep(cfg.seconds)
            self.stop.set()
            await asyncio.gather(*workers, *helpers)
            self.report.seconds = time.monotonic() - started
            await self.settle()
        return self.report

    @staticmethod
    async def retained(cache: FeatureCache) -> tuple[int, list[str]]:
        """Entry objects alive beyond those the index holds, once what device threads
        queued meanwhile has run; and the types of what refers to those that stay."""
        deadline = time.monotonic() + RETAIN_SETTLE_S
        while True:
            gc.collect()
            held = {id(entry) for entry in cache._core.index.held()}
            extra = [o for o in gc.get_objects() if type(o) is Entry and id(o) not in held]
            if not extra or time.monotonic() >= deadline:
                break
            del extra
            await asyncio.sleep(0.01)
        holders = {
            _holder_name(r) for entry in extra for r in gc.get_referrers(entry) if r is not extra
        }
        return len(extra), sorted(holders)

    async def settle(self) -> None:
        """Drain, then audit: what is left must be owned by entries, exactly."""
        cache = self.cache
        if self.sim is not None:
            left = self.sim.withdraw_faults()  # faults not yet fired are out of the audit
            self.report.faults_fired = sum(self.report.faults_injected.values()) - left
        # A get_or_compute whose callers were all cancelled still runs to its put: the
        # audit below is of settled work, so wait for those computations first.
        computing = cache._life.inflight.running()
        if computing:
            await asyncio.wait(computing, timeout=30)  # a stuck one shows in the audit
        await cache.drain()
        if self.sim is not None:
            self.sim.synchronize()
        else:
            torch.cuda.synchronize()
        await cache.drain()
        for _ in range(3):  # done callbacks of finished tasks (and their tracebacks) run next turn
            await asyncio.sleep(0)
        gc.collect()
        self.model.prune()
        self.report.model_versions = sum(len(km.versions) for km in self.model.per_key)
        s = cache.stats()
        self.report.stats = s.as_dict()
        self.report.leaked_bytes = s.leaked_bytes
        self.report.pending_copies_after_drain = s.pending_copies
        self.report.entries_retained, self.report.retained_by = await self.retained(cache)
        held = cache._core.index.held()
        gpu_entries = [e for e in held if e.state is State.GPU]
        if self.sim is not None:
            self.report.gpu_entry_bytes = sum(e.nbytes for e in gpu_entries)
            self.report.device_bytes = self.sim.allocated_bytes
        else:
            # The caching allocator rounds each block up to 512 bytes.
            self.report.gpu_entry_bytes = sum(-(-e.nbytes // 512) * 512 for e in gpu_entries)
            self.report.device_bytes = int(torch.cuda.memory_allocated(self.dev.name))


async def run_soak(config: SoakConfig, device: Device | None = None) -> SoakReport:
    """Run the soak on the running loop and return its report (does not raise on failure)."""
    if device is None:
        if config.device == "sim":
            device = SimDevice(
                bandwidth_gbps=config.sim_bandwidth_gbps, latency_s=config.sim_latency_s
            )
        else:
            from mmcache.device.cuda import CudaDevice

            device = CudaDevice(config.device)
        owned = True
    else:
        owned = False
    try:
        return await _Soak(config, device).run()
    finally:
        if owned:
            device.close()


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Injected faults log a warning each; keep the summary readable."""
    import logging

    logger = logging.getLogger("mmcache")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    d = SoakConfig()
    parser.add_argument("--device", default=d.device, help="sim (default), cuda or cuda:N")
    parser.add_argument("--seconds", type=float, default=d.seconds)
    parser.add_argument("--warmup", type=float, default=None, help="seconds before RSS counts")
    parser.add_argument("--workers", type=int, default=d.workers, help="concurrent tasks")
    parser.add_argument("--keys", type=int, default=d.keys)
    parser.add_argument("--gpu-mb", type=float, default=d.gpu_mb)
    parser.add_argument("--cpu-mb", type=float, default=d.cpu_mb)
    parser.add_argument("--max-kib", type=int, default=d.max_kib, help="largest value")
    parser.add_argument(
        "--faults",
        default=",".join(d.faults),
        help="simulator faults to inject, comma-separated (copy_fails,alloc_fails; '' for none)",
    )
    parser.add_argument("--fault-rate", type=float, default=d.fault_rate_hz, help="per s each")
    parser.add_argument("--cancel", type=float, default=d.cancel_probability)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("soak: no CUDA device; run with --device sim", file=sys.stderr)
        return 2
    config = SoakConfig(
        device=args.device,
        seconds=args.seconds,
        warmup_s=args.warmup,
        workers=args.workers,
        keys=args.keys,
        gpu_mb=args.gpu_mb,
        cpu_mb=args.cpu_mb,
        max_kib=args.max_kib,
        faults=tuple(f for f in args.faults.split(",") if f),
        fault_rate_hz=args.fault_rate,
        cancel_probability=args.cancel,
        seed=args.seed,
    )
    with _quiet_logs():
        report = asyncio.run(run_soak(config))
    print(
        f"soak on {report.device}: {config.workers} workers, {config.keys} keys, "
        f"GPU {config.gpu_mb} MiB, host {config.cpu_mb} MiB"
    )
    print(markdown_table(["", "value"], report.rows()))
    for example in report.mismatch_examples:
        print(f"mismatch: {example}")
    print(f"RSS growth over the run, MiB per second: {report.rss_trace_mib}")
    for error in report.errors[:20]:
        print(f"error: {error}")
    write_json(args.json, {"config": asdict(config), "report": report.as_dict()})
    return 0 if report.ok else 1


def _holder_name(referrer: object) -> str:
    """What refers to a retained entry: its type, and for a frame where it runs."""
    if isinstance(referrer, types.FrameType):
        code = referrer.f_code
        return f"frame of {code.co_name} ({Path(code.co_filename).name}:{referrer.f_lineno})"
    return type(referrer).__name__


if __name__ == "__main__":
    sys.exit(main())

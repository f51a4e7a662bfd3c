"""Shared fixtures: every scenario runs on the simulator, and on CUDA when a GPU is present."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.device import Device, SimDevice
from mmcache.device.base import Fence

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked cuda where no GPU is present."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@dataclass
class Rig:
    """One device under test and the means to make data on it and to stall its copies."""

    device: Device
    kind: str

    def tensor(
        self, *shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0
    ) -> torch.Tensor:
        """Random data (never zeros: they hide unwritten memory) on the device."""
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(*shape, generator=g).to(dtype)
        return t if self.kind == "sim" else t.to(self.device.name)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the copies queued inside the block from completing while it runs."""
        if isinstance(self.device, SimDevice):
            with self.device.hold():
                yield
            return
        # On a GPU a copy cannot be paused: park each copy stream behind a long kernel.
        for s in self.device.copy_streams():  # type: ignore[attr-defined]
            stall(s, 0.2)
        yield

    def settle(self) -> None:
        """Block until the device has run everything queued."""
        if isinstance(self.device, SimDevice):
            self.device.synchronize()
        else:
            torch.cuda.synchronize()

    def allocated_bytes(self) -> int:
        if isinstance(self.device, SimDevice):
            return self.device.allocated_bytes
        return int(torch.cuda.memory_allocated())


_SLEEP_CYCLES_PER_S: list[float] = []


def stall(stream: torch.cuda.Stream, seconds: float) -> None:
    """Queue a kernel that keeps stream busy for about seconds (calibrated once)."""
    if not _SLEEP_CYCLES_PER_S:
        probe = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(probe):
            torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # loads the kernel
            start.record()
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S.append(50_000_000 / (start.elapsed_time(end) / 1e3))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * _SLEEP_CYCLES_PER_S[0]))  # type: ignore[no-untyped-call]


def without_a_gpu() -> dict[str, str]:
    """This process's environment with every GPU hidden: a child run with it takes the path
    of a machine without one (the simulator), on a GPU host too."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _make_device(kind: str) -> Device:
    if kind == "sim":
        return SimDevice()
    from mmcache.device.cuda import CudaDevice

    # Pinning in the foreground: tests see the host tier from the first put. The
    # background path has a test of its own.
    return CudaDevice(0, background_pinning=False)


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    device = _make_device(request.param)
    yield Rig(device, request.param)
    device.close()


@pytest.fixture
def sim_rig() -> Iterator[Rig]:
    device = SimDevice()
    yield Rig(device, "sim")
    device.close()


CacheFactory = Callable[..., FeatureCache]


@pytest.fixture
def no_collection_during_reports() -> Iterator[None]:
    """Collect garbage only inside tests: finalizers run while pytest parses a failing test's
    source trip CPython 3.11.7's AST recursion check (SystemError: AST constructor recursion
    depth mismatch; fixed in 3.11.8) and abort the session."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


KiB = 1024


def feature(rig: Rig, kib: int, seed: int = 0) -> torch.Tensor:
    """A float32 feature of kib KiB (rows of 1 KiB) on the rig's device."""
    return rig.tensor(kib, 256, dtype=torch.float32, seed=seed)


def assert_exact(got: torch.Tensor | None, want: torch.Tensor) -> None:
    """Same dtype, shape and bytes (poison, NaN or zeros never pass)."""
    assert got is not None
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    a = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b)


def reader_stream(rig: Rig) -> Any:
    """A stream of the reader's own, not the cache's copy streams."""
    if isinstance(rig.device, SimDevice):
        return rig.device.stream("reader")
    return torch.cuda.Stream(device=rig.device.name)  # type: ignore[no-untyped-call]


def needs_hold(rig: Rig) -> None:
    """Skip where copies cannot be held back on demand (a GPU only delays them)."""
    if rig.kind != "sim":
        pytest.skip("holds copies back: SimDevice only")


async def put_feature(
    cache: FeatureCache, rig: Rig, key: Hashable, kib: int, seed: int = 0
) -> torch.Tensor:
    """Put a fresh feature, dropping our reference to it; return a clone to compare with."""
    t = feature(rig, kib, seed)
    expected = t.cpu().clone()
    assert await cache.put(key, t)
    del t
    return expected


#: each cache built here -> its private metrics registry (read by metric())
_REGISTRIES: weakref.WeakKeyDictionary[FeatureCache, CollectorRegistry] = (
    weakref.WeakKeyDictionary()
)


def with_registry(cache: FeatureCache, registry: CollectorRegistry) -> FeatureCache:
    """cache, whose metrics (in registry) metric() reads from now on."""
    _REGISTRIES[cache] = registry
    return cache


def metric(cache: FeatureCache, name: str, **labels: str) -> float:
    """A sample of one of cache's metrics (0 if it has none yet)."""
    got = _REGISTRIES[cache].get_sample_value(name, {"cache": cache.name, **labels})
    return 0.0 if got is None else got


def leaked(cache: FeatureCache) -> dict[str, float]:
    """The leak audit per tier (stats() runs it; its sum alone could hide opposite errors)."""
    cache.stats()
    return {tier: metric(cache, "mmcache_leaked_bytes", tier=tier) for tier in ("gpu", "cpu")}


async def served_from(cache: FeatureCache, key: Hashable) -> str | None:
    """The tier that serves key ("gpu" or "cpu"; None on a miss), as a host read counts it.

    A read to the host promotes nothing; it waits for an offload in flight, which counts
    as a GPU hit until it lands.
    """
    before = cache.stats()
    if await cache.get(key, device="cpu") is None:
        return None
    after = cache.stats()
    if after.hits_gpu > before.hits_gpu:
        return "gpu"
    assert after.hits_cpu == before.hits_cpu + 1
    return "cpu"


def live_units() -> list[Any]:
    """The cache entries alive in this process (a group counts once): how the tiers hold
    the features, found without reaching into a cache."""
    from mmcache.core.entry import Entry

    gc.collect()
    return [o for o in gc.get_objects() if type(o) is Entry]


def live_members() -> int:
    """How many features alive in this process are members of a group (rows of its entry)."""
    from mmcache.core.entry import Member

    gc.collect()
    return sum(type(o) is Member for o in gc.get_objects())


@pytest.fixture
async def make_cache(rig: Rig) -> AsyncIterator[CacheFactory]:
    """Build caches on the rig's device with a private metrics registry; closes them after."""
    made: list[FeatureCache] = []

    def factory(gpu_mb: float = 1, cpu_mb: float = 4, **settings: Any) -> FeatureCache:
        # Exact eviction order is what these tests check: no offloading ahead unless asked.
        settings.setdefault("evict_ahead", 0)
        s = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb, **settings)
        registry = CollectorRegistry()
        cache = with_registry(FeatureCache(s, device=rig.device, registry=registry), registry)
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        await cache.close(timeout=10)


class TimedFence(Fence):
    """Done from a set time on; reported by a thread that sleeps until then."""

    __slots__ = ("_at",)

    def __init__(self, after_s: float) -> None:
        self._at = time.monotonic() + after_s

    def done(self) -> bool:
        return time.monotonic() >= self._at

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        def report() -> None:
            time.sleep(max(0.0, self._at - time.monotonic()))
            fn()  # Python again: needs the GIL back

        threading.Thread(target=report, daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError


async def longest_loop_gap(work: Awaitable[object]) -> float:
    """Await work while a 1 ms ticker runs on the loop; the longest the ticker waited for it."""
    stop = asyncio.Event()
    longest = 0.0

    async def ticking() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    ticker = asyncio.create_task(ticking())
    await asyncio.sleep(0)
    try:
        await work
    finally:
        stop.set()
        await ticker
    return longest


@pytest.fixture(scope="session", params=["redis", "valkey"])
def redis_session(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One real server of each kind for the session, Redis and Valkey (skips where one is
    absent, fails under CI)."""
    from redis_server import redis_server, require_server

    require_server(request.param)
    with redis_server(kind=request.param) as server:
        yield server


@pytest.fixture
def redis_url(redis_session: Any) -> str:
    """The session's server, emptied for this test."""
    redis_session.cli("FLUSHALL")
    url: str = redis_session.url
    return url

"""Shared fixtures: every scenario runs on the simulator, and on CUDA when a GPU is present."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.device import Device, SimDevice

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
        streams = self.device.copy_streams()  # type: ignore[attr-defined]
        for s in streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(int(2e8))  # type: ignore[no-untyped-call]  # ~100 ms
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


def _make_device(kind: str) -> Device:
    if kind == "sim":
        return SimDevice()
    from mmcache.device.cuda import CudaDevice

    return CudaDevice(0)


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
async def make_cache(rig: Rig) -> AsyncIterator[CacheFactory]:
    """Build caches on the rig's device with a private metrics registry; closes them after."""
    made: list[FeatureCache] = []

    def factory(gpu_mb: float = 1, cpu_mb: float = 4, **settings: Any) -> FeatureCache:
        s = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb, **settings)
        cache = FeatureCache(s, device=rig.device, registry=CollectorRegistry())
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        await cache.close(timeout=10)

"""Helpers shared by the IPC transport tests: settings, deterministic features, in-process rigs.

No tests live here; spawned receiver processes import this module by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from conftest import Rig
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings
from mmcache.device import SimDevice
from mmcache.ipc import FeatureReceiver, FeatureSender

MiB = 1 << 20
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8, torch.int64)
_BASE_BYTES = 4 * MiB
_base: list[torch.Tensor] = []


def ipc_settings(pool_mb: float = 1, fallback_mb: float = 4, **overrides: Any) -> CacheSettings:
    """Settings with the transport on, small arenas, and a fast recycler."""
    values: dict[str, Any] = {
        "ipc_pool_mb": pool_mb,
        "ipc_fallback_mb": fallback_mb,
        "use_cuda_ipc": True,
        "ipc_recycle_interval_s": 0.01,
    }
    values.update(overrides)
    return CacheSettings(**values)


def _base_bytes() -> torch.Tensor:
    if not _base:
        g = torch.Generator().manual_seed(1234)
        _base.append(torch.randint(0, 256, (_BASE_BYTES,), dtype=torch.uint8, generator=g))
    return _base[0]


def feature_nbytes(i: int, max_bytes: int = 2 * MiB) -> int:
    """Mixed sizes: mostly small, some of a few hundred KiB, a few of megabytes."""
    rng = random.Random(i)
    pick = rng.random()
    if pick < 0.6:
        nbytes = rng.randrange(64, 64 << 10)
    elif pick < 0.9:
        nbytes = rng.randrange(64 << 10, 512 << 10)
    else:
        nbytes = rng.randrange(512 << 10, max_bytes)
    return nbytes


def feature(i: int, max_bytes: int = 2 * MiB) -> torch.Tensor:
    """Feature i on the host: deterministic bytes (stamped with i), a mixed dtype and shape."""
    rng = random.Random(~i)
    dtype = rng.choice(_DTYPES)
    cols = rng.choice((1, 3, 64, 1024))
    rows = max(1, feature_nbytes(i, max_bytes) // (dtype.itemsize * cols))
    nbytes = rows * cols * dtype.itemsize
    offset = rng.randrange(0, _BASE_BYTES - nbytes + 1) if nbytes < _BASE_BYTES else 0
    raw = _base_bytes()[offset : offset + nbytes].clone()
    raw[: min(8, nbytes)] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)[
        : min(8, nbytes)
    ]
    return raw.view(dtype).view(rows, cols)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
    )


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def settled_bytes(rig: Rig, want: int, timeout: float = 2.0) -> int:  # noqa: ASYNC109
    """Device memory once the device has caught up; want or what it is at timeout.

    On CUDA a tensor kept alive for a fence is dropped by a waiter thread a moment
    after the GPU passed it; the simulator is exact at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        rig.settle()
        got = rig.allocated_bytes()
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.01)


@dataclass
class Transport:
    """A sender and its in-process receivers on one rig."""

    rig: Rig
    sender: FeatureSender
    receivers: list[FeatureReceiver]
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the sender's metrics (0 if absent)."""
        value = self.registry.get_sample_value(name, {"cache": self.sender.name, **labels})
        return 0.0 if value is None else value

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """t moved to the rig's device (the simulator's device memory is the CPU)."""
        return t if self.rig.kind == "sim" else t.to(self.rig.device.name)


def new_receiver(rig: Rig) -> FeatureReceiver:
    """A receiver like one in another process: its own simulator, or the rig's GPU."""
    return FeatureReceiver(device=SimDevice() if rig.kind == "sim" else rig.device)


@contextlib.asynccontextmanager
async def transport(
    rig: Rig, *, consumers: int = 2, receivers: int | None = None, **settings: Any
) -> AsyncIterator[Transport]:
    """A started sender with `receivers` (default: consumers) connected receivers."""
    registry = CollectorRegistry()
    sender = FeatureSender(
        ipc_settings(**settings), device=rig.device, consumers=consumers, registry=registry
    )
    await sender.start()
    made = [new_receiver(rig) for _ in range(consumers if receivers is None else receivers)]
    try:
        for receiver in made:
            await receiver.connect(sender.endpoint)
        yield Transport(rig, sender, made, registry)
    finally:
        for receiver in made:
            await receiver.close(timeout=5)
        await sender.close(timeout=1)

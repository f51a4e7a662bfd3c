"""Devices: where features live, and the fenced copies between them and the host."""

from __future__ import annotations

from mmcache.device.base import DONE, Device, Fence, Stream, storage_use_count
from mmcache.device.plan import Copied, CopyPlan, NewCopyPlan
from mmcache.device.sim import SimDevice
from mmcache.device.sim_engine import SimFence, SimStream

__all__ = [
    "DONE",
    "Copied",
    "CopyPlan",
    "Device",
    "Fence",
    "NewCopyPlan",
    "SimDevice",
    "SimFence",
    "SimStream",
    "Stream",
    "resolve_device",
    "storage_use_count",
]


def resolve_device(spec: str | Device) -> Device:
    """Turn "cuda", "cuda:1", "sim" or a Device instance into a Device."""
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"device must be 'cuda', 'cuda:N', 'sim' or a Device, not {spec!r}")
    if spec == "sim":
        return SimDevice()
    if spec == "cuda" or spec.startswith("cuda:"):
        from mmcache.device.cuda import CudaDevice  # imported lazily: needs a GPU at use

        return CudaDevice(spec)
    raise ValueError(f"unknown device {spec!r}: use 'cuda', 'cuda:N', 'sim' or a Device")

"""What crosses the process boundary: the sender's endpoint and one picklable handle per send."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, final

import torch

__all__ = ["FeatureHandle", "SenderEndpoint", "dtype_from_name", "dtype_name"]

_MiB: Final = 1 << 20


@final
@dataclass(frozen=True, slots=True)
class SenderEndpoint:
    """How a receiver reaches a sender: its control block and the memory it shares.

    device_kind is "sim" (the pool is a shared CPU segment at pool_path) or
    "cuda" (the pool is device memory: cuda_pool is its cuIpcMemHandle, on the
    GPU whose UUID is device_uuid). The host fallback is the segment at
    fallback_path. Empty paths and handles mean that part is off.
    """

    control_path: str
    pid: int
    device_kind: Literal["sim", "cuda"]
    device_uuid: str
    pool_path: str
    pool_nbytes: int
    cuda_pool: bytes
    fallback_path: str
    fallback_nbytes: int


@final
@dataclass(frozen=True, slots=True)
class FeatureHandle:
    """One sent feature: where its bytes are, what they are, and the slot that tracks them.

    where is "pool" (a slice of the sender's IPC pool, written stream-ordered:
    wait for the slot's ready mark or for cuda_event before reading) or "host"
    (a block of the shared host fallback, written before send returned).
    """

    sender: SenderEndpoint
    seq: int
    slot: int
    where: Literal["pool", "host"]
    offset: int
    shape: tuple[int, ...]
    dtype: str
    cuda_event: bytes = b""

    @property
    def nbytes(self) -> int:
        """Bytes of the feature."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    def describe(self) -> str:
        """One line naming the handle, for logs and errors."""
        shape = ", ".join(map(str, self.shape))
        return (
            f"IPC handle #{self.seq} ({self.where} slot {self.slot}, offset {self.offset}, "
            f"{self.nbytes / _MiB:.2f} MiB {self.dtype}[{shape}]) of sender pid {self.sender.pid}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """The name a handle carries for dtype ("bfloat16", ...); dtype_from_name reverses it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called name ("bfloat16", ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype

"""Copies of host bytes for host reads: one memcpy, and large ones a slice per loop turn.

A host read copies a feature out of the pinned arena into a tensor the caller owns.
torch's clone and copy_ would split a large copy over its intra-op threads, which spin
afterwards, and torch sizes that pool by the machine's cores, not by the cores the
process may use: with the process kept to 4 of the H200 host's 16 cores, a clone took
32 ms whatever the size (BENCHMARKS.md, "Host reads to the CPU"). One memcpy avoids
that, but one core copies only about 9-11 GB/s there, so a large read would hold the
event loop for milliseconds. It is copied a slice at a time instead, with the loop's
other work running between slices.

Not on worker threads: a worker must take the GIL back to report, and a loop that never
goes idle can keep it from the worker for seconds (see mmcache.waiting).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

import torch

__all__ = ["SLICE_BYTES", "copy_host_bytes", "copy_host_bytes_in_slices"]

#: Bytes copied between two turns of the event loop: about 0.1 ms of one core's memcpy.
SLICE_BYTES = 1 << 20

# ctypes.memmove is a foreign function: a call lets go of the GIL while it copies.
_memmove: Callable[[int, int, int], object] = ctypes.memmove


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    for tensor, role in ((dst, "destination"), (src, "source")):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"host copy {role} must be a contiguous host tensor")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"host copy of {src.nbytes} bytes into a {dst.nbytes}-byte destination")


def copy_host_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of src into dst, two contiguous host tensors of one size, by one
    memcpy on the calling thread. Bad arguments raise ValueError before a byte moves."""
    _check_pair(dst, src)
    if src.nbytes:
        _memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)


async def copy_host_bytes_in_slices(
    dst: torch.Tensor, src: torch.Tensor, slice_bytes: int = SLICE_BYTES
) -> None:
    """copy_host_bytes, slice_bytes at a time, letting the event loop run its other work
    between slices. Cancelled, it stops between two slices (dst then holds part of src)."""
    if slice_bytes <= 0:
        raise ValueError(f"slice_bytes must be > 0, not {slice_bytes}")
    _check_pair(dst, src)
    nbytes = src.nbytes
    dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()  # dst and src stay alive in this frame
    for start in range(0, nbytes, slice_bytes):
        if start:
            await asyncio.sleep(0)
        _memmove(dst_ptr + start, src_ptr + start, min(slice_bytes, nbytes - start))

"""Copies described by a value: a CopyPlan or NewCopyPlan, submitted by Device.submit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

if TYPE_CHECKING:
    from mmcache.device.base import Fence, Stream, Views

__all__ = ["Copied", "CopyPlan", "Direction", "NewCopyPlan"]

#: Which memory a copy reads and writes: host to device, device to host, within the device.
Direction = Literal["h2d", "d2h", "d2d"]

#: What a NewCopyPlan gives: the new tensor, and the fence readers order after (None where
#: the copy is queued on the reader's stream, stream order covers it and the tensor is the
#: reader's, nothing to release: an "h2d" plan with a stream, on a stream-ordered device).
Copied: TypeAlias = "tuple[torch.Tensor, Fence | None]"


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Copies into memory that exists, queued together: Device.submit returns their one
    Fence, failed if any of them fails.

    Each of srcs goes to the tensor of dsts at its index (same byte size; "d2d" copies may
    also change layout, not size), or, with into, to into's bytes at its offset of offsets
    (into is a flat uint8 tensor: the host arena for "d2h", an IPC pool slice for "d2d").

    "h2d" and "d2h" copies run on the device's copy stream of that direction, after the
    fences in after (each direction's copies complete in the order submitted); "d2d" copies
    run on stream (required), after the fences in after and earlier work on stream. No two
    copies may write the same bytes, nor read bytes another writes: they may run in any
    order among themselves.

    The device keeps what a copy reads and writes from reuse until it is done, but for:
    "d2h" into (the caller keeps the sources: a batch is many small features, and per
    source allocator bookkeeping adds up), "d2d" into and dsts_held (the caller keeps the
    destinations, memory outside the device's allocator such as the IPC pool).

    owned ("d2h" into): the sources are the cache's own aliases (whole, contiguous tensors
    of this device with no lazy conjugate or negation, checked at put) and the ranges its
    host pool's blocks, which never overlap; a device may skip checking them again (not
    their bounds). views ("d2d" into): views(offset, shape, dtype) makes a typed
    destination where a copy needs one (default: a slice of into viewed as it).
    """

    direction: Direction
    srcs: Sequence[torch.Tensor]
    dsts: Sequence[torch.Tensor] = ()
    into: torch.Tensor | None = None
    offsets: Sequence[int] = ()
    after: Sequence[Fence] = ()
    stream: Stream | None = None
    owned: bool = False
    dsts_held: bool = False
    views: Views | None = None


@dataclass(frozen=True, slots=True)
class NewCopyPlan:
    """Copies into a tensor the device allocates: Device.submit returns it and the fence of
    the copies (see Copied), the caller owning the tensor's alias (release() it).

    - "h2d": srcs (host) into a new device tensor of shape and dtype (default: the one
      source's), after the fences; with offsets, each source's bytes at its offset in a
      new flat uint8 buffer of shape (nbytes,) (one allocation, one ordering). Without
      stream, on the H2D copy stream; with stream, for a reader on stream, copied there
      where the device can (the copy then reads srcs until the work queued on stream so
      far is done: a fence recorded on stream later covers that read).
    - "d2h": the one source (device) into a new host tensor fit for asynchronous copies,
      of the source's shape and dtype, on the D2H copy stream after the fences.
    - "d2d": on stream (required), after the fences and earlier work there: the one
      source (contiguous) into a new tensor of its shape and dtype, or with rows, the
      sources' rows back to back (they share dtype and the shape after their first
      dimension; views welcome). The caller keeps the sources valid until the fence.
    """

    direction: Direction
    srcs: Sequence[torch.Tensor]
    shape: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    offsets: Sequence[int] = ()
    rows: bool = False
    after: Sequence[Fence] = ()
    stream: Stream | None = None

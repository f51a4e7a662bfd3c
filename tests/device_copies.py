"""The device's copies by their old names, each one CopyPlan or NewCopyPlan submitted: the
device tests call these to say which copy they mean in a word."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmcache.device import Copied, CopyPlan, Device, Fence, NewCopyPlan, Stream
from mmcache.device.base import Views


def copy_d2h(device: Device, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
    return device.submit(CopyPlan("d2h", (src,), (dst,), after=after))


def copy_h2d(device: Device, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
    return device.submit(CopyPlan("h2d", (src,), (dst,), after=after))


def copy_h2d_many(
    device: Device,
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    after: Sequence[Fence],
) -> Fence:
    return device.submit(CopyPlan("h2d", srcs, dsts, after=after))


def copy_h2d_new(
    device: Device,
    src: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    after: Sequence[Fence],
) -> tuple[torch.Tensor, Fence]:
    dst, fence = device.submit(NewCopyPlan("h2d", (src,), shape, dtype, after=after))
    assert fence is not None
    return dst, fence


def upload_on(
    device: Device,
    src: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    stream: Stream,
    after: Sequence[Fence],
) -> Copied:
    return device.submit(NewCopyPlan("h2d", (src,), shape, dtype, after=after, stream=stream))


def upload_packed_on(
    device: Device,
    srcs: Sequence[torch.Tensor],
    offsets: Sequence[int],
    nbytes: int,
    stream: Stream,
    after: Sequence[Fence],
) -> Copied:
    plan = NewCopyPlan("h2d", srcs, (nbytes,), offsets=offsets, after=after, stream=stream)
    return device.submit(plan)


def copy_d2h_batch(
    device: Device,
    srcs: Sequence[torch.Tensor],
    host: torch.Tensor,
    offsets: Sequence[int],
    after: Sequence[Fence],
    *,
    owned: bool = False,
) -> Fence:
    return device.submit(
        CopyPlan("d2h", srcs, into=host, offsets=offsets, after=after, owned=owned)
    )


def copy_d2d(device: Device, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> Fence:
    return device.submit(CopyPlan("d2d", (src,), (dst,), stream=stream))


def copy_d2d_many(
    device: Device,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    stream: Stream,
    *,
    dsts_held: bool = False,
) -> Fence:
    srcs = [src for src, _ in pairs]
    dsts = [dst for _, dst in pairs]
    return device.submit(CopyPlan("d2d", srcs, dsts, stream=stream, dsts_held=dsts_held))


def copy_d2d_into(
    device: Device,
    srcs: Sequence[torch.Tensor],
    dst: torch.Tensor,
    offsets: Sequence[int],
    stream: Stream,
    views: Views | None = None,
) -> Fence:
    plan = CopyPlan("d2d", srcs, into=dst, offsets=offsets, stream=stream, views=views)
    return device.submit(plan)


def copy_d2d_new(device: Device, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, Fence]:
    dst, fence = device.submit(NewCopyPlan("d2d", (src,), stream=stream))
    assert fence is not None
    return dst, fence


def pack(
    device: Device, srcs: Sequence[torch.Tensor], stream: Stream
) -> tuple[torch.Tensor, Fence]:
    packed, fence = device.submit(NewCopyPlan("d2d", srcs, rows=True, stream=stream))
    assert fence is not None
    return packed, fence


def host_arena(device: Device, nbytes: int) -> torch.Tensor:
    return device.host_arena(nbytes).result()

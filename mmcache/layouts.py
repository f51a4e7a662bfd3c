"""The tensor layouts the cache holds (dense strided tensors only, refused up front
otherwise), and runs of features that lie back to back in flat memory."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence

import torch

from mmcache.errors import InvalidValueError

__all__ = ["check_strided", "contiguous_strides", "rows_back_to_back"]


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of shape (torch's: a size-0 dimension counts 1);
    cached, as features repeat a few shapes and a hit is one C call."""
    strides = [1] * len(shape)
    step = 1
    for dim in range(len(shape) - 1, -1, -1):
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def check_strided(value: object, caller: str) -> None:
    """Refuse a tensor that is not dense and strided (sparse, mkldnn, nested), naming its layout.

    Such tensors have no single storage of nbytes bytes: sizing, owning or copying one
    fails inside torch, so they are refused before anything is reserved. A value that is
    not a tensor passes: the caller's own checks name what it is.
    """
    if not isinstance(value, torch.Tensor):
        return
    layout = value.layout
    if layout is torch.strided and not value.is_nested:
        return
    name = str(layout).removeprefix("torch.").lstrip("_")
    if value.is_nested:
        name = f"nested ({name})"
    raise InvalidValueError(
        f"{caller} takes dense strided tensors, not a {name} one; convert it first "
        "(.to_dense() for sparse and mkldnn, .to_padded_tensor(0) or .unbind() for nested)"
    )


def rows_back_to_back(
    parts: Sequence[tuple[int, tuple[int, ...], Hashable]], itemsize: int
) -> list[int] | None:
    """Each part's rows, if there are several parts (byte offset, shape, dtype) of one dtype
    and row shape that lie back to back; else None.

    Such parts are one tensor of all their rows, split by rows: one view, gather or split
    serves them all. itemsize is the bytes of one element of the first part's dtype.
    """
    if len(parts) < 2:
        return None
    first_at, first_shape, kind = parts[0]
    if not first_shape:
        return None
    row_shape = first_shape[1:]
    row_bytes = math.prod(row_shape) * itemsize
    rows = []
    end = first_at
    for at, shape, dtype in parts:
        if at != end or dtype != kind or not shape or shape[1:] != row_shape:
            return None
        rows.append(shape[0])
        end = at + shape[0] * row_bytes
    return rows

"""The tensor layouts the cache holds: dense strided tensors only, refused up front otherwise."""

from __future__ import annotations

import torch

from mmcache.errors import InvalidValueError

__all__ = ["check_strided"]


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

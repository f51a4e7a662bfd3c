"""Which tensors mmcache can store and send: dense strided ones only."""

from __future__ import annotations

import torch

from mmcache.errors import InvalidValueError

__all__ = ["check_strided"]


def check_strided(value: object, what: str) -> None:
    """Refuse a sparse, mkldnn or nested tensor with InvalidValueError naming its layout.

    what names the caller in the message ("put()", "send()", ...); a value that is no
    tensor at all is left to the caller's own type check.
    """
    if not isinstance(value, torch.Tensor):
        return
    if value.is_nested:
        layout = "nested"
    elif value.layout != torch.strided:
        layout = str(value.layout).removeprefix("torch.").lstrip("_")
    else:
        return
    raise InvalidValueError(
        f"{what} takes dense strided tensors, not a {layout} one; convert it first "
        "(.to_dense() for sparse and mkldnn, .unbind() or torch.cat for nested)"
    )

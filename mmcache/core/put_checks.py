"""PutChecks: whether a put's values are features the cache can take, and fit its tiers.

Each check raises an error that says what is wrong and, for a value too large, the
setting to raise (under the name the budget came from: an environment variable or a
keyword). A put of one new device tensor that fits (Puts.put_new) calls none of them;
Puts.put_batch checks a batch's values in one pass of its own and calls them only for
a value that pass finds off, and for the batch's total.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Final, final

import torch

from mmcache.core.entry import check_keys
from mmcache.core.host import HostTier
from mmcache.device import Device
from mmcache.device.base import feature_bytes
from mmcache.errors import InvalidKeyError, InvalidValueError, ValueTooLargeError
from mmcache.layouts import check_strided

__all__ = ["PutChecks", "check_items", "owns_storage"]

MiB: Final = 1024 * 1024


@final
class PutChecks:
    """The checks of put, put_many and put_split that depend on the device and the tiers."""

    def __init__(
        self,
        *,
        device: Device,
        host: HostTier,
        gpu_capacity: int,
        how_to_change: Callable[[str], str],
    ) -> None:
        self._device = device
        self._host = host
        self._gpu_capacity = gpu_capacity
        self._how_to_change = how_to_change  # names the variable or keyword a budget came from

    def check_split(
        self, keys: Sequence[Hashable], value: torch.Tensor, split_sizes: Sequence[int]
    ) -> tuple[list[Hashable], list[int]]:
        """put_split's arguments checked: its keys as a list, and the rows of each feature."""
        if isinstance(keys, (str, bytes)):
            raise InvalidKeyError(
                f"put_split takes a sequence of keys, one per item, not one {type(keys).__name__}"
            )
        keys = list(keys)
        sizes_given = list(split_sizes)
        try:
            rows = list(map(operator.index, sizes_given))
        except TypeError:
            raise InvalidValueError(
                f"split sizes must be a sequence of ints, not {split_sizes!r}"
            ) from None
        check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidKeyError("put_split got the same key twice; keys must be distinct")
        if len(rows) != len(keys):
            raise InvalidValueError(
                f"put_split got {len(keys)} keys and {len(rows)} split sizes; one size per key"
            )
        check_strided(value, "put_split()")
        self.check_value(value, "put_split()")
        if value.dim() == 0:
            raise InvalidValueError("put_split splits a tensor by rows; got a 0-dim tensor")
        if rows and (min(rows) <= 0 or bool in set(map(type, sizes_given))):
            raise InvalidValueError(f"split sizes must be positive ints, got {sizes_given}")
        if sum(rows) != value.shape[0]:
            raise InvalidValueError(
                f"split sizes add up to {sum(rows)} rows; the tensor has {value.shape[0]}"
            )
        return keys, rows

    def check_value(self, value: object, caller: str = "put()") -> int:
        """value's bytes, if it is a tensor in the device's memory and not empty."""
        nbytes = feature_bytes(self._device, value, caller)
        if nbytes == 0:
            assert isinstance(value, torch.Tensor)
            raise InvalidValueError(f"refusing an empty tensor of shape {tuple(value.shape)}")
        return nbytes

    def check_fits(self, nbytes: int, to_gpu: bool) -> None:
        """A feature of nbytes fits the tier it goes to, or the error names what to raise."""
        if to_gpu and nbytes > self._gpu_capacity:
            raise ValueTooLargeError(
                f"value of {nbytes / MiB:.1f} MB exceeds the GPU tier "
                f"({self._gpu_capacity / MiB:.1f} MB); raise "
                f"{self._how_to_change('gpu_cache_mb')}"
            )
        limit = self._host.limit()
        if not to_gpu and nbytes > limit:
            raise ValueTooLargeError(
                f"value of {nbytes / MiB:.1f} MB exceeds the host tier ({limit / MiB:.1f} MB), "
                f"and the GPU tier is off; raise "
                f"{self._how_to_change('cpu_cache_mb')}"
            )

    def check_group_fits(self, total: int, to_gpu: bool) -> None:
        """Features put together must fit their tier together: none of them would go in."""
        capacity = self._gpu_capacity if to_gpu else self._host.capacity
        if total > capacity:
            tier = "GPU" if to_gpu else "host"
            raise ValueTooLargeError(
                f"features of {total / MiB:.1f} MB in all exceed the {tier} tier "
                f"({capacity / MiB:.1f} MB); put them in smaller groups"
            )


def check_items(batch: list[tuple[Hashable, torch.Tensor]]) -> None:
    """put_many's items checked: (key, tensor) pairs under distinct keys."""
    keys = []
    for item in batch:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidValueError(
                f"put_many takes (key, tensor) pairs, not {type(item).__name__}"
            )
        check_strided(item[1], "put_many()")
        keys.append(item[0])
    check_keys(keys)  # before hashing: an unhashable key gets a clear error
    if len(set(keys)) != len(batch):
        raise InvalidKeyError("put_many got the same key twice; keys must be distinct")


def owns_storage(value: torch.Tensor) -> bool:
    """Whether the cache may hold value itself: it is its whole storage, contiguous.

    Not a lazy conjugate (or negation) either: its bytes are not its values, and offloads
    copy bytes. Anything else is compacted at put.
    """
    return (
        value.is_contiguous()
        and value.untyped_storage().nbytes() == value.nbytes
        and not value.is_conj()
        and not value.is_neg()
    )

"""DeviceRelease: device memory the tier state gave up, to release after fences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from mmcache.device.base import Fence

__all__ = ["DeviceRelease", "Release"]


@final
@dataclass(slots=True, eq=False)
class DeviceRelease:
    """A device tensor no entry holds any more: release it after `after`. Where `later` is
    not 0, those bytes stay in the GPU ledger until then: report them with released()."""

    tensor: torch.Tensor
    after: Sequence[Fence]
    later: int = 0


Release = DeviceRelease

"""The budgets of a cache against the machine it runs on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from mmcache.device import Device
from mmcache.device.base import host_memory_bytes
from mmcache.errors import SettingsError
from mmcache.settings import CacheSettings

__all__ = ["check_budgets_fit"]

_MiB: Final = 1024**2


def check_budgets_fit(
    settings: CacheSettings, device: Device, how_to_change: Callable[[str], str] | None = None
) -> None:
    """Raise SettingsError when the GPU tier's budget exceeds the device's whole memory or
    the host tier's the machine's, naming what to lower: how_to_change(field), by default
    the variable or keyword the budget came from (settings.how_to_change).

    Neither tier takes its memory up front, so such a budget would otherwise fail only once
    the tier had filled the machine.
    """
    how = settings.how_to_change if how_to_change is None else how_to_change
    problems = []
    total = device.memory_bytes
    if total is not None and settings.gpu_cache_bytes > total:
        problems.append(
            f"a GPU tier of {settings.gpu_cache_mb:g} MB exceeds the memory of {device.name} "
            f"({total / _MiB:.1f} MB); lower {how('gpu_cache_mb')}"
        )
    ram = host_memory_bytes()
    if ram is not None and settings.cpu_cache_bytes > ram:
        problems.append(
            f"a host tier of {settings.cpu_cache_mb:g} MB exceeds this machine's memory "
            f"({ram / _MiB:.1f} MB); lower {how('cpu_cache_mb')}"
        )
    if problems:
        raise SettingsError("\n".join(problems))

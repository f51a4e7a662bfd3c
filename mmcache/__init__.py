"""mmcache: an asyncio tiered GPU -> pinned-host cache of multimodal features."""

from __future__ import annotations

from mmcache.cache import FeatureCache
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    CopyTimeoutError,
    DeviceOutOfMemoryError,
    FeatureMismatchError,
    GroupError,
    InvalidHandleError,
    InvalidKeyError,
    InvalidRowsError,
    InvalidValueError,
    MMCacheError,
    ReentrantComputeError,
    SettingsError,
    ValueTooLargeError,
    WrongLoopError,
)
from mmcache.settings import CacheSettings
from mmcache.stats import CacheStats

__version__ = "0.1.0"

__all__ = [
    "CacheClosedError",
    "CacheSettings",
    "CacheStats",
    "CopyFailedError",
    "CopyTimeoutError",
    "DeviceOutOfMemoryError",
    "FeatureCache",
    "FeatureMismatchError",
    "GroupError",
    "InvalidHandleError",
    "InvalidKeyError",
    "InvalidRowsError",
    "InvalidValueError",
    "MMCacheError",
    "ReentrantComputeError",
    "SettingsError",
    "ValueTooLargeError",
    "WrongLoopError",
    "__version__",
]

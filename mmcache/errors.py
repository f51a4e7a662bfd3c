"""The exception hierarchy: every error mmcache raises derives from MMCacheError."""

from __future__ import annotations


class MMCacheError(Exception):
    """Base class of every error raised by mmcache."""


class SettingsError(MMCacheError, ValueError):
    """A setting (usually an environment variable) has an invalid value."""


class CacheClosedError(MMCacheError, RuntimeError):
    """The cache (or transport) was used after close() or before start()."""


class InvalidKeyError(MMCacheError, TypeError):
    """A key is not hashable or not of a supported type."""


class InvalidValueError(MMCacheError, TypeError):
    """A value is not a tensor the cache can hold (wrong type, device or size)."""


class ValueTooLargeError(MMCacheError, ValueError):
    """A value is larger than the whole tier it targets."""


class CopyFailedError(MMCacheError, RuntimeError):
    """A device copy failed; the data it was moving is not available."""


class DeviceOutOfMemoryError(MMCacheError, MemoryError):
    """The device could not allocate memory for a copy."""


class WrongLoopError(MMCacheError, RuntimeError):
    """The cache was called from a thread or event loop other than the one it runs on."""


class InvalidRowsError(MMCacheError, IndexError):
    """A rows= slice is not a contiguous range inside the feature."""


class CopyTimeoutError(CopyFailedError):
    """A device copy did not complete within copy_timeout_s; its memory is quarantined."""


class FeatureMismatchError(MMCacheError, ValueError):
    """A cached feature's shape or dtype is not what the caller expects."""


class ReentrantComputeError(MMCacheError, RuntimeError):
    """A get_or_compute fn waited, directly or through a task it started, for its own key."""


class GroupError(MMCacheError, RuntimeError):
    """A collective of the cache's process group failed or timed out (a peer died or hung),
    or the group's ranks called it with different keys."""


class IPCError(MMCacheError):
    """Base class of the errors of the IPC transport (mmcache.ipc)."""


class InvalidHandleError(IPCError, ValueError):
    """An IPC handle is malformed, altered, or names memory its sender did not publish."""

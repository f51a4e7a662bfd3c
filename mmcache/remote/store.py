"""RemoteStore: what the cache needs of a shared store of feature values."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mmcache.errors import MMCacheError

__all__ = ["RemoteStore", "WrongTypeError"]


class WrongTypeError(MMCacheError):
    """The key holds something other than a byte string (Redis: WRONGTYPE, a value of
    another type): a fault of that key, not of the server."""


@runtime_checkable
class RemoteStore(Protocol):
    """A shared key -> bytes store the cache reads on local misses and writes in the background.

    Values are opaque bytes (a header and a payload, mmcache.remote.codec); keys are the
    server-side keys of FeatureCache.remote_key(). Every method raises the backend's own
    errors on a fault (connection lost, timeout); the remote tier counts and absorbs them.
    The caller bounds each call in time (the remote tier: by the bytes it moves).
    """

    async def size(self, key: bytes) -> int:
        """The length in bytes of the value stored under key (0 if there is none);
        WrongTypeError if key holds something else."""
        ...

    async def get(self, key: bytes) -> bytes | None:
        """The value stored under key, or None if there is none; WrongTypeError if key
        holds something else."""
        ...

    async def put(self, key: bytes, value: bytes | memoryview, ttl_s: float | None) -> None:
        """Store value under key, replacing any; it expires after ttl_s seconds (None: never)."""
        ...

    async def exists(self, key: bytes) -> bool:
        """Whether a value is stored under key."""
        ...

    async def delete(self, key: bytes, only_if: bytes | None = None) -> None:
        """Remove key's value (or whatever key holds), if any; with only_if, only while the
        value is still those bytes (a rejected value is deleted, never a good one written
        since)."""
        ...

    async def close(self) -> None:
        """Close the connections; the store is not used afterwards."""
        ...

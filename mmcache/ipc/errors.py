"""Errors of the IPC transport: each says what went wrong and what to do about it."""

from __future__ import annotations

from mmcache.errors import InvalidHandleError, IPCError

__all__ = [
    "HandleExpiredError",
    "IPCError",
    "InvalidHandleError",
    "NoPeerAccessError",
    "SenderGoneError",
    "SharedMemoryFullError",
    "TooManyReceiversError",
    "TransportFullError",
    "UnknownSenderError",
]


class TransportFullError(IPCError, RuntimeError):
    """Neither the IPC pool nor the host fallback had room, and send could not wait (longer)."""


class SharedMemoryFullError(IPCError, MemoryError):
    """The shared-memory filesystem (/dev/shm) has no room for the transport's memory."""


class HandleExpiredError(InvalidHandleError, LookupError):
    """A handle names a slice that was already recycled (received twice, or after a reclaim)."""


class SenderGoneError(IPCError, ConnectionError):
    """The sender of a handle closed or exited before its data was ready."""


class NoPeerAccessError(IPCError, RuntimeError):
    """This receiver's device cannot read the sender's device memory."""


class TooManyReceiversError(IPCError, RuntimeError):
    """Every receiver lane of a sender is taken."""


class UnknownSenderError(SenderGoneError, InvalidHandleError):
    """A handle names a sender whose control block does not exist: it closed or exited,
    or the handle was altered."""

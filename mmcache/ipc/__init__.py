"""Cross-process transport of features: a device IPC pool with a shared host fallback."""

from __future__ import annotations

from mmcache.ipc.errors import (
    HandleExpiredError,
    InvalidHandleError,
    IPCError,
    NoPeerAccessError,
    SenderGoneError,
    SharedMemoryFullError,
    TooManyReceiversError,
    TransportFullError,
    UnknownSenderError,
)
from mmcache.ipc.handle import FeatureBatch, FeatureHandle, SenderEndpoint
from mmcache.ipc.receiver import FeatureReceiver
from mmcache.ipc.sender import FeatureSender
from mmcache.ipc.stats import TransportStats

__all__ = [
    "FeatureBatch",
    "FeatureHandle",
    "FeatureReceiver",
    "FeatureSender",
    "HandleExpiredError",
    "IPCError",
    "InvalidHandleError",
    "NoPeerAccessError",
    "SenderEndpoint",
    "SenderGoneError",
    "SharedMemoryFullError",
    "TooManyReceiversError",
    "TransportFullError",
    "TransportStats",
    "UnknownSenderError",
]

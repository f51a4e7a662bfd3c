"""Adapters that put mmcache where serving engines look for their multimodal caches.

Each engine's adapter is a module of its own (`mmcache.integrations.sglang`), imported
only by those who use that engine: importing this package imports no engine.
"""

from __future__ import annotations

from mmcache.errors import MMCacheError

__all__ = ["IntegrationError"]


class IntegrationError(MMCacheError, RuntimeError):
    """The serving engine is missing, or is a version whose seam the adapter does not fit."""

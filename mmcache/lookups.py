"""Lookups: reads of keys in this cache alone, its local tiers first, then the remote one.

With a group, these are what each rank reads before the ranks agree on the hits
(agreement.py), and get_many's read without one; get's own path inlines `read_one`
(a call fewer on every get).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import final

import torch

from mmcache.core.tiers import Tiers
from mmcache.core.turn_reads import each_position
from mmcache.device import Stream
from mmcache.remote.tier import RemoteTier

__all__ = ["Lookups"]


@final
class Lookups:
    """get's and get_many's reads of this cache's tiers, the remote one asked last."""

    __slots__ = ("_batch_reads", "_counters", "_entries", "_reads", "_remote")

    def __init__(self, core: Tiers, remote: RemoteTier | None) -> None:
        self._entries = core.index
        self._counters = core.counters
        self._reads = core.reads
        self._batch_reads = core.batch_reads
        self._remote = remote

    async def read_one(
        self, key: Hashable, rows: slice | None, to_host: bool, stream: Stream
    ) -> list[torch.Tensor | None]:
        """get's read of key (a list of one, as the agreement takes it)."""
        found = self._entries.get(key)
        if found is None:
            if self._remote is not None:
                found = await self._remote.fetch(key)
            if found is None:
                self._counters.miss()
                return [None]
        return [await self._reads.serve(found, rows, to_host, stream)]

    async def read_many(
        self, batch: list[Hashable], to_host: bool, stream: Stream
    ) -> list[torch.Tensor | None]:
        """get_many's reads of batch: a list, None per miss (a key given twice is read
        and counted once)."""
        if to_host:
            unique = list(dict.fromkeys(batch))
            out = [(await self.read_one(key, None, True, stream))[0] for key in unique]
            return out if len(unique) == len(batch) else each_position(batch, unique, out)
        if self._remote is not None:  # what both local tiers miss, asked of the shared one
            await self._remote.fetch_missing(batch)
        return await self._batch_reads.get_many(batch, stream)

"""GroupLookups: a cache's get, get_many and get_or_compute with a group, as collectives.

Each call takes its place in the agreement's order when it is called, with no await
before: one that awaited first (the cache's start, say) would let a later call overtake
it on this rank and pair it with another call on the others. A call whose arguments this
rank refuses still takes its place (every rank then fails it, and later calls pair).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, TypeVar, final

import torch

from mmcache.agreement import Agreement, refused
from mmcache.compute_on_miss import ComputeFn, ComputeOnMiss
from mmcache.core.entry import check_key, key_list
from mmcache.core.reads import Reads
from mmcache.device import Stream
from mmcache.lifecycle import Lifecycle
from mmcache.lookups import Lookups

__all__ = ["GroupLookups"]

_T = TypeVar("_T")
_N = TypeVar("_N")
#: a group lookup's read of this rank's cache
Read = Callable[[], Awaitable[list[_T]]]


@final
class GroupLookups:
    """The group's lookups of one cache: this rank's reads, agreed on with the others."""

    __slots__ = ("_agreement", "_life", "_lookups", "_on_miss", "_reads")

    def __init__(
        self,
        life: Lifecycle,
        agreement: Agreement,
        lookups: Lookups,
        reads: Reads,
        on_miss: ComputeOnMiss,
    ) -> None:
        self._life = life
        self._agreement = agreement
        self._lookups = lookups
        self._reads = reads
        self._on_miss = on_miss

    async def get(
        self, key: Hashable, device: str | torch.device | None, rows: slice | None, stream: Stream
    ) -> torch.Tensor | None:
        """FeatureCache.get with a group."""
        start = self._start()
        to_host = await self._key_checks("get", key, device, start)
        read = functools.partial(self._lookups.read_one, key, rows, to_host, stream)
        return (await self._agreement.agree("get", (key,), start(read)))[0]

    async def get_many(
        self, keys: Iterable[Hashable], device: str | torch.device | None, stream: Stream
    ) -> list[torch.Tensor | None]:
        """FeatureCache.get_many with a group."""
        start = self._start()
        try:
            batch = key_list(keys, "get_many")
            to_host = False if device is None else self._reads.wants_host(device)
        except Exception as exc:  # every rank fails this call, and later calls pair
            await self._agreement.refuse("get_many", start(refused(exc)))
        read = functools.partial(self._lookups.read_many, batch, to_host, stream)
        return await self._agreement.agree("get_many", batch, start(read))

    async def get_or_compute(
        self,
        key: Hashable,
        fn: ComputeFn,
        device: str | torch.device | None,
        rows: slice | None,
        stream: Stream,
    ) -> torch.Tensor:
        """FeatureCache.get_or_compute with a group: fn runs on every rank or on none."""
        start = self._start()
        to_host = await self._key_checks("get_or_compute", key, device, start)
        read = functools.partial(self._lookups.read_one, key, rows, to_host, stream)
        return await self._on_miss.agreed(
            self._agreement, key, fn, start(read), device, rows, stream
        )

    async def get_noting(
        self, key: Hashable, stream: Stream, note: Callable[[], _N]
    ) -> tuple[torch.Tensor | None, _N]:
        """get(key), and note() taken in the same step as this rank's read of key, inside
        the agreement: what a caller keeps beside the value (the SGLang adapter's shell of
        it) is then the read value's, whatever changes meanwhile."""
        start = self._start()
        try:
            check_key(key)
        except Exception as exc:  # every rank fails this call, and later calls pair
            await self._agreement.refuse("get", start(refused(exc)))
        noted: list[_N] = []

        async def read() -> list[torch.Tensor | None]:
            noted.append(note())  # then read_one looks key up with no await in between
            return await self._lookups.read_one(key, None, False, stream)

        found = await self._agreement.agree("get", (key,), start(read))
        return found[0], noted[0]

    async def _key_checks(
        self,
        call: str,
        key: Hashable,
        device: str | torch.device | None,
        start: Callable[[Read[Any]], Read[Any]],
    ) -> bool:
        """A lookup's key and device checked: whether it reads to the host. Where this rank
        refuses them, it still takes part in the call, then raises."""
        try:
            to_host = False if device is None else self._reads.wants_host(device)
            check_key(key)
        except Exception as exc:
            await self._agreement.refuse(call, start(refused(exc)))
        return to_host

    def _start(self) -> Callable[[Read[_T]], Read[_T]]:
        """What a lookup wraps its read in: the read, or where the cache is not started
        yet, its start then the read, both inside the agreement. Raises at once where the
        cache is closed or belongs to another loop."""
        if self._life.serving is asyncio.get_running_loop() or not self._life.must_start():
            return _as_is
        return functools.partial(_after, self._life.start)


def _as_is(read: Read[_T]) -> Read[_T]:
    return read


def _after(start: Callable[[], Awaitable[None]], read: Read[_T]) -> Read[_T]:
    async def started_then_read() -> list[_T]:
        await start()
        return await read()

    return started_then_read

"""ComputeOnMiss: what get_or_compute does on a miss.

The value's function runs once for every concurrent caller of its key (a SingleFlight
task, which a cancelled caller does not cancel); its result is checked, put with the
seconds the function took (eviction_policy="cost" weighs them), and served to each
caller as get serves a hit: a fresh alias ordered on the caller's stream, or a host copy.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import TYPE_CHECKING, Any, Protocol, final

import torch

from mmcache.core.entry import row_range
from mmcache.device import Device, Fence, Stream
from mmcache.errors import InvalidValueError
from mmcache.layouts import check_strided
from mmcache.single_flight import SingleFlight

if TYPE_CHECKING:
    from mmcache.agreement import Agreement
    from mmcache.core.reads import Reads

__all__ = ["ComputeFn", "ComputeOnMiss"]

ComputeFn = Callable[[], "torch.Tensor | Awaitable[torch.Tensor]"]
#: a computation's value and the fence of its producer's stream
Computed = tuple[torch.Tensor, Fence]


class PutFn(Protocol):
    """FeatureCache.put, as a computation calls it."""

    def __call__(
        self, key: Hashable, value: torch.Tensor, *, stream: Stream | None, cost: float | None
    ) -> Coroutine[Any, Any, bool]: ...


@final
class ComputeOnMiss:
    """Computes a missed key's value once for all its callers, caches it and serves it."""

    __slots__ = ("_device", "_inflight", "_put", "_reads")

    def __init__(
        self,
        inflight: SingleFlight[tuple[torch.Tensor, Fence]],
        *,
        device: Device,
        reads: Reads,
        put: PutFn,
    ) -> None:
        self._inflight = inflight
        self._device = device
        self._reads = reads
        self._put = put

    async def compute(
        self,
        key: Hashable,
        fn: ComputeFn,
        device: str | torch.device | None,
        rows: slice | None,
        stream: Stream,
    ) -> torch.Tensor:
        """key's value from fn (computed once for all concurrent callers), as get returns it."""
        task = self._inflight.run(key, functools.partial(self._compute, key, fn, stream))
        return await self._served(task, device, rows, stream)

    async def agreed(
        self,
        agreement: Agreement,
        key: Hashable,
        fn: ComputeFn,
        read: Callable[[], Awaitable[list[torch.Tensor | None]]],
        device: str | torch.device | None,
        rows: slice | None,
        stream: Stream,
    ) -> torch.Tensor:
        """get_or_compute with a group: read() (this rank's get of key) agreed by the ranks.

        A computation of key running here counts as this rank's hit, joined where every
        rank hit: the ranks then decide alike, whoever's computation has finished. An
        agreed miss starts a new computation (one running here is not joined: another
        rank's failed or was evicted), inside the agreement's shielded part, so that it
        starts on every rank, a caller cancelled meanwhile or not.
        """

        async def read_or_join() -> list[torch.Tensor | asyncio.Task[Computed] | None]:
            found: list[torch.Tensor | asyncio.Task[Computed] | None] = [*await read()]
            if found[0] is None:
                found[0] = self._inflight.joinable(key)
            return found

        def then(
            found: list[torch.Tensor | asyncio.Task[Computed] | None],
        ) -> torch.Tensor | asyncio.Task[Computed]:
            got = found[0]
            if got is not None:
                return got
            return self._inflight.start(key, functools.partial(self._compute, key, fn, stream))

        got = await agreement.agree_then("get_or_compute", (key,), read_or_join, then)
        if isinstance(got, torch.Tensor):
            return got
        return await self._served(got, device, rows, stream)

    async def _served(
        self,
        task: asyncio.Task[Computed],
        device: str | torch.device | None,
        rows: slice | None,
        stream: Stream,
    ) -> torch.Tensor:
        """The computation's value, as get returns it."""
        value, ready = await asyncio.shield(task)
        span = row_range(rows, tuple(value.shape))
        if self._reads.wants_host(device):
            return await self._reads.download(value, ready, span)
        return await self._reads.serve_device(value, ready, span, stream)

    async def _compute(
        self, key: Hashable, fn: ComputeFn, stream: Stream
    ) -> tuple[torch.Tensor, Fence]:
        started = time.perf_counter()
        result = fn()
        value = await result if inspect.isawaitable(result) else result
        seconds = time.perf_counter() - started
        del result
        if not isinstance(value, torch.Tensor):
            raise InvalidValueError(
                f"get_or_compute's fn must return a torch.Tensor, not {type(value).__name__}"
            )
        check_strided(value, "get_or_compute()")
        ready = self._device.record(stream)
        # The caller's alias below keeps the tensor valid whatever the cache does next.
        try:
            await self._put(key, value, stream=stream, cost=seconds)
        except BaseException:
            del value  # a failed put's traceback, kept by every caller, must not keep it
            raise
        return value, ready

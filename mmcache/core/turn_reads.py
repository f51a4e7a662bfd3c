"""TurnReads: the host-tier hits of single gets issued in one loop turn, served together."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import final

import torch

from mmcache.core.batch_reads import BatchReads
from mmcache.core.counters import Counters
from mmcache.core.reads import copy_failure
from mmcache.device import Device, Fence, Stream
from mmcache.errors import CopyTimeoutError

__all__ = ["TurnReads"]

#: one get's future, resolved (to None) once its output is in the list beside it: a
#: finished future may outlive its await (in asyncio's callback tuples), and must not keep
#: the output alive
_Get = tuple[asyncio.Future[None], list[torch.Tensor | None]]

#: calls back on the loop once every fence is done (FenceWatcher.when_done)
WhenDone = Callable[[Sequence[Fence], Callable[[], None]], None]


@final
class _Turn:
    """The gets of one stream in one loop turn: their keys and the futures they await."""

    __slots__ = ("futures", "keys", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.keys: list[Hashable] = []
        self.futures: list[_Get] = []


@final
class TurnReads:
    """Single gets of host-tier hits in one loop iteration, served as one get_many.

    A scheduler's concurrent requests each call get; the host hits among them would
    each pay an allocation, a copy, a fence and a stream wait. Queued here instead,
    they are read at the end of the turn (one callback, never a timer) by
    BatchReads.queue: one lookup pass, one copy batch, one fence, one wait per consumer
    stream. Each get gets its own output, ordered on its own stream. A key is looked up
    again when the turn ends, so what changed meanwhile (a discard, a landing) is seen.
    Where the device cannot order reads on streams (the simulator), one watch on the
    batch's fences serves all its gets, bounded by copy_timeout_s.
    """

    __slots__ = ("_batch", "_counters", "_device", "_timeout", "_turns", "_when_done")

    def __init__(
        self,
        batch: BatchReads,
        device: Device,
        counters: Counters,
        when_done: WhenDone,
        copy_timeout: float,
    ) -> None:
        self._batch = batch
        self._device = device
        self._counters = counters
        self._when_done = when_done
        self._timeout = copy_timeout
        self._turns: dict[int, _Turn] = {}  # id(stream) -> the gets of this turn on it

    async def read(self, key: Hashable, stream: Stream) -> torch.Tensor | None:
        """key's feature on the device, usable on stream, read with the turn's other gets;
        None if it is gone by then."""
        turns = self._turns
        loop = asyncio.get_running_loop()
        if not turns:
            loop.call_soon(self._serve)  # the end of this turn: after the gets queued in it
        turn = turns.get(id(stream))
        if turn is None:
            turn = turns[id(stream)] = _Turn(stream)
        future: asyncio.Future[None] = loop.create_future()
        output: list[torch.Tensor | None] = []
        turn.keys.append(key)
        turn.futures.append((future, output))
        await future
        return output.pop()

    def _serve(self) -> None:
        """Read every get queued this turn: one batch per consumer stream."""
        turns, self._turns = self._turns, {}
        for turn in turns.values():
            keys: list[Hashable] = []
            futures: list[_Get] = []
            for key, get in zip(turn.keys, turn.futures, strict=True):
                if not get[0].cancelled():
                    keys.append(key)
                    futures.append(get)
            turn.futures.clear()
            if futures:
                self._serve_turn(keys, futures, turn.stream)

    def _serve_turn(
        self,
        keys: list[Hashable],
        futures: list[_Get],
        stream: Stream,
    ) -> None:
        """One stream's gets of the turn, read as one batch."""
        failure: Exception | None = None
        if len(keys) > 1:
            repeated = len(keys) - len(set(keys))
            if repeated:  # gets of one key read it once, and each is a lookup (a host hit)
                self._counters.looked_up(0, repeated, 0)
        try:
            out, waits, used = self._batch.queue(keys, stream)
            if self._device.stream_ordered_reads:  # ordered on the stream now, for all
                self._batch.order(waits, used, stream)
                _serve_all(futures, out)
                return
        except Exception as exc:
            failure = exc
        if failure is not None:
            # Each get raises it where it awaits: its traceback (kept by the futures and
            # whoever catches it) must not keep the memory its frames held alive.
            traceback.clear_frames(failure.__traceback__)
            _fail(futures, failure)
            return
        self._serve_after(futures, out, waits, used, stream)

    def _serve_after(
        self,
        futures: list[_Get],
        out: list[torch.Tensor | None],
        waits: list[Fence],
        used: list[torch.Tensor],
        stream: Stream,
    ) -> None:
        """Hand the outputs over once their fences are done (within copy_timeout_s)."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        expiry: list[asyncio.TimerHandle] = []

        def done() -> None:
            if expiry:
                expiry[0].cancel()
            for fence in waits:
                failure = copy_failure(fence)
                if failure is not None:  # made, not raised: no traceback keeps the outputs
                    out.clear()
                    used.clear()
                    _fail(futures, failure)
                    futures.clear()
                    return
            for tensor in used:
                self._device.use_on(tensor, stream)
            waited = time.perf_counter() - started
            for _ in futures:
                self._counters.waited(waited)
            _serve_all(futures, out)
            # Whoever keeps this callback (the watcher, an expired timer) keeps nothing.
            futures.clear()
            out.clear()
            used.clear()

        def expired() -> None:
            self._counters.quarantined()  # the memory stays pinned by the copies
            out.clear()
            used.clear()
            _fail(
                futures,
                CopyTimeoutError(
                    f"a device copy did not complete within {self._timeout:g} s "
                    "(MMCACHE_COPY_TIMEOUT_SEC); its memory is quarantined"
                ),
            )
            futures.clear()

        pending = [fence for fence in dict.fromkeys(waits) if not fence.done()]
        if not pending:
            done()
            return
        expiry.append(loop.call_later(self._timeout, expired))
        self._when_done(pending, done)


def _serve_all(futures: list[_Get], out: list[torch.Tensor | None]) -> None:
    for (future, output), tensor in zip(futures, out, strict=True):
        if not future.done():  # cancelled meanwhile, or timed out
            output.append(tensor)
            future.set_result(None)


def _fail(futures: list[_Get], exc: BaseException) -> None:
    for future, _ in futures:
        if not future.done():
            future.set_exception(exc)

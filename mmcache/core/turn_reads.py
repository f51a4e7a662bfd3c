"""TurnReads: the host-tier hits of single gets, and the get_many calls, issued in one loop
turn, served together."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, final

import torch

from mmcache.core.batch_reads import BatchReads
from mmcache.core.counters import Counters
from mmcache.core.reads import copy_failure
from mmcache.device import Device, Fence, Stream
from mmcache.errors import CopyTimeoutError

__all__ = ["TurnReads", "each_position"]

#: one get's (or get_many's) future, resolved (to None) once its outputs are in the list
#: beside it, and its keys: a finished future may outlive its await (in asyncio's callback
#: tuples), and must not keep the outputs alive
_Get = tuple[asyncio.Future[None], list[torch.Tensor | None], Sequence[Hashable]]


class WhenDone(Protocol):
    """Calls back on the loop once every fence is done (FenceWatcher.when_done); fresh:
    the fences were found pending just now, and are not asked again."""

    def __call__(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = ...
    ) -> None: ...


def each_position(
    keys: Sequence[Hashable], unique: Sequence[Hashable], output: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """The outputs of keys, one per position, from those of its distinct keys (unique, in
    order of first use): a repeat gets an alias of its own."""
    place = dict(zip(unique, range(len(unique)), strict=True))
    out: list[torch.Tensor | None] = []
    seen: set[Hashable] = set()
    for key in keys:
        tensor = output[place[key]]
        if key in seen and tensor is not None:
            tensor = tensor.detach()
        seen.add(key)
        out.append(tensor)
    return out


#: the gets of one stream in one loop turn: the stream, and each get's future, outputs
#: and keys (a tuple, not a class: one made per stream and turn)
_Turn = tuple[Stream, list[_Get]]


@final
class TurnReads:
    """The host-tier hits of single gets and of get_many calls, in one loop iteration,
    served as one batch.

    A scheduler's concurrent requests each call get (or get_many); the host hits among
    them would each pay an allocation, a copy, a fence and a stream wait. Queued here
    instead, they are read at the end of the turn (one callback, never a timer) by
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
        future, output = self._queue((key,), stream)
        await future
        return output.pop()

    async def read_many(self, keys: list[Hashable], stream: Stream) -> list[torch.Tensor | None]:
        """get_many of keys (a key given twice is read once): each feature on the device,
        usable on stream; None for a miss. The resident ones are read at once, the host
        hits with the turn's other reads."""
        unique = list(dict.fromkeys(keys))
        # The resident features are read now, as get reads them; the host hits, if any,
        # with the turn's other reads (one copy batch for all).
        on_host: list[int] = []
        batch = self._batch
        output, waits, used = batch.queue(unique, stream, deferred=on_host)
        try:
            if waits or used:  # a fence pending or failed (none in the common case)
                await batch.wait(waits, used, stream)
            if on_host:
                host_keys: list[Hashable] = []
                for i in on_host:  # a loop, not a comprehension: no frame of its own
                    host_keys.append(unique[i])
                future, uploaded = self._queue(host_keys, stream)
                await future
                for i, tensor in zip(on_host, uploaded, strict=True):
                    output[i] = tensor
        except BaseException:
            # Failed or cancelled: the traceback keeps this frame, which must not keep the
            # features already read alive.
            output.clear()
            raise
        if len(unique) == len(keys):
            return output
        return each_position(keys, unique, output)

    def _queue(
        self, keys: Sequence[Hashable], stream: Stream
    ) -> tuple[asyncio.Future[None], list[torch.Tensor | None]]:
        """A get of keys in this turn's batch on stream: the future it awaits, and the
        list its outputs are put in."""
        turns = self._turns
        loop = asyncio.get_running_loop()
        if not turns:
            loop.call_soon(self._serve)  # the end of this turn: after the gets queued in it
        turn = turns.get(id(stream))
        if turn is None:
            turn = turns[id(stream)] = (stream, [])
        future: asyncio.Future[None] = loop.create_future()
        output: list[torch.Tensor | None] = []
        turn[1].append((future, output, keys))
        return future, output

    def _serve(self) -> None:
        """Read every get queued this turn: one batch per consumer stream."""
        turns, self._turns = self._turns, {}  # gets queued from here on make the next turn
        for stream, queued in turns.values():
            keys: list[Hashable] = []
            gets: list[_Get] = []
            for get in queued:
                if not get[0].cancelled():
                    keys.extend(get[2])
                    gets.append(get)
            queued.clear()
            if gets:
                self._serve_turn(keys, gets, stream)

    def _serve_turn(
        self,
        keys: list[Hashable],
        futures: list[_Get],
        stream: Stream,
    ) -> None:
        """One stream's gets of the turn, read as one batch."""
        failure: Exception | None = None
        blame: dict[Fence, list[Hashable]] = {}
        try:
            # Gets of one key read it once, and each is a lookup.
            out, waits, used = self._batch.queue(keys, stream, count_repeats=True, blame=blame)
            if self._device.stream_ordered_reads:  # ordered on the stream now, for all
                _serve_all(futures, out, self._order(blame, used, stream))
                return
        except Exception as exc:  # no memory for the uploads, say
            failure = exc
        if failure is not None:
            # Each get raises it where it awaits: its traceback (kept by the futures and
            # whoever catches it) must not keep the memory its frames held alive.
            traceback.clear_frames(failure.__traceback__)
            _fail(futures, failure)
            return
        self._serve_after(futures, out, waits, used, stream, blame)

    def _order(
        self, blame: dict[Fence, list[Hashable]], used: list[torch.Tensor], stream: Stream
    ) -> dict[Hashable, Exception] | None:
        """Order the outputs after the fences they wait on, on stream; the keys read behind
        a failed one, with its error (None if none failed)."""
        device = self._device
        bad: dict[Fence, Exception] = {}
        for fence in blame:
            if not fence.done():
                device.wait_on(stream, fence)
            elif (failure := copy_failure(fence)) is not None:
                bad[fence] = failure
        if used:
            device.use_all_on(used, stream)
        return _failures(bad, blame) if bad else None

    def _serve_after(
        self,
        futures: list[_Get],
        out: list[torch.Tensor | None],
        waits: list[Fence],
        used: list[torch.Tensor],
        stream: Stream,
        blame: dict[Fence, list[Hashable]],
    ) -> None:
        """Hand the outputs over once their fences are done (within copy_timeout_s); the
        gets of a key whose copy failed or is overdue raise, the others are served."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        expiry: list[asyncio.TimerHandle] = []

        def done(overdue: Exception | None = None) -> None:
            if expiry:
                expiry[0].cancel()
            if not futures:  # served at expiry; this is the late fence
                return
            bad: dict[Fence, Exception] | None = None
            for fence in waits:
                if overdue is not None and not fence.done():
                    failure: Exception | None = overdue
                elif fence.exception() is None:  # done: asked once, the error made if any
                    continue
                else:  # made, not raised: no traceback keeps the outputs
                    failure = copy_failure(fence)
                if failure is not None:
                    if bad is None:
                        bad = {}
                    bad[fence] = failure
            if used:
                self._device.use_all_on(used, stream)
            waited = time.perf_counter() - started
            for _ in futures:  # one wait per call
                self._counters.waited(waited)
            _serve_all(futures, out, None if bad is None else _failures(bad, blame))
            # Whoever keeps this callback (the watcher, an expired timer) keeps nothing.
            futures.clear()
            out.clear()
            used.clear()
            blame.clear()

        def expired() -> None:
            self._counters.quarantined()  # the memory stays pinned by the copies
            done(
                CopyTimeoutError(
                    f"a device copy did not complete within {self._timeout:g} s "
                    "(MMCACHE_COPY_TIMEOUT_SEC); its memory is quarantined"
                )
            )

        pending: list[Fence] = []
        for fence in waits:
            if fence not in pending and not fence.done():
                pending.append(fence)
        if not pending:
            done()
            return
        expiry.append(loop.call_later(self._timeout, expired))
        self._when_done(pending, done, fresh=True)  # asked just now: not asked again


def _failures(
    bad: dict[Fence, Exception], blame: dict[Fence, list[Hashable]]
) -> dict[Hashable, Exception]:
    """Each key read behind a bad fence, and the error its callers raise."""
    failed: dict[Hashable, Exception] = {}
    for fence, failure in bad.items():
        for key in blame[fence]:
            failed.setdefault(key, failure)
    return failed


def _serve_all(
    futures: list[_Get],
    out: list[torch.Tensor | None],
    failed: dict[Hashable, Exception] | None = None,
) -> None:
    """Each get's outputs into its list; a get that read a key in failed raises instead."""
    at = 0
    for future, output, keys in futures:
        end = at + len(keys)
        if not future.done():  # cancelled meanwhile, or timed out
            failure = None
            if failed is not None:
                failure = next((failed[key] for key in keys if key in failed), None)
            if failure is None:
                output.extend(out[at:end])
                future.set_result(None)
            else:
                future.set_exception(failure)
        at = end


def _fail(futures: list[_Get], exc: BaseException) -> None:
    for future, _, _ in futures:
        if not future.done():
            future.set_exception(exc)

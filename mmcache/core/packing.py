"""Packing: put_many's groups of small features, and the values their packing copies read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Final, final

import torch

from mmcache.core.entry import Entry
from mmcache.device.base import Fence
from mmcache.errors import CopyFailedError, CopyTimeoutError
from mmcache.waiting import wait_fences

__all__ = ["BATCH_BYTES", "GROUP_BELOW", "LARGE_BATCH_BYTES", "Packings", "group_spans", "runs"]

MiB: Final = 1024 * 1024
#: the bytes one batched offload copy (or one group) moves at most
BATCH_BYTES: Final = 8 * MiB
#: Offloads of features too large to batch by BATCH_BYTES, made ahead of need, go in
#: batches of up to this many bytes (and up to half the tier's evict_ahead, see
#: Evictor.evict_for): one copy call, fence and landing per batch.
LARGE_BATCH_BYTES: Final = 32 * MiB
#: put_many packs features below this size into groups; larger ones keep the per-feature
#: batched offload, which was faster for them (BENCHMARKS.md)
GROUP_BELOW: Final = 512 * 1024
_CHECK_S: Final = 0.002  # how soon an idle loop lets go of the values of finished packings


@final
@dataclass(slots=True, eq=False)
class _Packing:
    """A group's packing copy and the values it reads (group None: a put gave up)."""

    fence: Fence
    values: list[torch.Tensor]
    group: Entry | None
    watched: bool = False  # a fence callback will look again (the loop went idle)


@final
class Packings:
    """Packing copies of put_many groups not seen done yet, holding the values they read.

    The loop looks at them itself (at the next put_many, or once a little later): a
    fence callback for each would cost a hand-over of the GIL from the waiter thread per
    group. Only those still running then get a callback, so nothing polls.
    """

    __slots__ = ("_check_ready", "_closed", "_loop", "_running", "_timer", "_when_done")

    def __init__(
        self,
        when_done: Callable[[Sequence[Fence], Callable[[], None]], None],
        check_ready: Callable[[Entry, Fence], None],
    ) -> None:
        self._when_done = when_done
        self._check_ready = check_ready  # drops a group whose packing copy failed
        self._running: list[_Packing] = []
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def __bool__(self) -> bool:
        return bool(self._running)

    @property
    def polling(self) -> bool:
        """Whether a packing still running has neither the loop's timer nor a callback."""
        return self._timer is not None or not all(p.watched for p in self._running)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arm timers on loop from now on."""
        self._loop = loop

    def hold(self, fence: Fence, values: list[torch.Tensor], group: Entry | None) -> None:
        """Keep a group's values until its packing copy (fence) has read them."""
        self._running.append(_Packing(fence, values, group))
        if self._timer is None and not self._closed:
            assert self._loop is not None
            self._timer = self._loop.call_later(_CHECK_S, self._second_look)

    def _second_look(self) -> None:
        """The loop's second look: packings still running get a fence callback each."""
        self._timer = None
        self.reap()
        for packing in self._running:
            if not packing.watched:
                packing.watched = True
                self._when_done([packing.fence], self.reap)

    def reap(self) -> None:
        """Let go of the values of finished packing copies; drop groups whose copy failed.

        Every record is looked at: packings on different streams finish in any order.
        (Each one still running is covered: by the timer its put armed, or by a callback.)
        """
        running = []
        for packing in self._running:
            if not packing.fence.done():
                running.append(packing)
            elif packing.group is not None:
                self._check_ready(packing.group, packing.fence)
        self._running = running

    async def wait_all(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Wait for every packing copy queued so far, then let go of their values.

        Raises CopyTimeoutError if one is not done within timeout (it keeps its values).
        """
        while self._running:
            fences = [packing.fence for packing in self._running]
            try:
                await wait_fences(fences, timeout)
            except CopyTimeoutError:
                raise
            except CopyFailedError:
                pass  # its group is dropped below
            self.reap()

    def close(self) -> None:
        """Arm no more timers (the cache is closing), and cancel the one armed."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def group_spans(
    items: Sequence[tuple[Hashable, torch.Tensor]],
    sizes: Sequence[int],
    small_bytes: int,
    host_limit: int,
) -> list[tuple[int, int]]:
    """put_many's units: runs of small features of one dtype and row shape, up to
    BATCH_BYTES a run (and what one host block can take); others alone.
    """
    cap = min(BATCH_BYTES, host_limit) if host_limit else BATCH_BYTES
    # A scalar has no rows to stack: never in a group.
    kinds = [
        (t.dtype, t.shape[1:]) if n < small_bytes and t.dim() else None
        for (_, t), n in zip(items, sizes, strict=True)
    ]
    return runs(sizes, kinds, cap)


def runs(
    sizes: Sequence[int], kinds: Sequence[object | None] | None, cap: int
) -> list[tuple[int, int]]:
    """Index ranges of features to cache together: runs of alike ones (the same kind, not
    None; all alike when kinds is None) up to cap bytes a run; others alone.

    A group is one tensor on the device, so its features need no copy of their own when
    offloaded, nor entry, recency slot, host block or landing of their own.
    """
    spans = []
    first = 0
    run_bytes = 0
    kind: object | None = None
    for i, nbytes in enumerate(sizes):
        mine = True if kinds is None else kinds[i]
        if mine is None or mine != kind or run_bytes + nbytes > cap:
            if i > first:
                spans.append((first, i))
            first = i
            run_bytes = 0
        kind = mine
        run_bytes += nbytes
    spans.append((first, len(sizes)))
    return spans

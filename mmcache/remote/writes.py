"""WriteQueue: remote writes waiting to be sent, bounded in bytes, sent by one task in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import final

import torch

from mmcache.device import Fence

__all__ = ["Write", "WriteQueue"]


@final
@dataclass(slots=True, eq=False)
class Write:
    """One value to write: a host copy (readable once fence is done) under a server key."""

    key: bytes
    tensor: torch.Tensor
    fence: Fence | None
    nbytes: int


@final
class WriteQueue:
    """Writes queued for the server, at most limit bytes of them; the rest are refused.

    Nothing waits for room: a put never blocks on the network, so a write that does
    not fit is dropped (the caller counts it). The queue's bytes are host copies that
    only it holds, released as each write is sent or dropped.
    """

    def __init__(
        self,
        send: Callable[[Write], Awaitable[None]],
        limit: int,
        *,
        queued: Callable[[int], None],
    ) -> None:
        self._send = send  # never raises but for cancellation: it counts its own faults
        self._limit = limit
        self._queued = queued  # reports the bytes queued
        self._writes: deque[Write] = deque()
        self._task: asyncio.Task[None] | None = None
        #: bytes of the writes queued and of the one being sent
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._writes) + (self._task is not None)

    def fits(self, nbytes: int) -> bool:
        """Whether a write of nbytes would be taken now."""
        return self.nbytes + nbytes <= self._limit

    def offer(self, write: Write) -> bool:
        """Queue write if it fits under the limit; False (nothing kept) if it does not."""
        if not self.fits(write.nbytes):
            return False
        self._writes.append(write)
        self.nbytes += write.nbytes
        self._queued(self.nbytes)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def drain(self) -> None:
        """Wait until every write queued so far has been sent (or failed or dropped, counted)."""
        while (task := self._task) is not None:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not task.cancelled() or (current is not None and current.cancelling()):
                    raise
                return  # close() stopped the writes: what is left is dropped, not this caller

    async def close(self, timeout: float) -> list[Write]:  # noqa: ASYNC109
        """Send what is queued for up to timeout s, then stop; the writes left unsent."""
        task = self._task
        if task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        left = list(self._writes)
        self._writes.clear()
        self.nbytes = 0
        self._queued(0)
        return left

    async def _run(self) -> None:
        writes = self._writes
        try:
            while writes:
                write = writes[0]
                try:
                    await self._send(write)
                finally:
                    # Cancelled (close) or sent: either way this write is over.
                    if writes and writes[0] is write:
                        writes.popleft()
                        self.nbytes -= write.nbytes
                        self._queued(self.nbytes)
                del write  # its host copy goes now, not with the next one
        finally:
            self._task = None

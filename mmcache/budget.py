"""FifoBudget: callers waiting for room, served first come first served."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, TypeVar, final

__all__ = ["BudgetWaiter", "FifoBudget"]

_W = TypeVar("_W")
_G = TypeVar("_G")


@final
@dataclass(slots=True, eq=False)
class BudgetWaiter(Generic[_W, _G]):
    """One caller in line: what it wants, and the future its grant is set on."""

    want: _W
    future: asyncio.Future[_G]


@final
class FifoBudget(Generic[_W, _G]):
    """A line of callers waiting for room; the head is granted first, and only the head.

    It owns the line, not the room: take(want) grants from the owner's ledger (None:
    not now) and give_back(grant) returns what a caller that gave up was granted. The
    cache's GPU tier and the IPC sender's pool both wait through one.
    """

    __slots__ = ("_give_back", "_take", "_waiters", "line")

    def __init__(self, take: Callable[[_W], _G | None], give_back: Callable[[_G], None]) -> None:
        self._take = take
        self._give_back = give_back
        self._waiters: deque[BudgetWaiter[_W, _G]] = deque()
        #: the waiters in order (read-only): truthy while any waits, for a caller that asks
        #: on its hot path without a call
        self.line: Collection[object] = self._waiters

    def __bool__(self) -> bool:
        return bool(self._waiters)

    def __len__(self) -> int:
        return len(self._waiters)

    def wanted(self) -> list[_W]:
        """What each caller in line waits for, in order."""
        return [w.want for w in self._waiters if not w.future.done()]

    def join(self, want: _W) -> BudgetWaiter[_W, _G]:
        """Put a caller at the end of the line (it then awaits wait())."""
        waiter = BudgetWaiter(want, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        return waiter

    async def wait(self, waiter: BudgetWaiter[_W, _G]) -> _G:
        """Wait for waiter's grant; a caller cancelled (or timed out) leaves the line.

        A grant that came just as the caller gave up goes back through give_back.
        """
        try:
            return await waiter.future
        except BaseException:
            self.leave(waiter)
            raise

    def leave(self, waiter: BudgetWaiter[_W, _G]) -> None:
        """Take waiter out of the line, giving back what it was granted and never used."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        future = waiter.future
        if future.done():
            if not future.cancelled() and future.exception() is None:
                self._give_back(future.result())
        else:
            future.cancel()

    def grant(self) -> None:
        """Grant callers in arrival order while the owner's take() has room for the head."""
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.future.done():
                waiters.popleft()
                continue
            granted = self._take(head.want)
            if granted is None:
                return
            waiters.popleft()
            head.future.set_result(granted)

    def fail_if(self, hopeless: Callable[[_W], bool], error: Callable[[], BaseException]) -> None:
        """Raise error() in every caller in line whose want is hopeless (the owner says no
        grant can ever come); the others keep their places."""
        for waiter in list(self._waiters):
            if not waiter.future.done() and hopeless(waiter.want):
                self._waiters.remove(waiter)
                waiter.future.set_exception(error())

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Raise error() in every caller in line (the owner is closing)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(error())

"""Closing asynchronous resources: the work once, in a task every close() awaits; blocking
calls on a thread of their own; every release step run even when one fails.

A close() that awaits (copies to land, receivers to let go) can have its caller cancelled
half-way. Run in the caller's own task, the rest of the close would never happen: the
memory it frees stays pinned or mapped, and a second close() returns at once, before the
first one's work is done. So the work runs in a task of its own, started by the first
close(), and every close() (an `async with` exit too) waits for it, shielded from its own
caller's cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar, cast

__all__ = ["CloseOnce", "off_the_loop", "run_each"]

log = logging.getLogger("mmcache")

T = TypeVar("T")


class CloseOnce:
    """The work of one object's close(), run once.

    If the work itself is cancelled (the loop shutting down cancels every task), later
    callers return, with a warning, when the work leaves nothing behind that way
    (cleans_up_when_cancelled: its releases go on without it); else they get the
    CancelledError, since the close did not finish and cannot be run again.
    """

    __slots__ = ("_cleans_up_when_cancelled", "_task")

    def __init__(self, *, cleans_up_when_cancelled: bool = False) -> None:
        self._task: asyncio.Future[None] | None = None
        self._cleans_up_when_cancelled = cleans_up_when_cancelled

    @property
    def begun(self) -> bool:
        return self._task is not None

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start work() unless a close began already; wait until it has finished (raising
        its error, for every caller)."""
        if self._task is None:
            self._task = asyncio.ensure_future(work())
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if (
                not self._cleans_up_when_cancelled
                or not self._task.cancelled()
                or (caller is not None and caller.cancelling())
            ):
                raise  # our caller was cancelled, or the close stopped half-way
            log.warning("a close() was cancelled before it finished; its releases go on")


async def off_the_loop(
    fn: Callable[[], T], abandoned: Callable[[T], None] | None = None, name: str = "mmcache-close"
) -> T:
    """Run fn on a thread of its own and wait for its result without holding the loop.

    A result nobody takes (the awaiting task was cancelled, or the loop closed) goes to
    abandoned, on whichever thread finds it so. Not the loop's default executor:
    `asyncio.run` shuts that down before the last `async with` may exit, and a busy one
    would make fn wait its turn.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def give_up(value: T | None, error: BaseException | None) -> None:
        if error is not None:
            log.error("work on a thread of its own failed, and nobody awaits it: %r", error)
        elif abandoned is not None:
            abandoned(cast(T, value))

    def report(value: T | None, error: BaseException | None) -> None:
        if done.done():  # its awaiting task was cancelled
            give_up(value, error)
        elif error is None:
            done.set_result(cast(T, value))
        else:
            done.set_exception(error)

    def run() -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = fn()
        except BaseException as e:  # reported to the awaiting task
            error = e
        try:
            loop.call_soon_threadsafe(report, value, error)
        except RuntimeError:  # the loop closed meanwhile
            give_up(value, error)

    # Not a daemon: an interpreter that exits meanwhile waits for fn to finish.
    threading.Thread(target=run, name=name).start()
    try:
        return await done
    except asyncio.CancelledError:
        if done.done() and not done.cancelled() and done.exception() is None:
            give_up(done.result(), None)  # handed over just as we were cancelled
        raise


def run_each(steps: Iterable[Callable[[], object]]) -> None:
    """Run every step, also after one raised (a failed unlink must not leave memory pinned);
    then raise the first error, logging the others."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # raised below, once every step has run
            if first is None:
                first = e
            else:
                log.warning("another release step failed as well: %r", e)
    if first is not None:
        raise first

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
from typing import Any

__all__ = ["CloseOnce", "off_the_loop", "run_each"]

log = logging.getLogger("mmcache")


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


async def off_the_loop(fn: Callable[[], object]) -> None:
    """Run fn on a thread of its own and wait for it without holding the loop.

    Not the loop's default executor: `asyncio.run` shuts that down before the last
    `async with` may exit, and a busy one would make fn wait its turn.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def report(error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        elif error is not None:  # its awaiting task was cancelled: nobody else will see it
            log.error("closing on a thread of its own failed: %r", error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as e:  # reported to the awaiting task
            error = e
        try:
            loop.call_soon_threadsafe(report, error)
        except RuntimeError:  # the loop closed meanwhile: nobody awaits the result
            if error is not None:
                log.error("closing after the event loop closed failed: %r", error)

    # Not a daemon: an interpreter that exits meanwhile waits for fn to finish.
    threading.Thread(target=run, name="mmcache-close").start()
    await done


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

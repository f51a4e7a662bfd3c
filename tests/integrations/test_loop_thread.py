"""LoopThread: synchronous calls into an event loop on a thread of its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mmcache import CacheClosedError, WrongLoopError
from mmcache.integrations.loop_thread import LoopThread


async def plain(value: int) -> int:
    return value


async def suspends(value: int) -> int:
    await asyncio.sleep(0.001)
    await asyncio.sleep(0)
    return value


async def fails_at_once() -> int:
    raise KeyError("at once")


async def fails_later() -> int:
    await asyncio.sleep(0.001)
    raise KeyError("later")


async def needs_a_task() -> bool:
    await asyncio.sleep(0)
    return asyncio.current_task() is not None


@pytest.mark.parametrize("eager", [False, True])
def test_results_and_errors_come_back_to_the_caller(eager: bool) -> None:
    runner = LoopThread("test-loop")
    try:
        assert runner.run(plain(1), eager=eager) == 1
        assert runner.run(suspends(2), eager=eager) == 2  # eager: resumed in a task
        assert runner.run(needs_a_task(), eager=eager)
        with pytest.raises(KeyError, match="at once"):
            runner.run(fails_at_once(), eager=eager)
        with pytest.raises(KeyError, match="later"):
            runner.run(fails_later(), eager=eager)
    finally:
        runner.stop()


def test_calls_from_its_own_thread_and_after_stop_are_refused() -> None:
    runner = LoopThread("test-loop")
    inner: list[BaseException] = []

    async def call_in() -> None:
        try:
            runner.run(plain(1))
        except WrongLoopError as exc:
            inner.append(exc)

    runner.run(call_in())
    assert inner
    runner.stop()
    runner.stop()
    assert not runner.alive
    assert "test-loop" not in {t.name for t in threading.enumerate()}
    with pytest.raises(CacheClosedError):
        runner.run(plain(1))

"""CudaDevice's pool of fence waiter threads, with stand-in fences (runs without a GPU).

A thread sleeps on its fences in the order they came and cannot be woken early, so the
pool must never queue a callback behind a fence that completes after its own while a
thread is free for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch

from mmcache.device.cuda_fence import CudaFence
from mmcache.device.cuda_waiters import FenceWaiters


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class _Fence:
    """Done when completed by hand; fences of one stream are completed in seq order."""

    _seq = 0

    def __init__(self, stream: _Stream) -> None:
        _Fence._seq += 1
        self.seq = _Fence._seq
        self.stream = stream
        self._done = threading.Event()

    def complete(self) -> None:
        self._done.set()

    def synchronize(self, sleeper: object = None) -> None:
        self._done.wait()


@pytest.fixture
def waiters() -> Iterator[FenceWaiters]:
    pool = FenceWaiters(torch.device("cpu"), "test-fences", max_threads=2)
    yield pool
    pool.close(timeout=10)


def _submit(pool: FenceWaiters, fence: _Fence, fn: Callable[[], Any]) -> None:
    pool.submit(cast(CudaFence, fence), fn)


def _ran(log: list[str], name: str) -> Callable[[], None]:
    return lambda: log.append(name)


def _until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_callback_added_late_does_not_wait_behind_a_later_fence(
    waiters: FenceWaiters,
) -> None:
    stream = _Stream(1)
    early, late = _Fence(stream), _Fence(stream)
    log: list[str] = []
    _submit(waiters, late, _ran(log, "late"))
    _submit(waiters, early, _ran(log, "early"))
    early.complete()
    assert _until(lambda: log == ["early"])
    late.complete()
    assert _until(lambda: log == ["early", "late"])


def test_callbacks_of_one_stream_added_in_order_share_one_thread(waiters: FenceWaiters) -> None:
    stream = _Stream(1)
    fences = [_Fence(stream) for _ in range(5)]
    threads: list[str] = []
    for fence in fences:
        _submit(waiters, fence, lambda: threads.append(threading.current_thread().name))
    for fence in fences:
        fence.complete()
    assert _until(lambda: len(threads) == 5)
    assert len(set(threads)) == 1
    assert waiters.thread_count == 1


def test_a_thread_given_a_job_out_of_order_takes_no_chained_jobs_until_idle(
    waiters: FenceWaiters,
) -> None:
    slow, other = _Fence(_Stream(1)), _Fence(_Stream(2))
    log: list[str] = []
    _submit(waiters, slow, _ran(log, "slow"))  # thread 0
    _submit(waiters, other, _ran(log, "other"))  # thread 1
    stream = _Stream(3)
    queued_behind = _Fence(stream)
    _submit(waiters, queued_behind, _ran(log, "behind"))  # both busy: behind one of them
    other.complete()
    assert _until(lambda: "other" in log)
    after = _Fence(stream)  # same stream, later: must not chain behind the slow fence
    _submit(waiters, after, _ran(log, "after"))
    queued_behind.complete()
    after.complete()
    assert _until(lambda: "after" in log)
    assert "slow" not in log
    slow.complete()
    assert _until(lambda: len(log) == 4)


def test_a_callback_that_raises_does_not_stop_its_thread(waiters: FenceWaiters) -> None:
    stream = _Stream(1)
    first, second = _Fence(stream), _Fence(stream)
    log: list[str] = []

    def exits() -> None:
        raise SystemExit("a callback called sys.exit()")

    _submit(waiters, first, exits)
    _submit(waiters, second, _ran(log, "second"))
    first.complete()
    second.complete()
    assert _until(lambda: log == ["second"])


def test_close_runs_queued_callbacks_and_later_ones_run_inline() -> None:
    pool = FenceWaiters(torch.device("cpu"), "test-fences")
    fence = _Fence(_Stream(1))
    log: list[str] = []
    _submit(pool, fence, _ran(log, "queued"))
    threading.Timer(0.05, fence.complete).start()
    pool.close(timeout=10)
    assert log == ["queued"]
    done = _Fence(_Stream(1))
    done.complete()
    _submit(pool, done, _ran(log, "inline"))
    assert log == ["queued", "inline"]

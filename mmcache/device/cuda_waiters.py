"""Threads that sleep on CUDA fences and run the callbacks added to them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, final

import torch

from mmcache.device.cuda_driver import CudaDriver, FenceSleeper

if TYPE_CHECKING:
    from mmcache.device.cuda_fence import CudaFence

__all__ = ["FenceWaiters"]

_log = logging.getLogger(__name__)

_Job = tuple["CudaFence", Callable[[], object], "FenceWaiters"]


@final
class _FenceWaiter:
    """One thread that sleeps on its fences in the order they came, running each callback."""

    __slots__ = ("_device", "_name", "_queue", "_thread", "mixed", "pending", "tail")

    def __init__(self, device: torch.device, name: str) -> None:
        self._device = device
        self._name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Changed under the pool's lock: the fence of the last job queued, the jobs queued
        # and not yet run, and whether a job was queued out of stream order (a fallback).
        self.tail: CudaFence | None = None
        self.pending = 0
        self.mixed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: _Job | None) -> None:
        self._queue.put(job)

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to end; return whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        sleeper: FenceSleeper | None = None
        try:
            # Without this the runtime would make a context current on GPU 0 for this
            # thread; the sleeper's driver calls use the context made current here.
            torch.cuda.set_device(self._device)
            sleeper = CudaDriver.get().sleeper(self._device.index or 0)
        except Exception as exc:  # still correct without it: fences are polled instead
            _log.warning("%s: no fence sleeper (%s); polling fences", self._name, str(exc))
        try:
            # The thread must outlive any callback: the pool keeps sending it jobs.
            while (job := self._queue.get()) is not None:
                fence, fn, pool = job
                # Drop the job before blocking again: its closure may hold tensors or futures.
                del job
                fence.synchronize(sleeper)
                try:
                    fn()
                except BaseException:
                    _log.exception("%s: a fence callback raised", self._name)
                finally:
                    pool.job_done(self)
                del fence, fn
        finally:
            if sleeper is not None:
                sleeper.close()


@final
class FenceWaiters:
    """Threads that sleep on fences and run their callbacks, none behind a later fence.

    A thread cannot be woken before the fence it sleeps on, so a callback for an early
    fence queued behind one for a later fence would wait for the later one (a get whose
    offload landed, behind a download queued after it). A job therefore goes to a thread
    whose jobs are all of its fence's stream, the last recorded no later than its own
    (fences of one stream complete in order), else to an idle thread, else to a new one.
    Only with max_threads busy does a job go behind later fences: to a thread waiting on
    its stream, else to the one with the fewest jobs (marked mixed: no job chains onto
    it until it is idle).
    """

    __slots__ = ("_closed", "_device", "_lock", "_max_threads", "_name", "_threads")

    def __init__(self, device: torch.device, name: str, max_threads: int = 8) -> None:
        self._device = device
        self._name = name
        self._max_threads = max_threads
        self._threads: list[_FenceWaiter] = []  # started on demand
        self._lock = threading.Lock()
        self._closed = False

    @property
    def thread_count(self) -> int:
        """How many waiter threads have been started."""
        return len(self._threads)

    def submit(self, fence: CudaFence, fn: Callable[[], object]) -> None:
        """Run fn() on a waiter thread once fence is done."""
        with self._lock:
            if not self._closed:
                waiter = self._pick(fence)
                waiter.tail = fence
                waiter.pending += 1
                waiter.put((fence, fn, self))
                return
        # Closed: no thread is left to wait, so honour the contract on this thread.
        fence.synchronize()
        fn()

    def job_done(self, waiter: _FenceWaiter) -> None:
        with self._lock:
            waiter.pending -= 1
            if not waiter.pending:
                waiter.tail = None  # an idle thread keeps no fence (nor its event) alive
                waiter.mixed = False

    def close(self, timeout: float | None = None) -> None:
        """Run every queued callback, then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            for waiter in threads:
                waiter.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for waiter in threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not waiter.join(left):
                _log.warning("%s: fences still pending after %g s at close", self._name, timeout)
                return

    def _pick(self, fence: CudaFence) -> _FenceWaiter:
        idle = None
        stream = fence.stream.cuda_stream
        for waiter in self._threads:
            tail = waiter.tail
            if tail is None:
                idle = idle or waiter
            elif not waiter.mixed and tail.stream.cuda_stream == stream and tail.seq <= fence.seq:
                return waiter  # it completes after everything queued there
        if idle is not None:
            return idle
        if len(self._threads) < self._max_threads:
            waiter = _FenceWaiter(self._device, f"{self._name}-{len(self._threads)}")
            self._threads.append(waiter)
            return waiter
        # All busy: behind this stream's own later fences if a thread has them (fences of
        # one stream come soon after one another), else behind the shortest queue.
        waiter = min(
            self._threads,
            key=lambda w: (w.tail is None or w.tail.stream.cuda_stream != stream, w.pending),
        )
        waiter.mixed = True
        return waiter

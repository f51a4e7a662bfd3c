"""The simulator's copy engine: its streams' queues of work, run in order on a worker thread.

Each operation (a copy, a host function queued as a kernel, a wait on a fence, a marker
to record) waits for its stream's earlier ones and for its own fences, then runs on one
worker thread, which starts with the first operation queued and ends once idle. Tests
make it adversarial: `hold` keeps what is queued from running, `inject` makes the next
operations fail or never complete (`unstick` lets those run after all), and a bandwidth
and latency make copies take time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, final

import torch

from mmcache.device.base import DONE, Fence
from mmcache.errors import CopyFailedError

__all__ = ["FaultKind", "SimCopyEngine", "SimFence", "SimStream"]

FaultKind = Literal["copy_fails", "alloc_fails", "fence_never_completes"]

#: A worker thread with nothing queued for this long ends (the next op starts another).
_WORKER_IDLE_EXIT_S = 1.0


class SimFence(Fence):
    """A fence completed by the simulator's worker thread."""

    __slots__ = ("_callbacks", "_done", "_event", "_exc", "_lock", "_settled")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._done = False
        self._settled = False  # done and every callback has run
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def ok(self) -> bool:
        return self._done and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._settled:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def _complete(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._exc = exc
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()
        # Waiters wake after the callbacks: synchronize() then sees releases already done.
        with self._lock:
            self._settled = True
            event = self._event
        if event is not None:
            event.set()


class SimStream:
    """A simulated stream: operations run one after another, in the order queued."""

    __slots__ = ("name", "ops")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque[_Op] = deque()

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, queued={len(self.ops)})"


#: A tensor an operation reads or writes, and the list that keeps it referenced while the
#: operation is queued (its allocation's: memory released meanwhile is not recycled).
Operand = tuple[list[torch.Tensor], torch.Tensor]


@dataclass(slots=True, eq=False)
class _Op:
    """One queued piece of simulated device work."""

    stream: SimStream
    fence: SimFence
    deps: list[Fence]
    held: bool
    run: Callable[[], object] | None = None
    nbytes: int = 0
    operands: list[Operand] = field(default_factory=list)
    fail: BaseException | None = None
    stuck: bool = False


@final
class SimCopyEngine:
    """The streams of one SimDevice and the worker thread that runs what they queue."""

    def __init__(self, bandwidth_gbps: float, latency_s: float) -> None:
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_s = latency_s
        self._lock = threading.Lock()  # guards fences
        # Guards streams, holds and faults; the device's allocations share it, since a
        # queued copy keeps its operands referenced through them.
        self.cond = threading.Condition()
        self._streams: list[SimStream] = []
        self._hold_depth = 0
        self._held_ops: list[_Op] = []
        self._faults: dict[FaultKind, int] = {}
        self._worker: threading.Thread | None = None
        self.closed = False
        self.copies_run = 0
        self._completing = 0  # finished operations whose fence callbacks are still running

    def stream(self, name: str) -> SimStream:
        """A new stream, which the worker runs from here on."""
        s = SimStream(name)
        with self.cond:
            self._streams.append(s)
        return s

    # --- queuing ------------------------------------------------------------------------

    def record(self, stream: SimStream) -> Fence:
        """A fence done once what stream has queued so far has run (DONE if nothing)."""
        with self.cond:
            if not stream.ops:
                return DONE
            return self._enqueue(stream, [], None).fence

    def wait_on(self, stream: SimStream, fence: Fence) -> None:
        """Make stream's later operations wait for fence."""
        if fence.done():
            return
        with self.cond:
            self._enqueue(stream, [fence], None)

    def launch(self, stream: SimStream, kernel: Callable[[], object]) -> Fence:
        """Queue a host function as a "kernel" on stream (a producer that writes later)."""
        with self.cond:
            return self._enqueue(stream, [], kernel).fence

    def copy(
        self,
        stream: SimStream,
        run: Callable[[], None],
        nbytes: int,
        after: Sequence[Fence],
        operands: list[Operand],
    ) -> Fence:
        """Queue a copy of nbytes (run() does it) on stream after the fences; operands stay
        referenced until it has run. The injected copy faults fall on it."""
        with self.cond:
            # A failed dependency fails the copy too, even when it finished long ago.
            deps = [f for f in after if not f.done() or f.exception() is not None]
            op = self._enqueue(stream, deps, run, nbytes)
            for holder, tensor in operands:
                holder.append(tensor)
            op.operands = operands
            if self.take_fault("copy_fails"):
                op.fail = CopyFailedError(f"simulated copy failure ({nbytes} bytes)")
            if self.take_fault("fence_never_completes"):
                op.stuck = True
        return op.fence

    # --- what tests do to it ------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep every operation queued inside the block from running until the block exits."""
        with self.cond:
            self._hold_depth += 1
        try:
            yield
        finally:
            with self.cond:
                self._hold_depth -= 1
                if self._hold_depth == 0:
                    for op in self._held_ops:
                        op.held = False
                    self._held_ops.clear()
                    self.cond.notify_all()

    def inject(self, kind: FaultKind, count: int) -> None:
        """Make the next count operations of a kind fail (copies, allocations) or hang (fences)."""
        with self.cond:
            self._faults[kind] = self._faults.get(kind, 0) + count

    def take_fault(self, kind: FaultKind) -> bool:
        """Whether an injected fault of kind falls on this operation (using it up)."""
        with self.cond:
            left = self._faults.get(kind, 0)
            if left <= 0:
                return False
            self._faults[kind] = left - 1
            return True

    def withdraw_faults(self) -> int:
        """Withdraw the faults injected and not fired yet; how many there were."""
        with self.cond:
            left = sum(self._faults.values())
            self._faults.clear()
            return left

    def unstick(self) -> None:
        """Let operations injected with fence_never_completes run after all (a late fence)."""
        with self.cond:
            for s in self._streams:
                for op in s.ops:
                    op.stuck = False
            self.cond.notify_all()

    def synchronize(self) -> None:
        """Block until every queued operation has run (held ones make this wait)."""
        with self.cond:
            fences = [op.fence for s in self._streams for op in s.ops]
        for f in fences:
            f.wait()
        self.wait_completions()

    def wait_completions(self) -> None:
        """Wait until no finished operation is still running its fence's callbacks."""
        with self.cond:
            self.cond.wait_for(lambda: self._completing == 0, timeout=5.0)

    def close(self) -> None:
        """Refuse new operations; the worker ends (what is queued is left unrun)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=5)

    # --- the worker ---------------------------------------------------------------------

    def _enqueue(
        self,
        stream: SimStream,
        deps: list[Fence],
        run: Callable[[], object] | None,
        nbytes: int = 0,
    ) -> _Op:
        """Queue an operation; the caller holds self.cond."""
        if self.closed:
            raise RuntimeError("SimDevice is closed")
        op = _Op(stream, SimFence(self._lock), deps, held=self._hold_depth > 0, run=run)
        op.nbytes = nbytes
        if op.held:
            self._held_ops.append(op)
        stream.ops.append(op)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="mmcache-sim", daemon=True)
            self._worker.start()
        self.cond.notify_all()
        return op

    def _runnable(self) -> _Op | None:
        for s in self._streams:
            if s.ops:
                op = s.ops[0]
                if not op.held and not op.stuck and all(d.done() for d in op.deps):
                    return op
        return None

    def _work(self) -> None:
        while True:
            with self.cond:
                op = self._runnable()
                idle_since: float | None = None
                while op is None:
                    if self.closed:
                        return
                    if any(s.ops for s in self._streams):
                        idle_since = None
                    elif idle_since is None:
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since >= _WORKER_IDLE_EXIT_S:
                        # Nothing queued: end, so that a device dropped without close()
                        # keeps no thread (nor itself, through it); the next op starts one.
                        self._worker = None
                        return
                    # A dependency completing on another device wakes us via timeout.
                    self.cond.wait(timeout=0.05)
                    op = self._runnable()
            exc = op.fail
            if exc is None:
                for dep in op.deps:
                    exc = dep.exception()
                    if exc is not None:
                        break
            if exc is None and op.run is not None:
                delay = self.latency_s
                if self.bandwidth_gbps > 0:
                    delay += op.nbytes / (self.bandwidth_gbps * 1e9)
                if delay > 0:
                    time.sleep(delay)
                try:
                    op.run()
                except Exception as e:  # a failing kernel fails its fence, not the worker
                    exc = e
            with self.cond:
                op.stream.ops.popleft()
                _drop_operands(op)
                if op.nbytes:
                    self.copies_run += 1
                self._completing += 1
                self.cond.notify_all()
            try:
                op.fence._complete(exc)
            finally:
                with self.cond:
                    self._completing -= 1
                    self.cond.notify_all()
            del op  # this frame lives on: it must not keep the last operands alive


def _drop_operands(op: _Op) -> None:
    """Forget a finished operation's tensors (queued work keeps nothing alive afterwards)."""
    for holder, t in op.operands:
        # by identity: == on tensors compares elements
        idx = next(i for i, x in enumerate(holder) if x is t)
        del holder[idx]
    op.operands.clear()
    op.run = None

"""ServerCalls: every call to the store bounded by a timeout that grows with the bytes it
moves (remote_timeout_sec + remote_timeout_per_mib_sec per MiB), its faults counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from typing import Final, TypeVar, final

from prometheus_client import Histogram

from mmcache.remote.faults import Faults
from mmcache.remote.store import WrongTypeError

__all__ = ["FAILED", "Failed", "ServerCalls"]

_T = TypeVar("_T")
_MiB: Final = 1024 * 1024


@final
class Failed:
    """What a call that failed returns (its fault is counted already)."""

    __slots__ = ()


FAILED: Final = Failed()


@final
class ServerCalls:
    """Runs the store's calls: each within its timeout, a fault returned as FAILED, not raised.

    A call that moves nbytes has timeout_s plus per_mib_s for each MiB of them: a large
    value on a healthy server is not a fault, a server that does not answer still is
    one within timeout_s. A call that succeeds ends a burst of faults and has its
    latency observed (by op, unless timed=False); one that fails is counted and backed
    off from (mmcache.remote.faults). WrongTypeError (a fault of one key, not of the
    server) is raised to the caller and counts as an answer.
    """

    def __init__(
        self,
        faults: Faults,
        timeout_s: float,
        seconds: Mapping[str, Histogram],
        per_mib_s: float = 0.0,
    ) -> None:
        self.faults = faults
        self._timeout = timeout_s
        self._per_mib = per_mib_s
        self._seconds = seconds

    def available(self) -> bool:
        """Whether to try the server now (no back-off running; after one, the one probe)."""
        return self.faults.available()

    def in_burst(self) -> bool:
        """Whether the server is being backed off from (its last operation failed)."""
        return self.faults.in_burst

    def timeout(self, nbytes: int = 0) -> float:
        """Seconds a call that moves nbytes may take."""
        return self._timeout + self._per_mib * nbytes / _MiB

    async def __call__(
        self, op: str, call: Awaitable[_T], nbytes: int = 0, *, timed: bool = True
    ) -> _T | Failed:
        limit = self.timeout(nbytes)
        started = time.perf_counter()
        sent = self.faults.now()  # a failure of a call sent during a back-off extends none
        try:
            async with asyncio.timeout(limit) as deadline:
                result = await call
        except asyncio.CancelledError:
            raise
        except WrongTypeError:
            self.faults.succeeded()  # the server answered: the fault is the key's
            raise
        except Exception as e:
            if isinstance(e, TimeoutError) and deadline.expired():
                e = TimeoutError(f"timed out after {limit:.2f} s{_moving(nbytes)}")
            self.faults.failed(op, e, sent)
            return FAILED
        seconds = self._seconds.get(op) if timed else None
        if seconds is not None:
            seconds.observe(time.perf_counter() - started)
        self.faults.succeeded()
        return result


def _moving(nbytes: int) -> str:
    if nbytes >= _MiB // 10:
        return f" moving {nbytes / _MiB:.1f} MiB"
    return f" moving {nbytes} bytes" if nbytes else ""

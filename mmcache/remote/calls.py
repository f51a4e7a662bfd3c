"""ServerCalls: every call to the store bounded by remote_timeout_sec, its faults counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from typing import Final, TypeVar, final

from prometheus_client import Histogram

from mmcache.remote.faults import Faults

__all__ = ["FAILED", "Failed", "ServerCalls"]

_T = TypeVar("_T")


@final
class Failed:
    """What a call that failed returns (its fault is counted already)."""

    __slots__ = ()


FAILED: Final = Failed()


@final
class ServerCalls:
    """Runs the store's calls: each within timeout_s, a fault returned as FAILED, not raised.

    A call that succeeds ends a burst of faults and has its latency observed (by op);
    one that fails is counted and backed off from (mmcache.remote.faults).
    """

    def __init__(self, faults: Faults, timeout_s: float, seconds: Mapping[str, Histogram]) -> None:
        self.faults = faults
        self._timeout = timeout_s
        self._seconds = seconds

    def available(self) -> bool:
        """Whether to try the server now (no back-off running; after one, the one probe)."""
        return self.faults.available()

    def in_burst(self) -> bool:
        """Whether the server is being backed off from (its last operation failed)."""
        return self.faults.in_burst

    async def __call__(self, op: str, call: Awaitable[_T]) -> _T | Failed:
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, self._timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.faults.failed(op, e)
            return FAILED
        seconds = self._seconds.get(op)
        if seconds is not None:
            seconds.observe(time.perf_counter() - started)
        self.faults.succeeded()
        return result

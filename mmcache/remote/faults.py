"""Faults of the remote tier: counted by kind, logged once per burst, backed off from."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, final

__all__ = ["ERROR_KINDS", "Faults", "describe", "error_kind"]

log = logging.getLogger("mmcache")

#: how remote errors are counted: timeout, connection (refused, reset, lost), server (an
#: error reply), other
ERROR_KINDS: Final = ("timeout", "connection", "server", "other")

BACKOFF_MIN_S: Final = 0.05
BACKOFF_MAX_S: Final = 5.0
#: a burst that starts within this long of the last logged one is logged at debug level
QUIET_S: Final = 60.0
#: what an error of each kind says when its own text is empty
_SILENT: Final = {
    "timeout": "no answer in time",
    "connection": "connection failed",
    "server": "the server answered with an error",
    "other": "failed without a message",
}


def error_kind(exc: BaseException) -> str:
    """Which of ERROR_KINDS exc is (by its classes' names: the client's errors are its own)."""
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    if isinstance(exc, TimeoutError) or "Timeout" in names:
        return "timeout"
    if isinstance(exc, OSError) or "ConnectionError" in names or "ClusterDown" in names:
        return "connection"
    if "RedisError" in names or "ResponseError" in names:
        return "server"
    return "other"


def describe(exc: BaseException) -> str:
    """exc's type and its message, never empty: "TimeoutError: timed out after 0.50 s"."""
    text = str(exc).strip() or _SILENT[error_kind(exc)]
    return f"{type(exc).__name__}: {text}"


@final
class Faults:
    """Whether the remote tier should try the server now, and what went wrong so far.

    After an error, operations skip the server for a back-off that doubles with each
    error in a row (BACKOFF_MIN_S to BACKOFF_MAX_S); once it has passed, one operation
    probes the server and the others go on skipping it until that one's answer (or for
    probe_s at most); the first success ends the burst.
    The client reconnects on the first operation after the back-off. One warning
    starts a burst and one line ends it, however many calls failed between; a flapping
    server's further bursts within QUIET_S are logged at debug level and counted in the
    next warning.
    """

    __slots__ = (
        "_backoff",
        "_burst",
        "_clock",
        "_count",
        "_logged",
        "_logged_at",
        "_name",
        "_probe_s",
        "_probe_until",
        "_quiet_bursts",
        "_retry_at",
        "errors",
    )

    def __init__(self, name: str, count: Callable[[str], None], probe_s: float = 1.0) -> None:
        self._name = name  # the server, as logs name it
        self._count = count
        self._probe_s = probe_s  # how long one probe has to answer (an operation's timeout)
        self._probe_until = 0.0
        self._clock = time.monotonic
        self._backoff = 0.0
        self._retry_at = 0.0
        self._burst = 0
        self._logged = False  # whether this burst's start was logged as a warning
        self._logged_at = -QUIET_S
        self._quiet_bursts = 0
        #: errors so far, by kind
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)

    @property
    def total(self) -> int:
        """Errors so far, all kinds."""
        return sum(self.errors.values())

    @property
    def in_burst(self) -> bool:
        """Whether the last operation failed (and none has succeeded since)."""
        return self._burst > 0

    def available(self) -> bool:
        """Whether to try the server now: no burst, or the one probe after its back-off.

        A server that is down must cost the calls in between next to nothing: without
        the single probe, every put after a back-off would queue a write to it.
        """
        if self._burst == 0:
            return True
        now = self._clock()
        if now < self._retry_at or now < self._probe_until:
            return False
        self._probe_until = now + self._probe_s
        return True

    def failed(self, op: str, exc: BaseException) -> None:
        """An operation failed: count it, log it if it starts a burst, back off."""
        kind = error_kind(exc)
        self.errors[kind] += 1
        self._count(kind)
        if self._burst == 0:
            self._burst_started(op, exc)
        self._burst += 1
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
        self._retry_at = self._clock() + self._backoff
        self._probe_until = 0.0  # the probe answered

    def succeeded(self) -> None:
        """An operation succeeded: the burst, if any, is over."""
        if self._burst:
            level = logging.WARNING if self._logged else logging.DEBUG
            log.log(
                level, "remote tier %s: back after %d failed operations", self._name, self._burst
            )
            self._burst = 0
            self._backoff = 0.0
            self._probe_until = 0.0

    def _burst_started(self, op: str, exc: BaseException) -> None:
        """Log a burst's first error: a warning, unless one was logged within QUIET_S."""
        now = self._clock()
        self._logged = now - self._logged_at >= QUIET_S
        if not self._logged:
            self._quiet_bursts += 1
            log.debug("remote tier %s: %s failed: %r", self._name, op, exc)
            return
        self._logged_at = now
        since = (
            f"; {self._quiet_bursts} shorter bursts since the last one"
            if self._quiet_bursts
            else ""
        )
        self._quiet_bursts = 0
        log.warning(
            "remote tier %s: %s failed (%s); serving local tiers only, retrying with "
            "back-off (logged once until it recovers%s)",
            self._name,
            op,
            describe(exc),
            since,
        )

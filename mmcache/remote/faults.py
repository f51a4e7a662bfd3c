"""Faults of the remote tier: counted by kind, logged when a burst starts and when it ends,
backed off from."""

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

    After an error, operations skip the server for a back-off (BACKOFF_MIN_S to
    BACKOFF_MAX_S); once it has passed, one operation probes the server and the others go
    on skipping it until that one's answer (or for probe_s at most); the first success
    ends the burst. The back-off doubles only when an operation sent after it ended (the
    probe) fails too: those sent before, in flight when the server went, count once.
    The client reconnects on the first operation after the back-off. Every burst (an
    outage) is logged twice, however many calls failed in it: one warning when it starts,
    one when it ends.
    """

    __slots__ = (
        "_backoff",
        "_burst",
        "_clock",
        "_count",
        "_name",
        "_probe_s",
        "_probe_until",
        "_retry_at",
        "_since",
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
        self._since = 0.0  # when the burst started
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

    def now(self) -> float:
        """The time on the clock of the back-off: an operation's, when sent, for failed()."""
        return self._clock()

    def failed(self, op: str, exc: BaseException, sent: float | None = None) -> None:
        """An operation, sent at sent (now() then; None: just now), failed: count it, log
        it if it starts a burst, back off."""
        kind = error_kind(exc)
        self.errors[kind] += 1
        self._count(kind)
        now = self._clock()
        # Sent before this back-off ended: in flight when the server went, its error is the
        # same outage's, not a retry that failed again.
        in_flight = self._burst > 0 and (now if sent is None else sent) < self._retry_at
        if self._burst == 0:
            self._since = now
            log.warning(
                "remote tier %s: %s failed (%s); serving local tiers only, retrying with "
                "back-off (logged again when it recovers)",
                self._name,
                op,
                describe(exc),
            )
        self._burst += 1
        if in_flight:
            return
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
        self._retry_at = now + self._backoff
        self._probe_until = 0.0  # the probe answered

    def succeeded(self) -> None:
        """An operation succeeded: the burst, if any, is over."""
        if self._burst:
            log.warning(
                "remote tier %s: back after %d failed operations in %.1f s",
                self._name,
                self._burst,
                self._clock() - self._since,
            )
            self._burst = 0
            self._backoff = 0.0
            self._probe_until = 0.0

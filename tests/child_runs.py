"""Child Python processes of one test module, started side by side, each read by its test.

Most of what a benchmark's or an example's test waits for is its child starting Python
and torch. On a host with cores to spare (a GPU host: 16) the module's children run a
few at a time from the module's start, and each test waits for its own; on a small
machine (CI: 2 cores) they would only slow each other, and each runs when its test asks.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

__all__ = ["WORKERS", "ChildRuns", "selected_tests"]

#: children at once: a quarter of the cores (each child's torch has threads of its own);
#: PYTEST_CHILD_RUNS sets it
WORKERS = int(os.environ.get("PYTEST_CHILD_RUNS", max(1, (os.cpu_count() or 1) // 4)))

Result = subprocess.CompletedProcess[str]


def selected_tests(request: pytest.FixtureRequest) -> Iterator[pytest.Function]:
    """The tests of the requesting module that this session runs (what its children to
    start are read from)."""
    for item in request.session.items:
        if isinstance(item, pytest.Function) and item.module is request.module:
            yield item


class ChildRuns:
    """Named runs of this Python (argv, working directory, environment, timeout); those
    given to start() run side by side from then, any other when result() asks."""

    def __init__(
        self,
        runs: Mapping[str, Sequence[str]],
        *,
        cwd: Path,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._runs = dict(runs)
        self._cwd = cwd
        self._timeout = timeout
        self._env = None if env is None else dict(env)
        self._started: dict[str, Future[Result]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _run(self, key: str) -> Result:
        return subprocess.run(
            [sys.executable, *self._runs[key]],
            capture_output=True,
            text=True,
            timeout=self._timeout,
            check=False,
            cwd=self._cwd,
            env=self._env,
        )

    def start(self, keys: Sequence[str]) -> None:
        """Start keys' children, WORKERS at a time, in that order (none with one worker):
        each test then waits for its own alone."""
        if WORKERS < 2 or len(keys) < 2:
            return
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="child-run")
        for key in keys:
            self._started[key] = self._pool.submit(self._run, key)

    def result(self, key: str, *, alone: bool = False) -> Result:
        """The child's result (a run that timed out raises here, in its own test); alone:
        once every child started has ended (a run that times itself)."""
        if alone:
            concurrent.futures.wait(self._started.values())
        started = self._started.pop(key, None)
        return self._run(key) if started is None else started.result()

    def close(self) -> None:
        """Drop the children not started yet and wait for those running (a test that
        failed before reading its own leaves one, which ends within its timeout)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

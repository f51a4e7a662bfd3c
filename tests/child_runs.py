"""Child Python processes of one test module, run side by side before its tests read them.

Most of what a benchmark's or an example's test waits for is its child starting Python
and torch. On a host with cores to spare (a GPU host: 16) the module's children run a
few at a time while its first test waits, and each test then reads its own child's
result; on a small machine (CI: 2 cores) they would only slow each other and run one at
a time, each when its test asks, as they did before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

__all__ = ["WORKERS", "ChildRuns"]

#: children at once: a quarter of the cores (each child's torch has threads of its own);
#: PYTEST_CHILD_RUNS sets it
WORKERS = int(os.environ.get("PYTEST_CHILD_RUNS", max(1, (os.cpu_count() or 1) // 4)))

Result = subprocess.CompletedProcess[str]


class ChildRuns:
    """Named runs of this Python (argv, working directory, environment, timeout); the
    selected ones started side by side by start(), any other run when result() asks."""

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
        """Run keys' children WORKERS at a time and wait for all (none with one worker)."""
        if WORKERS < 2 or len(keys) < 2:
            return
        with ThreadPoolExecutor(WORKERS, thread_name_prefix="child-run") as pool:
            for key in keys:
                self._started[key] = pool.submit(self._run, key)

    def result(self, key: str) -> Result:
        """The child's result (a run that timed out raises here, in its own test)."""
        started = self._started.pop(key, None)
        return self._run(key) if started is None else started.result()

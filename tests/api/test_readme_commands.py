"""Every shell command the README shows after its set-up runs as written, on the simulator.

Each line of each ```bash block of README.md but the first (the set-up commands, which
test_readme.py holds to `bash scripts/run demo` and `bash scripts/run test`) is one command
and one test case, run by bash in the checkout. What a command needs that the test cannot
give it is said by the comment after it, which the test reads:

- `# needs a GPU ...`: skipped where CUDA is not available. The other commands see no GPU
  (CUDA_VISIBLE_DEVICES is empty), so that they run on the simulator on any machine.
- `# needs ... a model`: always skipped: the test has no model to serve.
- ``# needs `program` ``: skipped where program is not on PATH, and failed under CI
  (CI=true), which installs every such program (.ci/run).

A command that ends in `&` (it runs in the background) or whose comment says `until Ctrl-C`
passes when it exits with status 0, or is still running after LONG_RUNNING_S seconds; it is
then stopped. Every other command must exit with status 0 within TIMEOUT_S.

What the test changes in a command, and why:

- `.venv/bin/` is the bin directory of the interpreter running the tests. In CI that is the
  checkout's own `.venv/bin` (`bash scripts/run test` runs pytest with `.venv/bin/python`);
  on a machine whose tests run in another venv, it is that venv, where `.venv` may not
  exist. MMCACHE_VENV points the install scripts at the same venv, and PYTHONPATH starts
  with the checkout, so that the checkout's mmcache is the one that runs. Where that venv
  has no `mmcache` program (the checkout is on PYTHONPATH, not installed), `.venv/bin/mmcache`
  is `python -m mmcache`; under CI the program must be there.
- `redis://127.0.0.1:6379/0`, the README's address of a server of the reader's own, is a
  redis-server the test starts on a free port (tests/redis_server.py, as conftest's
  `redis_session` does; skipped where there is none, failed under CI).
- Ports 9464 (the demo's metrics) and 9090 (Prometheus's web interface) become free ports,
  and `/tmp/mmcache-prometheus` a temporary directory: other runs on the machine may hold
  them.
- `bash scripts/install_<engine>.sh` and the commands after it in its block need that
  engine: where it is not installed they are skipped (a test installs nothing), and failed
  under CI; where it is, the script finds it and does nothing.
- The caller's MMCACHE_* and SGLANG_* variables are dropped: the README's commands run with
  the settings they show.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: The venv the README's `.venv/bin/` stands for here: the one running the tests.
VENV_BIN = Path(sys.executable).parent
IN_CI = os.environ.get("CI", "").lower() == "true"
TIMEOUT_S = 180
LONG_RUNNING_S = 8.0
#: The README's placeholders, and what each becomes here.
REDIS_PLACEHOLDER = "redis://127.0.0.1:6379/0"
METRICS_PORT, PROMETHEUS_ADDRESS = "9464", "127.0.0.1:9090"
PROMETHEUS_DATA = "/tmp/mmcache-prometheus"
#: The engine each install script installs (the distribution's name).
ENGINES = {"install_integrations.sh": "sglang", "install_vllm.sh": "vllm"}
#: Programs of the venv: the README calls them by path (`.venv/bin/...`), never bare.
VENV_PROGRAMS = {"python", "python3", "pip", "mmcache", "vllm", "sglang", "pytest"}


@dataclass(frozen=True)
class Command:
    """One command of the README: its section, the shell text and the comment after it."""

    section: str
    shell: str
    comment: str
    engine: str | None  # the install script whose engine it needs, if any

    @property
    def long_running(self) -> bool:
        return self.shell.endswith("&") or "until Ctrl-C" in self.comment

    @property
    def name(self) -> str:
        return f"{self.section}: {self.shell[:70]}"


def commands() -> list[Command]:
    """The commands of every ```bash block after the first, in the README's order."""
    found: list[Command] = []
    section, blocks, engine = "top", 0, None
    lines = iter(README.splitlines())
    for line in lines:
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip() != "```bash":
            continue
        blocks += 1
        engine = None
        for text in lines:
            if text.startswith("```"):
                break
            if blocks == 1 or not text.strip() or text.lstrip().startswith("#"):
                continue
            shell, comment = split_comment(text)
            script = re.match(r"bash scripts/(install_\w+\.sh)$", shell)
            if script is not None and script[1] in ENGINES:
                engine = script[1]
            found.append(Command(section, shell, comment, engine))
    return found


def split_comment(line: str) -> tuple[str, str]:
    """A README line's command and its comment: what follows two spaces and a `#`."""
    match = re.match(r"^(.*?)\s{2,}#\s?(.*)$", line)
    if match is None:
        return line.strip(), ""
    return match[1].strip(), match[2].strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def missing(reason: str) -> None:
    """Skip the command for reason; under CI, where everything it needs is installed, fail."""
    if IN_CI:
        pytest.fail(f"CI must run this README command: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def readme_redis() -> Iterator[str]:
    """The URL of a redis-server of this module's, standing for the reader's own server."""
    from redis_server import redis_server, require_server

    require_server("redis")
    with redis_server(kind="redis") as server:
        yield server.url


def test_the_readme_shows_commands_as_they_run_after_set_up() -> None:
    """The README calls the venv's programs by path, the way every command below runs."""
    shown = commands()
    assert len(shown) >= 10, [c.name for c in shown]
    bare = [c.shell for c in shown if c.shell.split()[0] in VENV_PROGRAMS]
    assert bare == [], "call the venv's programs as .venv/bin/<program>"
    assert "source .venv/bin/activate" not in README
    for command in shown:  # every skip the README asks for is one the test knows
        if "needs" in command.comment:
            assert re.search(r"needs (a GPU|.*\ba model\b|`[\w.-]+`)", command.comment), command


def prepare(command: Command, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The command as it runs here (see the module's docstring), or a skip or failure."""
    comment = command.comment
    if re.search(r"needs .*\ba model\b", comment):
        pytest.skip("needs a model to serve, which this test has not")
    gpu = "needs a GPU" in comment
    if gpu and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for program in re.findall(r"needs `([\w.-]+)`", comment):
        if shutil.which(program) is None:
            missing(f"needs `{program}`, which is not on PATH")
    if command.engine is not None:
        try:
            importlib.metadata.version(ENGINES[command.engine])
        except importlib.metadata.PackageNotFoundError:
            missing(f"its engine is not installed: bash scripts/{command.engine} installs it")
    shell = command.shell
    if not (VENV_BIN / "mmcache").exists() and not IN_CI:  # mmcache on PYTHONPATH only
        shell = re.sub(
            r"(?<![\w/.])\.venv/bin/mmcache(?![\w.-])", f"{sys.executable} -m mmcache", shell
        )
    shell = re.sub(r"(?<![\w/.])\.venv/bin/", f"{VENV_BIN}/", shell)
    if REDIS_PLACEHOLDER in shell:
        shell = shell.replace(REDIS_PLACEHOLDER, request.getfixturevalue("readme_redis"))
    shell = re.sub(rf"\b{METRICS_PORT}\b", str(free_port()), shell)
    shell = shell.replace(PROMETHEUS_ADDRESS, f"127.0.0.1:{free_port()}")
    shell = shell.replace(PROMETHEUS_DATA, str(tmp_path / "prometheus"))
    return shell


def environment(gpu: bool) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("MMCACHE_", "SGLANG_"))
        and name.lower() != "prometheus_multiproc_dir"
    }
    env["MMCACHE_VENV"] = str(VENV_BIN.parent)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@contextlib.contextmanager
def started(shell: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """shell running in a session of its own, stopped (its whole group) on the way out."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", shell],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            for sig in (signal.SIGINT, signal.SIGKILL):
                if process.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("command", commands(), ids=lambda c: c.name)
def test_a_readme_command_runs_as_written(
    command: Command, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    shell = prepare(command, request, tmp_path)
    env = environment(gpu="needs a GPU" in command.comment)
    log = tmp_path / "output.log"
    if command.long_running:
        with started(shell.removesuffix("&").strip(), env, log) as process:
            deadline = time.monotonic() + LONG_RUNNING_S
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            status = process.poll()
        output = log.read_text(errors="replace")
        assert status in (None, 0), f"{shell}\nexit status {status}:\n{output[-4000:]}"
        return
    with started(shell, env, log) as process:
        try:
            status = process.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = None
    output = log.read_text(errors="replace")
    assert status == 0, f"{shell}\nexit status {status}:\n{output[-4000:]}"

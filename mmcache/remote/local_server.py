"""A throwaway redis-server on a free loopback port, for examples, benchmarks and trials."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from mmcache.errors import MMCacheError

__all__ = ["local_redis_server"]


@contextlib.contextmanager
def local_redis_server(timeout_s: float = 10.0) -> Iterator[str]:
    """Start redis-server (no persistence, a temporary directory); yield its URL; stop it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise MMCacheError(
            "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server); "
            "or give the URL of a Redis/Valkey server you can reach"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="mmcache-redis-") as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                if time.monotonic() > deadline or server.poll() is not None:
                    raise MMCacheError(f"redis-server did not start on port {port}")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.terminate()
            server.wait(10)

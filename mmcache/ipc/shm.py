"""Shared-memory segments that other processes map by path; /dev/shm space is reserved, not assumed.

A page of a tmpfs file that cannot be allocated when first touched kills the
process with SIGBUS. So every byte the transport will write is reserved first
with posix_fallocate, which fails cleanly (ENOSPC) when /dev/shm is full.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Final, final

import torch

from mmcache.ipc.errors import SharedMemoryFullError

__all__ = ["SHM_DIR", "SharedSegment"]

_MiB: Final = 1 << 20
#: POSIX shared memory lives here on Linux; elsewhere a temporary file maps the same way.
SHM_DIR: Final = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_TRACKED: Final = SHM_DIR == "/dev/shm"


@final
class SharedSegment:
    """A file in SHM_DIR mapped shared into this process; the creator owns (unlinks) it."""

    __slots__ = ("_fd", "_mapping", "_tensor", "nbytes", "owner", "path")

    def __init__(self, path: str, fd: int, mapping: mmap.mmap, nbytes: int, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._fd = fd
        self._mapping: mmap.mmap | None = mapping
        self._tensor: torch.Tensor | None = None

    @classmethod
    def create(cls, tag: str, nbytes: int) -> SharedSegment:
        """Create a new segment of nbytes (pages are reserved later, by commit())."""
        name = f"mmcache-{os.getpid()}-{secrets.token_hex(6)}-{tag}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # mmap refuses length 0; a one-byte file keeps the code free of special cases.
            os.ftruncate(fd, max(nbytes, 1))
            mapping = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if _TRACKED:
            # If this process dies without close(), multiprocessing's tracker unlinks it.
            resource_tracker.register("/" + name, "shared_memory")
        return cls(path, fd, mapping, nbytes, owner=True)

    @classmethod
    def attach(cls, path: str) -> SharedSegment:
        """Map an existing segment created by another process (or this one)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mapping, size, owner=False)

    def tensor(self) -> torch.Tensor:
        """The segment as a flat uint8 tensor (the mapping lives as long as any view of it)."""
        if self._tensor is None:
            if self._mapping is None:
                raise ValueError(f"shared segment {self.path} is closed")
            self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        return self._tensor

    def cells(self) -> memoryview:
        """The segment as int64 cells (8-byte aligned stores: never torn)."""
        if self._mapping is None:
            raise ValueError(f"shared segment {self.path} is closed")
        return memoryview(self._mapping).cast("q")

    def commit(self, offset: int, nbytes: int, hint: str) -> None:
        """Reserve the pages of [offset, offset+nbytes): SharedMemoryFullError if full."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return  # a filesystem without fallocate: pages are allocated on touch
                raise
            free = shutil.disk_usage(SHM_DIR).free
            raise SharedMemoryFullError(
                f"{SHM_DIR} has no room for {nbytes / _MiB:.1f} MiB more of {self.path} "
                f"({free / _MiB:.1f} MiB free); {hint}, or enlarge {SHM_DIR} "
                "(docker run --shm-size=...)"
            ) from exc

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive lock on the segment (flock: released by the kernel if we die)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        """Remove the name; processes that mapped the segment keep their mappings."""
        if not self.owner:
            return
        self.owner = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if _TRACKED:
            resource_tracker.unregister("/" + os.path.basename(self.path), "shared_memory")

    def close(self) -> None:
        """Close the file; the mapping goes once the last tensor or view of it is gone."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # mmap.close() would fail while tensors view the mapping: let the last one unmap it.
        self._tensor = None
        self._mapping = None

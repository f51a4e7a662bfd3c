"""Shared-memory segments that other processes map by path; /dev/shm space is reserved, not assumed.

A page of a tmpfs file that cannot be allocated when first touched kills the
process with SIGBUS. So every byte the transport will write is reserved first
with posix_fallocate, which fails cleanly (ENOSPC) when /dev/shm is full.

Each sender keeps its segments in a private directory of its own
(SHM_DIR/mmcache-<pid>-<128 random bits>, mode 0700). A receiver maps only
paths of that form, in a directory and files owned by its own user with
exactly the modes a sender gives them, refusing anything else before it opens
it (InvalidHandleError); it maps the pool and the fallback read-only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
from collections.abc import Iterator
from typing import Final, final

import torch

from mmcache.ipc.errors import InvalidHandleError, SharedMemoryFullError

__all__ = ["SHM_DIR", "PrivateDirectory", "SharedSegment", "reserve"]

_MiB: Final = 1 << 20
#: POSIX shared memory lives here on Linux; elsewhere a temporary file maps the same way.
SHM_DIR: Final = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_DIR_MODE: Final = 0o700
_FILE_MODE: Final = 0o600
_TAGS: Final = ("control", "pool", "fallback")
_DIR_NAME: Final = re.compile(r"mmcache-([0-9]{1,10})-[0-9a-f]{32}")


def reserve(fd: int, offset: int, nbytes: int, path: str, hint: str) -> None:
    """Reserve the pages of [offset, offset+nbytes) of the file fd has open (at path), so
    that no first touch of them is a SIGBUS: SharedMemoryFullError if its filesystem is
    full. A filesystem without fallocate allocates pages on touch, unchecked."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            raise
        where = SHM_DIR if path.startswith(SHM_DIR + os.sep) else os.path.dirname(path)
        free = shutil.disk_usage(where).free
        raise SharedMemoryFullError(
            f"{where} has no room for {nbytes / _MiB:.1f} MiB more of {path} "
            f"({free / _MiB:.1f} MiB free); {hint}, or enlarge {where} "
            "(docker run --shm-size=...)"
        ) from exc


@final
class PrivateDirectory:
    """A sender's private directory of segments, locked (shared) while the sender lives.

    A sender killed before close() leaves its directory behind; the next sender of
    the same user removes each one it can lock exclusively (the kernel dropped the
    dead sender's lock), also across PID namespaces that share /dev/shm.
    """

    __slots__ = ("_fd", "path")

    def __init__(self) -> None:
        _remove_abandoned_directories()
        path = os.path.join(SHM_DIR, f"mmcache-{os.getpid()}-{secrets.token_hex(16)}")
        os.mkdir(path, _DIR_MODE)
        try:
            os.chmod(path, _DIR_MODE)  # whatever the umask took away: the mode receivers check
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            os.rmdir(path)
            raise
        # Before any segment exists in it: a sweeper that locks it first finds it empty.
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        self.path = path

    def remove(self) -> None:
        """Remove the directory and whatever is left in it, then drop the lock."""
        if self._fd < 0:
            return
        try:
            _remove_contents(self.path)
        finally:
            os.close(self._fd)
            self._fd = -1


def _remove_contents(path: str) -> None:
    for tag in _TAGS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, tag))
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def _remove_abandoned_directories() -> None:
    """Remove this user's sender directories that no live sender holds."""
    uid = os.getuid()
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for entry in entries:
            if _DIR_NAME.fullmatch(entry.name) is None:
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == uid:
                    _remove_if_abandoned(entry.path)


def _remove_if_abandoned(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its sender lives
        # A directory without a control block is one a sender is just making.
        if os.path.exists(os.path.join(path, "control")):
            _remove_contents(path)
    finally:
        os.close(fd)


def _check_path(path: object, tag: str) -> str:
    """path if it names segment tag of a sender's private directory (not opened yet)."""
    if not isinstance(path, str):
        raise InvalidHandleError(f"a segment path must be a string, not {type(path).__name__}")
    directory, name = os.path.split(path)
    if (
        name != tag
        or os.path.dirname(directory) != SHM_DIR
        or _DIR_NAME.fullmatch(os.path.basename(directory)) is None
    ):
        raise InvalidHandleError(
            f"{path!r:.200} is not the {tag} segment of an mmcache IPC sender "
            f"({SHM_DIR}/mmcache-<pid>-<token>/{tag})"
        )
    info = os.lstat(directory)  # FileNotFoundError: the sender is gone (or never was)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or stat.S_IMODE(info.st_mode) != _DIR_MODE
    ):
        raise InvalidHandleError(
            f"{directory} is not a private directory of this user's mmcache IPC senders "
            "(a directory of this user, mode 0700)"
        )
    return path


@final
class SharedSegment:
    """A file in SHM_DIR mapped shared into this process; the creator owns (unlinks) it."""

    __slots__ = ("_fd", "_mapping", "_tensor", "nbytes", "owner", "path", "writable")

    def __init__(
        self,
        path: str,
        fd: int,
        mapping: mmap.mmap,
        nbytes: int,
        owner: bool,
        writable: bool = True,
    ) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self.writable = writable
        self._fd = fd
        self._mapping: mmap.mmap | None = mapping
        self._tensor: torch.Tensor | None = None

    @classmethod
    def create(cls, directory: str, tag: str, nbytes: int) -> SharedSegment:
        """Create segment tag of nbytes in a sender's private directory.

        Its pages are reserved later, by commit().
        """
        path = os.path.join(directory, tag)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, _FILE_MODE)
        try:
            os.fchmod(fd, _FILE_MODE)
            # mmap refuses length 0; a one-byte file keeps the code free of special cases.
            os.ftruncate(fd, max(nbytes, 1))
            mapping = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, fd, mapping, nbytes, owner=True)

    @classmethod
    def attach(cls, path: str, tag: str, *, writable: bool = False) -> SharedSegment:
        """Map segment tag of another sender (or this process's), read-only unless writable.

        InvalidHandleError unless path is a segment a sender made (see the module's
        docstring), checked before it is opened where the path alone tells;
        FileNotFoundError if its directory or file is gone.
        """
        _check_path(path, tag)
        flags = os.O_RDWR if writable else os.O_RDONLY
        # NOFOLLOW: never through a link; NONBLOCK: a FIFO put there cannot hang the open.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if (
                not stat.S_ISREG(info.st_mode)
                or info.st_uid != os.getuid()
                or stat.S_IMODE(info.st_mode) != _FILE_MODE
                or info.st_size < 1
            ):
                raise InvalidHandleError(
                    f"{path} is not an mmcache IPC segment (a file of this user, mode 0600)"
                )
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, info.st_size, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mapping, info.st_size, owner=False, writable=writable)

    def tensor(self) -> torch.Tensor:
        """The segment as a flat uint8 tensor (the mapping lives as long as any view of it).

        A read-only segment's tensor is read-only memory: writing to it faults.
        """
        if self._tensor is None:
            if self._mapping is None:
                raise ValueError(f"shared segment {self.path} is closed")
            with warnings.catch_warnings():
                # torch warns that a read-only buffer gives a tensor it cannot write to:
                # that is the point.
                warnings.simplefilter("ignore", UserWarning)
                self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        return self._tensor

    def cells(self) -> memoryview:
        """The segment as int64 cells (8-byte aligned stores: never torn)."""
        if self._mapping is None:
            raise ValueError(f"shared segment {self.path} is closed")
        return memoryview(self._mapping).cast("q")

    def commit(self, offset: int, nbytes: int, hint: str) -> None:
        """Reserve the pages of [offset, offset+nbytes): SharedMemoryFullError if full."""
        reserve(self._fd, offset, nbytes, self.path, hint)

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

    def close(self) -> None:
        """Close the file; the mapping goes once the last tensor or view of it is gone."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # mmap.close() would fail while tensors view the mapping: let the last one unmap it.
        self._tensor = None
        self._mapping = None

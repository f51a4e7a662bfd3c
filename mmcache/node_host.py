"""NodeHost: one host tier for the ranks of a node (host_share="node"), in shared memory.

Every TP rank computes the same embedding of each image, so with a host tier per rank a
node holds each feature's bytes once per rank. With host_share="node" the ranks of a
group that run on one machine map one arena, a file in /dev/shm, and a NodeDirectory beside
it says which rank holds which block: a feature is copied to the host once, and each rank
uploads it into its own GPU from there.

At start the group's ranks exchange, by one all_gather queued before any lookup, which
machine each runs on (boot id and host name), its pid and host budget: the ranks of a
machine then name their segment after the lowest of them (`mmcache-node-<uid>-<cache
name>-<token>`), and its arena is the largest of their budgets. Files that no live rank
holds any more (a node that crashed) are removed at start; the last rank to close removes
its node's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import functools
import glob
import logging
import mmap
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, final

import torch

from mmcache.agreement import Agreement
from mmcache.device.base import Device, Fence
from mmcache.errors import CacheClosedError, SettingsError
from mmcache.ipc.shm import SHM_DIR, reserve
from mmcache.node_directory import (
    MAX_RANKS,
    DetachedError,
    NodeDirectory,
    NodeUsage,
    records_for,
)
from mmcache.node_pool import NodeHostPool
from mmcache.settings import CacheSettings

__all__ = ["NodeHost", "check_host_share", "node_files", "node_host_for"]

log = logging.getLogger("mmcache")

_PREFIX: Final = "mmcache-node-"
_ARENA: Final = ".arena"
_DIRECTORY: Final = ".dir"
_PAGE: Final = mmap.PAGESIZE


def check_host_share(settings: CacheSettings, group: object) -> None:
    """SettingsError where settings ask for the node's shared host tier without a group
    to share it with (or a group too large for it)."""
    if settings.host_share == "rank":
        return
    if group is None:
        raise SettingsError(
            f"{settings.how_to_change('host_share')}: host_share='node' shares one host tier "
            "among the ranks of a tensor-parallel group on one machine, and this cache has no "
            "group: pass FeatureCache(..., group=tp_group), or leave host_share='rank'"
        )
    import torch.distributed as dist

    size = dist.get_world_size(group)  # type: ignore[arg-type]
    if size > MAX_RANKS:
        raise SettingsError(
            f"{settings.how_to_change('host_share')}: host_share='node' takes groups of up "
            f"to {MAX_RANKS} ranks, not {size}; leave host_share='rank' for this group"
        )


def node_host_for(
    settings: CacheSettings, name: str, agreement: Agreement | None, device: Device
) -> NodeHost | None:
    """The node's shared host tier where settings ask for it and a group shares it (None:
    each rank its own; check_host_share refused the rest)."""
    if settings.host_share == "rank" or agreement is None:
        return None
    return NodeHost(name, agreement, device, settings.cpu_cache_bytes, settings.host_alignment)


def node_files(name: str | None = None) -> list[str]:
    """The node segments' files of this user in /dev/shm (of cache name, if given)."""
    pattern = f"{_PREFIX}{os.getuid()}-{_safe(name) + '-' if name is not None else ''}*"
    return sorted(glob.glob(os.path.join(SHM_DIR, pattern)))


@final
class NodeHost:
    """This rank's side of its node's shared host tier: open() maps it, close() leaves it."""

    def __init__(
        self, name: str, agreement: Agreement, device: Device, capacity: int, alignment: int
    ) -> None:
        self._name = name
        self._agreement = agreement
        self._device = device
        self._capacity = capacity
        self._alignment = alignment
        self.directory: NodeDirectory | None = None
        self._base = ""
        self._unpin: Callable[[], None] | None = None
        self._arena: torch.Tensor | None = None
        self._closed = False
        # close() and the attach thread's last step: a segment mapped after close() left
        # is left again by that thread, not kept until the process ends
        self._lock = threading.Lock()

    def open(
        self, on_arena: Callable[[torch.Tensor, int], object]
    ) -> concurrent.futures.Future[Any]:
        """Agree on the node's segment with the group (queued now, before any lookup), then
        map it (and pin it on a GPU) on a thread: the future of the arena. on_arena(arena,
        nbytes) is called once it is usable, from that thread."""
        arena: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        me = _whereabouts(self._capacity)
        gathered = self._agreement.gather_soon(me)

        def agreed(done: asyncio.Future[list[bytes]]) -> None:
            try:
                everyone = done.result()
            except BaseException as exc:
                arena.set_exception(exc)
                return
            threading.Thread(
                target=self._attach,
                args=(everyone, arena, on_arena),
                name=f"mmcache-node-{self._name}",
                daemon=True,
            ).start()

        gathered.add_done_callback(agreed)
        return arena

    def pool(
        self,
        arena: torch.Tensor,
        *,
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_free: Callable[[], None],
    ) -> NodeHostPool:
        """This rank's allocator over the node's arena."""
        assert self.directory is not None
        return NodeHostPool(
            self._device,
            arena,
            self.directory,
            alignment=self._alignment,
            defer=defer,
            on_free=on_free,
        )

    def usage(self) -> NodeUsage | None:
        """What the node's arena holds (None until attached, and once left)."""
        directory = self.directory
        if directory is None:
            return None
        try:
            return directory.usage()
        except DetachedError:  # stats() from another thread while close() left the node
            return None

    def close(self) -> None:
        """Release every block this rank holds and leave; the last rank removes the files.

        Called once the cache's copies have landed (a copy still reading the arena keeps its
        pages mapped: the mapping goes with the last view of it)."""
        with self._lock:
            self._closed = True
            directory, self.directory = self.directory, None
            unpin, self._unpin = self._unpin, None
            self._arena = None
        if directory is not None:
            self._leave(directory, unpin)

    # --- internals ------------------------------------------------------------------

    def _attach(
        self,
        everyone: list[bytes],
        done: concurrent.futures.Future[torch.Tensor],
        on_arena: Callable[[torch.Tensor, int], None],
    ) -> None:
        try:
            arena = self._map(everyone)
            on_arena(arena, arena.numel())
        except BaseException as exc:
            if not self._closed:
                log.error(
                    "cache %r: the node's shared host tier could not be set up: %s",
                    self._name,
                    exc,
                )
            done.set_exception(exc)
        else:
            done.set_result(arena)

    def _map(self, everyone: list[bytes]) -> torch.Tensor:
        """Open (or make) the node's directory and arena and map the arena."""
        rank = self._agreement.rank
        mine = everyone[rank].split(b"|")
        node = [i for i, other in enumerate(everyone) if other.split(b"|")[:2] == mine[:2]]
        leader = everyone[node[0]].split(b"|")
        capacity = max(int(everyone[i].split(b"|")[3]) for i in node)
        nbytes = capacity // _PAGE * _PAGE
        token = leader[2].decode()
        self._base = os.path.join(SHM_DIR, f"{_PREFIX}{os.getuid()}-{_safe(self._name)}-{token}")
        with _ATTACHING:  # ours before its files exist: a sibling's sweep passes them by
            if self._base in _ATTACHED_HERE:
                raise SettingsError(
                    f"cache {self._name!r}: another cache of this process is attached to the "
                    "same node host tier; a node shares one tier among processes, one rank each"
                )
            _ATTACHED_HERE.add(self._base)
            _remove_abandoned()
        arena_path = self._base + _ARENA

        def make_arena() -> None:  # under the directory's lock, by the first rank
            fd = os.open(arena_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, max(nbytes, 1))
                # Reserved now, never a SIGBUS on first touch: a full /dev/shm fails here.
                reserve(fd, 0, max(nbytes, 1), arena_path, "lower cpu_cache_mb")
            except BaseException:
                os.unlink(arena_path)
                raise
            finally:
                os.close(fd)

        try:
            directory = NodeDirectory.open(
                self._base + _DIRECTORY, rank, nbytes, records_for(nbytes), make_arena
            )
        except BaseException:
            with _ATTACHING:
                _ATTACHED_HERE.discard(self._base)
            raise
        unpin = None
        try:
            fd = os.open(arena_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            arena = torch.frombuffer(mapping, dtype=torch.uint8)[: min(size, nbytes)]
            index = self._device.cuda_index
            if index is not None:  # each process pins its own mapping for its GPU's copies
                from mmcache.ipc.cuda_ipc import pin_host

                unpin = pin_host(index, arena)
        except BaseException:
            self._leave(directory, None)
            raise
        with self._lock:
            if not self._closed:
                self.directory, self._unpin, self._arena = directory, unpin, arena
                return arena
        self._leave(directory, unpin)  # close() came first and found nothing to leave
        raise CacheClosedError(f"cache {self._name!r} closed while its node tier was set up")

    def _leave(self, directory: NodeDirectory, unpin: Callable[[], None] | None) -> None:
        """Give up this rank's blocks and its place in the node; the last rank removes the
        files."""
        directory.detach(functools.partial(_remove, self._base))
        with _ATTACHING:
            _ATTACHED_HERE.discard(self._base)
        if unpin is not None:
            unpin()


#: the node segments this process is attached to or attaching: a POSIX lock is the
#: process's (a lock of ours never conflicts with the sweep's), so the sweep of abandoned
#: segments must not open (and, closing, unlock) one of these
_ATTACHED_HERE: set[str] = set()
#: held to change _ATTACHED_HERE and throughout the sweep, so that none is added midway
_ATTACHING = threading.Lock()


def _whereabouts(capacity: int) -> bytes:
    """What this rank tells the others: its machine (boot id, host name), a token naming a
    node segment should it be the lowest rank of its machine, and its host budget."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    token = f"{os.getpid()}{secrets.token_hex(6)}"
    return f"{boot}|{socket.gethostname()}|{token}|{capacity}".encode()


def _safe(name: str) -> str:
    """A cache name as part of a file name: [A-Za-z0-9_.], at most 40 characters."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)[:40]


def _remove(base: str) -> None:
    for suffix in (_ARENA, _DIRECTORY):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base + suffix)


def _remove_abandoned() -> None:
    """Remove this user's node segments that no live rank holds (their ranks all died):
    one whose directory's lock and every rank's liveness byte can be taken at once (under
    _ATTACHING: the segments of this process are never taken for another's)."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}{os.getuid()}-*{_DIRECTORY}")):
        if path[: -len(_DIRECTORY)] in _ATTACHED_HERE:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1 + MAX_RANKS, 0)
        except OSError:
            os.close(fd)  # held: its node lives (or is being made)
            continue
        try:
            if os.fstat(fd).st_size > 0:  # an empty one is being made: its maker locks it next
                _remove(path[: -len(_DIRECTORY)])
        finally:
            os.close(fd)

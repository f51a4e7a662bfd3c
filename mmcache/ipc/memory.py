"""SenderMemory: the shared memory of one FeatureSender (its directory, pool and fallback)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from mmcache.closing import run_each
from mmcache.device import Device, Fence
from mmcache.errors import InvalidValueError
from mmcache.host_pool import Defer
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.cuda_ipc import CudaPool, pin_off_the_loop, unpin_after
from mmcache.ipc.handle import DeviceKind
from mmcache.ipc.pool import SliceArena
from mmcache.ipc.shm import PrivateDirectory, SharedSegment
from mmcache.settings import CacheSettings

__all__ = ["SenderMemory"]


class SenderMemory:
    """Makes and lets go of a sender's private directory, IPC pool and host fallback.

    pool and fallback are the arenas (None: not made, or let go); defer and on_free
    are what each arena frees through (bound once the sender's loop runs).
    """

    def __init__(
        self,
        device: Device,
        kind: DeviceKind,
        settings: CacheSettings,
        alignment: int,
    ) -> None:
        self._device = device
        self._kind = kind
        self.settings = settings
        self._alignment = alignment
        self.pool_bytes = settings.ipc_pool_bytes if settings.use_cuda_ipc else 0
        self.fallback_bytes = settings.ipc_fallback_bytes
        self.pool: SliceArena | None = None
        self.fallback: SliceArena | None = None
        self.dir: PrivateDirectory | None = None  # where the shared segments are
        self.pool_path = ""  # the simulator's pool segment
        self.fallback_path = ""
        self.cuda_pool: CudaPool | None = None
        self.unpin: Callable[[], None] | None = None
        self._segments: list[SharedSegment] = []
        self._sim_pool: torch.Tensor | None = None  # the simulator's adopted alias of the pool
        self._defer: Defer | None = None
        self._on_free: Callable[[], None] | None = None

    def open(
        self,
        defer: Defer,
        on_free: Callable[[], None],
    ) -> str:
        """Create the private directory (returned: its path); arenas free through defer, on_free."""
        self._defer, self._on_free = defer, on_free
        self.dir = PrivateDirectory()
        return self.dir.path

    def _arena(
        self,
        tensor: torch.Tensor,
        segment: SharedSegment | None = None,
        lazy_commit_hint: str | None = None,
    ) -> SliceArena:
        assert self._defer is not None and self._on_free is not None
        return SliceArena(
            tensor,
            self._device,
            alignment=self._alignment,
            defer=self._defer,
            on_free=self._on_free,
            segment=segment,
            lazy_commit_hint=lazy_commit_hint,
        )

    def _cuda_index(self) -> int:
        """The GPU the pool and the fallback's pinning are made on (a "cuda" device's)."""
        index = self._device.cuda_index
        if index is None:
            raise InvalidValueError(f"{self._device.name} offers no CUDA device for an IPC pool")
        return index

    async def make_pool(self, control_path: str) -> None:
        """Make the IPC pool: a shared segment on the simulator, CUDA IPC memory on a GPU."""
        self.pool = await self._make_pool(control_path)

    async def _make_pool(self, control_path: str) -> SliceArena:
        hint = f"lower {self.settings.env_name('ipc_pool_mb')}"
        if self._kind == "sim":
            assert self.dir is not None
            segment = SharedSegment.create(self.dir.path, "pool", self.pool_bytes)
            self._segments.append(segment)
            self.pool_path = segment.path
            segment.commit(0, self.pool_bytes, hint)
            alias = self._device.adopt(segment.tensor(), self._device.current_stream())
            self._sim_pool = alias
            self._device.poison_host(alias)  # fresh device memory holds garbage, never zeros
            return self._arena(alias)
        pool = CudaPool(self._cuda_index(), self.pool_bytes, control_path)
        self.cuda_pool = pool
        assert pool.tensor is not None
        return self._arena(pool.tensor)

    async def make_fallback(self) -> None:
        """Make the host fallback: a shared segment, pinned on a GPU."""
        self.fallback = await self._make_fallback()

    async def _make_fallback(self) -> SliceArena:
        hint = f"lower {self.settings.env_name('ipc_fallback_mb')}"
        assert self.dir is not None
        segment = SharedSegment.create(self.dir.path, "fallback", self.fallback_bytes)
        self._segments.append(segment)
        self.fallback_path = segment.path
        if self._kind == "sim":
            return self._arena(segment.tensor(), segment=segment, lazy_commit_hint=hint)
        # Pinned, the copies into it are asynchronous and run at full speed; pinning
        # touches every page, so reserve them all first (a clean error if /dev/shm is full).
        segment.commit(0, self.fallback_bytes, hint)
        tensor = segment.tensor()
        self.unpin = await pin_off_the_loop(self._cuda_index(), tensor)
        return self._arena(tensor)

    def teardown(
        self, control: ControlBlock | None, keep_pool: bool, copying: Sequence[Fence]
    ) -> Callable[[], None]:
        """Let go of control, the shared segments, the pool unless keep_pool (a receiver may
        still read it), and the fallback's pinning once copying (copies into it) have landed;
        return the blocking part of that (unlinking, freeing, unpinning), which close()
        runs on a thread of its own."""
        segments = list(self._segments)
        fallback = self.fallback.tensor if self.fallback is not None else None
        arenas = [self.pool, self.fallback]  # views of the segments: unmapped with the last
        self.pool = self.fallback = None
        sim_pool = cuda_pool = None
        if not keep_pool:
            sim_pool, self._sim_pool = self._sim_pool, None
            cuda_pool, self.cuda_pool = self.cuda_pool, None
        unpin, self.unpin = self.unpin, None
        in_flight = [f for f in copying if not f.done()]
        if unpin is not None and in_flight:
            assert fallback is not None
            unpin_after(in_flight, unpin, fallback)  # one never landing keeps it pinned
            unpin = None
        steps: list[Callable[[], object]] = []
        if control is not None:
            steps.append(functools.partial(control.close, unlink=True))  # marks it closed
        steps += [segment.unlink for segment in segments]
        if sim_pool is not None:
            steps.append(functools.partial(self._device.release, sim_pool, ()))
        if cuda_pool is not None:
            steps.append(cuda_pool.close)  # waits for the device, then frees
        if unpin is not None:
            steps.append(unpin)  # before the mapping goes
        steps += [segment.close for segment in segments]
        if self.dir is not None:
            steps.append(self.dir.remove)
        steps.append(arenas.clear)
        return functools.partial(run_each, steps)

"""CUDA side of the transport: the device pool and its IPC handle, ready events, pinning, peers.

torch's own IPC rebuild (torch.multiprocessing) opens a handle under a device
guard for the *sender's* GPU, which creates a CUDA context there (~500 MiB)
in a receiver that runs on another GPU. Here the handle is opened with
cuIpcOpenMemHandle in the receiver's own primary context (lazily enabling
peer access), and the mapping is wrapped as a tensor of the receiver's
device, so a receiver never touches the sender's GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import cast, final

import torch

from mmcache.closing import off_the_loop
from mmcache.device.base import Fence, Stream
from mmcache.device.cuda import as_cuda_stream
from mmcache.device.cuda_driver import CudaDriver
from mmcache.errors import MMCacheError
from mmcache.ipc.errors import NoPeerAccessError

__all__ = [
    "CudaPool",
    "PeerPool",
    "device_uuid",
    "ordinal_of",
    "pin_host",
    "tensor_at",
]

log = logging.getLogger("mmcache.ipc")


def _no_peer_access(ordinal: int, reason: str) -> NoPeerAccessError:
    return NoPeerAccessError(
        f"cuda:{ordinal} cannot map the sender's IPC pool ({reason}); "
        "run the receiver on a GPU with peer access to the sender's, or turn the "
        "transport off (MMCACHE_USE_CUDA_IPC=0) to send through host memory"
    )


def tensor_at(pointer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over memory torch did not allocate (it never frees it)."""
    storage = torch._C._construct_storage_from_data_pointer(pointer, device, nbytes)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    return empty.set_(cast(torch.UntypedStorage, storage), 0, (nbytes,), (1,))


def device_uuid(ordinal: int) -> str:
    """The UUID of GPU ordinal (stable across processes, unlike ordinals)."""
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def ordinal_of(uuid: str) -> int | None:
    """This process's ordinal of the GPU with uuid, or None if it is not visible here."""
    for ordinal in range(torch.cuda.device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    return None


def pin_host(ordinal: int, tensor: torch.Tensor, read_only: bool = False) -> Callable[[], None]:
    """Pin a host tensor's pages (slow: ~0.5 ms/MiB); return a callable that unpins them.

    read_only for memory mapped read-only (a receiver's view of a sender's fallback).
    """
    driver = CudaDriver.get()
    pointer, nbytes = tensor.data_ptr(), tensor.numel()
    # Out of memory: a plain MMCacheError.
    driver.host_register(ordinal, pointer, nbytes, read_only=read_only)

    def unpin() -> None:
        try:
            driver.host_unregister(ordinal, pointer)
        except MMCacheError as exc:
            log.warning("unpinning an IPC host arena failed: %s", str(exc))

    return unpin


async def pin_off_the_loop(
    ordinal: int, tensor: torch.Tensor, read_only: bool = False
) -> Callable[[], None]:
    """pin_host on a thread of its own. A pin its caller no longer takes (cancelled, or
    the loop closed) is undone once done; the mapping stays alive until then."""
    return await off_the_loop(
        functools.partial(pin_host, ordinal, tensor, read_only),
        abandoned=lambda unpin: unpin_later(unpin, tensor),
        name="mmcache-pin",
    )


def unpin_later(unpin: Callable[[], None], tensor: torch.Tensor) -> None:
    """unpin() on a thread of its own (a large range holds it a while: 0.24 ms per MiB on
    the H200), tensor (the pinned range's mapping) alive until it has returned."""
    threading.Thread(target=_unpin_holding, args=(unpin, tensor), name="mmcache-unpin").start()


def unpin_after(fences: Sequence[Fence], unpin: Callable[[], None], tensor: torch.Tensor) -> None:
    """unpin_later once every fence is done (copies into the pinned range still running)."""
    left = [len(fences)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            unpin_later(unpin, tensor)

    for fence in fences:
        fence.add_done_callback(one_done)


def _unpin_holding(unpin: Callable[[], None], tensor: torch.Tensor) -> None:
    unpin()


#: The pools of senders in this process: a receiver here uses them directly (CUDA
#: refuses to open an IPC handle in the process that exported it).
_LOCAL_POOLS: weakref.WeakValueDictionary[str, CudaPool] = weakref.WeakValueDictionary()


@final
class CudaPool:
    """The sender's IPC pool: one cuMemAlloc allocation, its IPC handle, one IPC event per slot."""

    def __init__(self, ordinal: int, nbytes: int, control_path: str) -> None:
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        driver = CudaDriver.get()
        self._pointer = driver.mem_alloc(ordinal, nbytes)
        try:
            self.ipc_handle = driver.ipc_get_mem_handle(ordinal, self._pointer)
            self.tensor: torch.Tensor | None = tensor_at(self._pointer, nbytes, self.device)
        except BaseException:
            driver.mem_free(ordinal, self._pointer)
            raise
        self.uuid = device_uuid(ordinal)
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}
        self.events_by_handle: dict[bytes, torch.cuda.Event] = {}
        _LOCAL_POOLS[control_path] = self

    def record_ready(self, slot: int, stream: Stream) -> bytes:
        """Record slot's IPC event on stream (after the copy into it); return the event's handle."""
        cuda_stream = as_cuda_stream(stream)
        pair = self._events.get(slot)
        if pair is None:
            event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            event.record(cuda_stream)
            handle = bytes(event.ipc_handle())  # type: ignore[no-untyped-call]
            self._events[slot] = (event, handle)
            self.events_by_handle[handle] = event
            return handle
        event, handle = pair
        event.record(cuda_stream)
        return handle

    def close(self) -> None:
        """Free the pool once the GPU is done with it (call after every lease ended)."""
        if self.tensor is None:
            return
        torch.cuda.synchronize(self.device)
        self.tensor = None
        self._events.clear()
        self.events_by_handle.clear()
        CudaDriver.get().mem_free(self.ordinal, self._pointer)


@final
class PeerPool:
    """A sender's pool as one receiver sees it: mapped once into the receiver's own context."""

    def __init__(
        self, control_path: str, sender_pid: int, ipc_handle: bytes, nbytes: int, ordinal: int
    ) -> None:
        self.ordinal = ordinal
        self._device = torch.device("cuda", ordinal)
        self._events: dict[bytes, torch.cuda.Event | None] = {}
        self._local = _LOCAL_POOLS.get(control_path) if sender_pid == os.getpid() else None
        self._pointer = 0
        if self._local is not None:
            tensor = self._local.tensor
            if tensor is None:
                raise NoPeerAccessError("the sender of this handle closed its IPC pool")
            self.tensor = tensor
            return
        self._pointer = CudaDriver.get().ipc_open_mem_handle(
            ordinal, ipc_handle, functools.partial(_no_peer_access, ordinal)
        )
        self.tensor = tensor_at(self._pointer, nbytes, self._device)

    def event(self, handle: bytes) -> torch.cuda.Event | None:
        """The sender's ready event for a slot, opened once; None if it cannot be opened here."""
        if self._local is not None:
            return self._local.events_by_handle.get(handle)
        if handle in self._events:
            return self._events[handle]
        event: torch.cuda.Event | None
        try:
            # Opened under the receiver's device: no guard ever switches to the sender's GPU.
            event = torch.cuda.Event.from_ipc_handle(self._device, handle)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            log.warning(
                "cannot open the sender's IPC event on %s (%s); polling instead", self._device, exc
            )
            event = None
        self._events[handle] = event
        return event

    def close(self) -> None:
        """Unmap the pool (after every copy out of it has completed)."""
        self._events.clear()
        if self._pointer:
            torch.cuda.synchronize(self._device)
            CudaDriver.get().ipc_close_mem_handle(self.ordinal, self._pointer)
            self._pointer = 0

"""CUDA side of the transport: the device pool and its IPC handle, ready events, pinning, peers.

torch's own IPC rebuild (torch.multiprocessing) opens a handle under a device
guard for the *sender's* GPU, which creates a CUDA context there (~500 MiB)
in a receiver that runs on another GPU. Here the handle is opened with
cuIpcOpenMemHandle in the receiver's own primary context (lazily enabling
peer access), and the mapping is wrapped as a tensor of the receiver's
device, so a receiver never touches the sender's GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Final, cast, final

import torch

from mmcache.device.base import Stream
from mmcache.device.cuda import as_cuda_stream
from mmcache.errors import DeviceOutOfMemoryError, MMCacheError
from mmcache.ipc.errors import NoPeerAccessError

__all__ = [
    "CudaPool",
    "Driver",
    "PeerPool",
    "device_uuid",
    "ordinal_of",
    "pin_host",
    "tensor_at",
]

log = logging.getLogger("mmcache.ipc")

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 0x1
_CU_MEMHOSTREGISTER_PORTABLE: Final = 0x1
_CUDA_ERROR_OUT_OF_MEMORY: Final = 2
_MiB: Final = 1 << 20


class _IpcMemHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


@final
class Driver:
    """The CUDA driver calls the transport needs that torch does not expose (one per process)."""

    _instance: ClassVar[Driver | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls) -> Driver:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u64, size_t = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        uint, cint, ptr = ctypes.c_uint, ctypes.c_int, ctypes.POINTER
        signatures: dict[str, list[Any]] = {
            "cuInit": [uint],
            "cuDeviceGet": [ptr(cint), cint],
            "cuDevicePrimaryCtxRetain": [ptr(vp), cint],
            "cuDevicePrimaryCtxGetState": [cint, ptr(uint), ptr(cint)],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ptr(vp)],
            "cuMemAlloc_v2": [ptr(u64), size_t],
            "cuMemFree_v2": [u64],
            "cuIpcGetMemHandle": [ptr(_IpcMemHandle), u64],
            "cuIpcOpenMemHandle_v2": [ptr(u64), _IpcMemHandle, uint],
            "cuIpcCloseMemHandle": [u64],
            "cuMemHostRegister_v2": [vp, size_t, uint],
            "cuMemHostUnregister": [vp],
            "cuGetErrorString": [cint, ptr(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            func = getattr(lib, name)
            func.argtypes = argtypes
            func.restype = cint
        self._lib = lib
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._check(lib.cuInit(0), "cuInit")

    def primary_context_active(self, ordinal: int) -> bool:
        """True if this process has a CUDA context on GPU ordinal (creates none)."""
        device = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        flags, active = ctypes.c_uint(), ctypes.c_int()
        self._check(
            self._lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)),
            "cuDevicePrimaryCtxGetState",
        )
        return bool(active.value)

    def mem_alloc(self, ordinal: int, nbytes: int) -> int:
        """cuMemAlloc on GPU ordinal: a whole allocation of its own (IPC shares allocations)."""
        out = ctypes.c_uint64()
        with self._current(ordinal):
            code = self._lib.cuMemAlloc_v2(ctypes.byref(out), nbytes)
        if code == _CUDA_ERROR_OUT_OF_MEMORY:
            raise DeviceOutOfMemoryError(
                f"could not allocate the {nbytes / _MiB:.1f} MiB IPC pool on cuda:{ordinal}; "
                "lower MMCACHE_IPC_POOL_MB (SGLANG_MM_FEATURE_CACHE_MB)"
            )
        self._check(code, "cuMemAlloc")
        return int(out.value)

    def mem_free(self, ordinal: int, pointer: int) -> None:
        with self._current(ordinal):
            self._check(self._lib.cuMemFree_v2(pointer), "cuMemFree")

    def ipc_get_mem_handle(self, ordinal: int, pointer: int) -> bytes:
        handle = _IpcMemHandle()
        with self._current(ordinal):
            self._check(
                self._lib.cuIpcGetMemHandle(ctypes.byref(handle), pointer), "cuIpcGetMemHandle"
            )
        return bytes(handle)

    def ipc_open_mem_handle(self, ordinal: int, handle: bytes) -> int:
        """Map another process's allocation into GPU ordinal's context; return its address."""
        raw = _IpcMemHandle.from_buffer_copy(handle)
        out = ctypes.c_uint64()
        with self._current(ordinal):
            code = self._lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(out), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            )
        if code != 0:
            raise NoPeerAccessError(
                f"cuda:{ordinal} cannot map the sender's IPC pool ({self._error(code)}); "
                "run the receiver on a GPU with peer access to the sender's, or turn the "
                "transport off (MMCACHE_USE_CUDA_IPC=0) to send through host memory"
            )
        return int(out.value)

    def ipc_close_mem_handle(self, ordinal: int, pointer: int) -> None:
        with self._current(ordinal):
            self._check(self._lib.cuIpcCloseMemHandle(pointer), "cuIpcCloseMemHandle")

    def host_register(self, ordinal: int, pointer: int, nbytes: int) -> None:
        """Pin host memory for every context of this process (portable)."""
        with self._current(ordinal):
            code = self._lib.cuMemHostRegister_v2(pointer, nbytes, _CU_MEMHOSTREGISTER_PORTABLE)
        self._check(code, "cuMemHostRegister")

    def host_unregister(self, ordinal: int, pointer: int) -> None:
        with self._current(ordinal):
            self._check(self._lib.cuMemHostUnregister(pointer), "cuMemHostUnregister")

    @contextlib.contextmanager
    def _current(self, ordinal: int) -> Iterator[None]:
        # Only ever the caller's own GPU: retaining another GPU's primary context creates it.
        with self._lock:
            context = self._contexts.get(ordinal)
            if context is None:
                device = ctypes.c_int()
                self._check(self._lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
                context = ctypes.c_void_p()
                self._check(
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                    "cuDevicePrimaryCtxRetain",
                )
                self._contexts[ordinal] = context
        self._check(self._lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def _error(self, code: int) -> str:
        text = ctypes.c_char_p()
        self._lib.cuGetErrorString(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUresult {code}"

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise MMCacheError(f"{call} failed: {self._error(code)}")


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


def pin_host(ordinal: int, tensor: torch.Tensor) -> Callable[[], None]:
    """Pin a host tensor's pages (slow: ~0.5 ms/MiB); return a callable that unpins them."""
    driver = Driver.get()
    pointer, nbytes = tensor.data_ptr(), tensor.numel()
    driver.host_register(ordinal, pointer, nbytes)

    def unpin() -> None:
        try:
            driver.host_unregister(ordinal, pointer)
        except MMCacheError as exc:
            log.warning("unpinning an IPC host arena failed: %s", exc)

    return unpin


#: The pools of senders in this process: a receiver here uses them directly (CUDA
#: refuses to open an IPC handle in the process that exported it).
_LOCAL_POOLS: weakref.WeakValueDictionary[str, CudaPool] = weakref.WeakValueDictionary()


@final
class CudaPool:
    """The sender's IPC pool: one cuMemAlloc allocation, its IPC handle, one IPC event per slot."""

    def __init__(self, ordinal: int, nbytes: int, control_path: str) -> None:
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        driver = Driver.get()
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
        Driver.get().mem_free(self.ordinal, self._pointer)


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
        self._pointer = Driver.get().ipc_open_mem_handle(ordinal, ipc_handle)
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
            Driver.get().ipc_close_mem_handle(self.ordinal, self._pointer)
            self._pointer = 0

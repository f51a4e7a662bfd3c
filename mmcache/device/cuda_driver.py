"""The CUDA driver calls torch does not expose: pinned host memory, IPC memory handles and
batched copies.

One binding per process, shared by the device (its pinned arena) and the IPC transport
(its pool, its shared host buffers). Every call runs with the primary context of the
GPU it names pushed: torch runs on those contexts, and pushing one explicitly lets any
thread (a pinning thread, a finaliser) call the driver without touching the runtime's
per-thread device.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Final, final

from mmcache.errors import CopyFailedError, DeviceOutOfMemoryError, MMCacheError

__all__ = ["BatchCopier", "CudaDriver"]

_CU_MEMHOSTALLOC_PORTABLE: Final = 0x1
_CU_MEMHOSTREGISTER_PORTABLE: Final = 0x1
_CU_MEMHOSTREGISTER_READ_ONLY: Final = 0x8  # the range is mapped read-only (CUDA 11.1+)
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 0x1
_CUDA_ERROR_OUT_OF_MEMORY: Final = 2
_CUDA_ERROR_NOT_READY: Final = 600
_CU_STREAM_NON_BLOCKING: Final = 0x1
_CU_EVENT_SLEEPS: Final = 0x1 | 0x2  # CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: Final = 0x1
_CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: Final = 0x1  # copy engines, not SMs
_CU_MEM_LOCATION_TYPE_DEVICE: Final = 0x1
_CU_MEM_LOCATION_TYPE_HOST: Final = 0x2
_BATCH_COPY_SINCE: Final = 12080  # cuMemcpyBatchAsync: CUDA 12.8
_MiB: Final = 1 << 20


class _IpcMemHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class _MemLocation(ctypes.Structure):
    """CUmemLocation."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@final
class CudaDriver:
    """libcuda through ctypes; get() returns the process's one instance."""

    _instance: ClassVar[CudaDriver | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls) -> CudaDriver:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        # The runtime itself loads the driver under exactly this name, so it is always found.
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u64, size_t = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        uint, cint, ptr = ctypes.c_uint, ctypes.c_int, ctypes.POINTER
        signatures: dict[str, list[Any]] = {
            "cuInit": [uint],
            "cuDriverGetVersion": [ptr(cint)],
            "cuDeviceGet": [ptr(cint), cint],
            "cuDevicePrimaryCtxRetain": [ptr(vp), cint],
            "cuDevicePrimaryCtxGetState": [cint, ptr(uint), ptr(cint)],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ptr(vp)],
            "cuMemHostAlloc": [ptr(vp), size_t, uint],
            "cuMemFreeHost": [vp],
            "cuMemHostRegister_v2": [vp, size_t, uint],
            "cuMemHostUnregister": [vp],
            "cuMemAlloc_v2": [ptr(u64), size_t],
            "cuMemFree_v2": [u64],
            "cuIpcGetMemHandle": [ptr(_IpcMemHandle), u64],
            "cuIpcOpenMemHandle_v2": [ptr(u64), _IpcMemHandle, uint],
            "cuIpcCloseMemHandle": [u64],
            "cuGetErrorString": [cint, ptr(ctypes.c_char_p)],
            "cuStreamCreate": [ptr(vp), uint],
            "cuStreamDestroy_v2": [vp],
            "cuStreamWaitEvent": [vp, vp, uint],
            "cuEventCreate": [ptr(vp), uint],
            "cuEventRecord": [vp, vp],
            "cuEventQuery": [vp],
            "cuEventSynchronize": [vp],
            "cuEventDestroy_v2": [vp],
        }
        for name, argtypes in signatures.items():
            func = getattr(lib, name)
            func.argtypes = argtypes
            func.restype = cint
        # The same library with the GIL kept through each call, for calls that only queue
        # work or read state. A call through `lib` lets go of the GIL and takes it back
        # after; with fence waiter threads waiting for it, the taking back can wait for
        # one of them to run (a hand-over each). Calls that block stay on `lib`. The
        # trade: should one of these wait on a driver lock that a long call on another
        # thread holds (pinning the arena, freeing pinned memory), every Python thread
        # waits with it, not only the caller. The cache makes most of them once its arena
        # is pinned (offloads and promotions wait for it).
        held = ctypes.PyDLL("libcuda.so.1")
        for name in (
            "cuCtxPushCurrent_v2",
            "cuCtxPopCurrent_v2",
            "cuStreamWaitEvent",
            "cuEventRecord",
            "cuEventQuery",
        ):
            func = getattr(held, name)
            func.argtypes = signatures[name]
            func.restype = cint
        self._lib = lib
        self._held = held
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._check(lib.cuInit(0), "cuInit")
        version = ctypes.c_int()
        self._check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = f"{version.value // 1000}.{version.value % 1000 // 10}"
        self._batch_copy, self._batch_fail_index = _bind_batch_copy(held, version.value)

    # --- pinned host memory -----------------------------------------------------------

    def host_alloc(self, ordinal: int, nbytes: int) -> int:
        """cuMemHostAlloc: nbytes of pinned, portable host memory; return its address."""
        out = ctypes.c_void_p()
        with self._current(ordinal):
            code = self._lib.cuMemHostAlloc(ctypes.byref(out), nbytes, _CU_MEMHOSTALLOC_PORTABLE)
        self._check_pin(code, "cuMemHostAlloc", nbytes, "MMCACHE_CPU_CACHE_MB")
        assert out.value is not None
        return out.value

    def free_host(self, ordinal: int, pointer: int) -> None:
        """cuMemFreeHost."""
        with self._current(ordinal):
            self._check(self._lib.cuMemFreeHost(pointer), "cuMemFreeHost")

    def host_register(
        self,
        ordinal: int,
        pointer: int,
        nbytes: int,
        setting: str | None = None,
        *,
        read_only: bool = False,
    ) -> None:
        """cuMemHostRegister: pin an existing range for every context (portable).

        read_only pins a range mapped read-only (the device only reads it). Out of
        memory names setting (the one to lower) when given, else it is a plain
        MMCacheError like any other failure.
        """
        flags = _CU_MEMHOSTREGISTER_PORTABLE
        if read_only:
            flags |= _CU_MEMHOSTREGISTER_READ_ONLY
        with self._current(ordinal):
            code = self._lib.cuMemHostRegister_v2(pointer, nbytes, flags)
        self._check_pin(code, "cuMemHostRegister", nbytes, setting)

    def host_unregister(self, ordinal: int, pointer: int) -> None:
        """cuMemHostUnregister."""
        with self._current(ordinal):
            self._check(self._lib.cuMemHostUnregister(pointer), "cuMemHostUnregister")

    # --- sleeping until an event -------------------------------------------------------

    def sleeper(self, ordinal: int) -> FenceSleeper:
        """A FenceSleeper on GPU ordinal (a stream and a blocking-sync event of its own)."""
        stream, event = ctypes.c_void_p(), ctypes.c_void_p()
        with self._current(ordinal):
            self._check(
                self._lib.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )
            code = self._lib.cuEventCreate(ctypes.byref(event), _CU_EVENT_SLEEPS)
            if code != 0:
                self._lib.cuStreamDestroy_v2(stream)
                self._check(code, "cuEventCreate")
        return FenceSleeper(self, ordinal, stream, event)

    # --- batched copies ---------------------------------------------------------------

    def batch_copier(self, ordinal: int, direction: str = "d2h") -> BatchCopier | None:
        """Copies of GPU ordinal in one direction ("d2h": to pinned host memory, "h2d": from
        it, "d2d": within the GPU), many in one call; None before CUDA 12.8."""
        if self._batch_copy is None:
            return None
        return BatchCopier(self, self._context(ordinal), ordinal, direction)

    # --- device memory shared across processes ----------------------------------------

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

    def ipc_open_mem_handle(
        self, ordinal: int, handle: bytes, refused: Callable[[str], Exception]
    ) -> int:
        """Map another process's allocation into GPU ordinal's context; return its address.

        A refusal raises refused(the driver's reason): the caller says what it means.
        """
        raw = _IpcMemHandle.from_buffer_copy(handle)
        out = ctypes.c_uint64()
        with self._current(ordinal):
            code = self._lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(out), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            )
        if code != 0:
            raise refused(self._error(code))
        return int(out.value)

    def ipc_close_mem_handle(self, ordinal: int, pointer: int) -> None:
        with self._current(ordinal):
            self._check(self._lib.cuIpcCloseMemHandle(pointer), "cuIpcCloseMemHandle")

    def _error(self, code: int) -> str:
        text = ctypes.c_char_p()
        self._lib.cuGetErrorString(code, ctypes.byref(text))
        return text.value.decode() if text.value else f"CUresult {code}"

    # --- internals --------------------------------------------------------------------

    def _context(self, ordinal: int) -> ctypes.c_void_p:
        """GPU ordinal's primary context.

        Only ever the caller's own GPU: retaining another GPU's primary context creates it.
        Retained once and never released, which keeps torch's context alive too.
        """
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
            return context

    @contextlib.contextmanager
    def _current(self, ordinal: int) -> Iterator[None]:
        context = self._context(ordinal)
        self._check(self._lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def _check_pin(self, code: int, call: str, nbytes: int, setting: str | None) -> None:
        if code == _CUDA_ERROR_OUT_OF_MEMORY and setting is not None:
            raise DeviceOutOfMemoryError(
                f"{call} could not pin {nbytes / _MiB:.1f} MiB of host memory "
                f"({self._error(code)}); lower {setting} or free host memory"
            )
        self._check(code, call)

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise MMCacheError(f"{call} failed: {self._error(code)}")


def _bind_batch_copy(lib: ctypes.CDLL, version: int) -> tuple[Any, bool]:
    """(cuMemcpyBatchAsync, whether it takes failIdx), or (None, False) before CUDA 12.8.

    CUDA 13 dropped the failIdx argument and exports that signature as _v2; the old name
    keeps the 12.8 one.
    """
    vp, size_t = ctypes.c_void_p, ctypes.c_size_t
    args: list[Any] = [vp, vp, vp, size_t, vp, vp, size_t]
    func = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    fail_index = False
    if func is None and version >= _BATCH_COPY_SINCE:
        func = getattr(lib, "cuMemcpyBatchAsync", None)
        fail_index = True
        args.append(vp)
    if func is None:
        return None, False
    func.argtypes = [*args, vp]
    func.restype = ctypes.c_int
    return func, fail_index


@final
class BatchCopier:
    """cuMemcpyBatchAsync between one GPU's memory and pinned host memory, or within the GPU.

    One driver call queues every range of a batch, where torch queues one copy per copy_
    call, and needs no gather kernel in front of it: less host time per batch than
    torch.cat and one copy_ (BENCHMARKS.md).
    """

    __slots__ = ("_attrs", "_call", "_context", "_driver", "_fail_index", "_index")

    def __init__(
        self, driver: CudaDriver, context: ctypes.c_void_p, ordinal: int, direction: str
    ) -> None:
        self._driver = driver
        self._call = driver._batch_copy
        self._fail_index = driver._batch_fail_index
        self._context = context
        # One set of attributes for every copy, read in stream order. Copies across the
        # bus go on copy engines rather than SMs (compute runs beside them); copies within
        # the GPU state no preference, leaving the choice to the driver.
        if direction not in ("d2h", "h2d", "d2d"):
            raise ValueError(f"direction must be 'd2h', 'h2d' or 'd2d', not {direction!r}")
        gpu = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
        host = _MemLocation(_CU_MEM_LOCATION_TYPE_HOST, 0)
        src, dst = (host, gpu) if direction == "h2d" else (gpu, gpu if direction == "d2d" else host)
        flags = 0 if direction == "d2d" else _CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self._attrs = _MemcpyAttributes(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, flags)
        self._index = (ctypes.c_size_t * 1)(0)

    def copy(
        self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int
    ) -> None:
        """Queue sizes[i] bytes from address srcs[i] to address dsts[i] on stream.

        Raises CopyFailedError if the driver refuses the batch (nothing is then known to be
        queued; copying the same ranges again is harmless).
        """
        n = len(sizes)
        u64, size_t = ctypes.c_uint64, ctypes.c_size_t
        args: list[Any] = [
            (u64 * n)(*dsts),
            (u64 * n)(*srcs),
            (size_t * n)(*sizes),
            n,
            ctypes.byref(self._attrs),
            self._index,
            1,
        ]
        if self._fail_index:
            args.append(ctypes.byref(size_t()))
        lib = self._driver._held  # it only queues: keep the GIL (see CudaDriver.__init__)
        # Any thread: the stream's context is made current for the call, as _current does.
        code = lib.cuCtxPushCurrent_v2(self._context)
        if code == 0:
            try:
                code = self._call(*args, stream)
            finally:
                lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        if code != 0:
            reason = self._driver._error(code)
            raise CopyFailedError(f"cuMemcpyBatchAsync of {n} copies failed: {reason}")


class FenceSleeper:
    """Puts one thread to sleep until an event completes, without spinning a core.

    The events of fences are not blocking-sync events: with about 56 of those pending on
    one stream, the next record on it blocks the host until the oldest completes
    (BENCHMARKS.md), and a put records one on its producer's stream, which an encoder
    may keep busy for tens of ms. Instead the sleeping thread queues a wait for the
    fence's event on a stream of its own and sleeps on its one blocking-sync event
    recorded behind it: one such event per thread is ever pending. Only the sleep
    itself lets go of the GIL: the thread takes it back once per fence, not once per
    driver call (each taking can make the event loop's thread wait for it).
    """

    __slots__ = ("_driver", "_event", "_ordinal", "_stream")

    def __init__(
        self, driver: CudaDriver, ordinal: int, stream: ctypes.c_void_p, event: ctypes.c_void_p
    ) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self._stream: ctypes.c_void_p | None = stream
        self._event = event

    def sleep_until(self, event: int) -> None:
        """Block until the work before event (a CUevent, e.g. torch's cuda_event) is done.

        Returns at once if it is done already. Raises MMCacheError if the work before it
        failed (a sticky error of the context).
        """
        stream = self._stream
        if stream is None:
            raise MMCacheError("this FenceSleeper was closed")
        driver = self._driver
        held, check = driver._held, driver._check
        code = held.cuEventQuery(event)
        if code == _CUDA_ERROR_NOT_READY:
            check(held.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")
            check(held.cuEventRecord(self._event, stream), "cuEventRecord")
            check(driver._lib.cuEventSynchronize(self._event), "cuEventSynchronize")
            code = held.cuEventQuery(event)
        check(code, "cuEventQuery")

    def close(self) -> None:
        """Destroy the stream and the event (once nothing waits on them)."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        with self._driver._current(self._ordinal):
            self._driver._lib.cuEventDestroy_v2(self._event)
            self._driver._lib.cuStreamDestroy_v2(stream)

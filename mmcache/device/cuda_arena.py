"""The pinned host arena of one GPU: pinned once, in chunks, in the foreground or background."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final, Literal, cast, final

import torch

from mmcache.device.base import PIN_PACE, ArenaProgress
from mmcache.device.cuda_driver import CudaDriver
from mmcache.errors import CacheClosedError, InvalidValueError, MMCacheError

__all__ = ["DEFAULT_PIN_CHUNK_BYTES", "PAGE", "ArenaMethod", "PinnedArena"]

_log = logging.getLogger(__name__)

#: "register": cuMemHostRegister of an anonymous mapping, chunk by chunk (default).
#: "hostalloc": one cuMemHostAlloc call (one region, no chunk boundaries).
ArenaMethod = Literal["register", "hostalloc"]

_MiB: Final = 1 << 20
# Pinning holds a driver lock that every kernel launch and event record in the process
# waits for, and pinning a whole arena at once would hold a launch for as long as that
# takes. In small chunks with a pause between them (a waiter gets the lock only if the
# pinning thread lets go for a moment), a launch waits for one chunk at most
# (BENCHMARKS.md); while the cache has pinned room ahead, the pauses are PIN_PACE times
# a chunk's pinning.
DEFAULT_PIN_CHUNK_BYTES: Final = 8 * _MiB
_PIN_PAUSE_S: Final = 0.0005  # between chunks pinned in the background
# A paced pause at most: a registration that waited long for the driver's lock (the
# engine capturing graphs, say) must not hold back the chunks a put will soon need.
_PACED_PAUSE_MAX_S: Final = 0.05
_HUGE_PAGE: Final = 2 * _MiB
PAGE: Final = mmap.PAGESIZE
_MADV_POPULATE_WRITE: Final = 23  # Linux 5.14+


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes (which lets go of the GIL while it runs), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], madvise)


def _populate(ptr: int, nbytes: int) -> None:
    """Fault in the fresh pages of [ptr, ptr + nbytes) before they are registered.

    The kernel zero-fills a fresh page when it is first touched; left to cuMemHostRegister,
    that work runs under the driver's lock, which every kernel launch and event record of
    the process waits for. Best effort: where the kernel lacks MADV_POPULATE_WRITE (before
    5.14) the registration faults them in as before.
    """
    madvise = _madvise()
    if madvise is not None:
        madvise(ptr, nbytes, _MADV_POPULATE_WRITE)


def _release_registered(
    driver: CudaDriver, ordinal: int, ptrs: tuple[int, ...], mapping: mmap.mmap
) -> None:
    """Unregister an arena's chunks; the mapping itself lives on while tensors view it."""
    for ptr in ptrs:
        try:
            driver.host_unregister(ordinal, ptr)
        except MMCacheError as exc:
            _log.warning("unpinning the host arena failed: %s", str(exc))
    del mapping


def _free_host(driver: CudaDriver, ordinal: int, ptr: int) -> None:
    """Free a cuMemHostAlloc arena once no tensor views it."""
    try:
        driver.free_host(ordinal, ptr)
    except MMCacheError as exc:
        _log.warning("freeing the pinned host arena failed: %s", str(exc))


@final
class PinnedArena:
    """The host arena: allocated once, pinned for the GPU, and the chunks it was pinned in."""

    __slots__ = (
        "__weakref__",
        "_claimed",
        "_closed",
        "_driver",
        "_finalizer",
        "_index",
        "_name",
        "_nbytes",
        "_pin_thread",
        "_ptr",
        "_split_chunk",
        "_stop",
        "background_pinning",
        "huge_pages",
        "method",
        "pin_chunk_bytes",
    )

    def __init__(
        self,
        name: str,
        index: int,
        driver: Callable[[], CudaDriver],
        *,
        method: ArenaMethod,
        background_pinning: bool,
        pin_chunk_bytes: int,
        huge_pages: bool,
    ) -> None:
        self._name = name
        self._index = index
        self._driver = driver  # loads the driver binding at the first pinning
        self.method: ArenaMethod = method
        self.background_pinning = background_pinning
        self.pin_chunk_bytes = pin_chunk_bytes
        self.huge_pages = huge_pages
        self._claimed = False
        self._ptr = 0
        self._nbytes = 0
        self._split_chunk = 0  # chunk size copies are split at; 0 = one registration
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pin_thread: threading.Thread | None = None
        self._closed = False
        self._stop = threading.Event()  # set with _closed: a pause between chunks ends early

    @property
    def ptr(self) -> int:
        """The arena's host address (0 until allocated)."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        """The arena's size (0 until allocated)."""
        return self._nbytes

    def host_arena(self, nbytes: int) -> torch.Tensor:
        """Allocate and pin the host arena, once: a flat uint8 tensor of nbytes."""
        self._claim(nbytes)
        return self._allocate(nbytes)

    def host_arena_async(
        self, nbytes: int, on_pinned: ArenaProgress | None = None
    ) -> concurrent.futures.Future[torch.Tensor]:
        """Pin the host arena on a background thread (pinning is slow): a future of
        host_arena(); on_pinned(arena, ready) after each chunk of a "register" arena."""
        self._claim(nbytes)
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()

        def pin() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                arena = self._allocate(nbytes, pause_s=_PIN_PAUSE_S, on_pinned=on_pinned)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(arena)

        thread = threading.Thread(target=pin, name=f"mmcache-pin-{self._name}", daemon=True)
        self._pin_thread = thread
        thread.start()
        return future

    def contains(self, host: torch.Tensor) -> bool:
        """Whether host is a contiguous range of the arena (what batched copies, which
        address bytes, may target)."""
        start = host.data_ptr() - self._ptr
        return (
            self._nbytes > 0
            and 0 <= start
            and start + host.numel() <= self._nbytes
            and host.is_contiguous()
        )

    def chunk_pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Byte ranges of the host range at ptr that each lie in one registered chunk, relative
        to ptr; None if it needs no split."""
        chunk = self._split_chunk
        if chunk == 0:
            return None
        start = ptr - self._ptr
        stop = start + nbytes
        if start < 0 or stop > self._nbytes:
            return None
        first, last = start // chunk, (stop - 1) // chunk
        if first == last:
            return None
        edges = [start, *(k * chunk for k in range(first + 1, last + 1)), stop]
        return [(a - start, b - start) for a, b in itertools.pairwise(edges)]

    def stop_pinning(self) -> None:
        """Refuse a new arena and end a background pinning (it stops at its next chunk)."""
        self._closed = True
        self._stop.set()
        if self._pin_thread is not None:
            self._pin_thread.join()

    def unpin(self) -> None:
        """Unpin a registered arena: its memory stays valid (pageable) for views still alive.

        A cuMemHostAlloc arena cannot be freed under them: it is freed when its last view goes.
        """
        if self._finalizer is not None and self.method == "register":
            self._finalizer()

    def _claim(self, nbytes: int) -> None:
        if self._closed:
            raise CacheClosedError(f"{self._name}: the device was closed")
        if nbytes < 0:
            raise InvalidValueError(f"host arena size must be >= 0, not {nbytes}")
        if self._claimed:
            raise MMCacheError(
                f"{self._name}: the host arena was already allocated (it is made once)"
            )
        self._claimed = True

    def _allocate(
        self, nbytes: int, pause_s: float = 0.0, on_pinned: ArenaProgress | None = None
    ) -> torch.Tensor:
        """Pin nbytes of host memory; a "register" arena chunk by chunk, pause_s between
        chunks (so the process's other driver calls get the driver's lock in between),
        reporting each chunk to on_pinned so that its bytes serve before the rest; where
        on_pinned says there is no hurry, the pause is PIN_PACE times the chunk's pinning."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        driver = self._driver()
        if self.method == "hostalloc":
            ptr = driver.host_alloc(self._index, nbytes)
            buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
            arena = torch.frombuffer(buffer, dtype=torch.uint8)
            # Freed only when the last view of the buffer goes: never under a live tensor.
            weakref.finalize(buffer, _free_host, driver, self._index, ptr).atexit = False
            self.pin_chunk_bytes = nbytes
            self._ptr, self._nbytes = ptr, nbytes
            return arena
        chunk = self.pin_chunk_bytes
        size = -(-nbytes // PAGE) * PAGE
        # Over-map by one huge page so the arena can start on a 2 MiB boundary.
        mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        offset = -whole.data_ptr() % _HUGE_PAGE
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            # Pinning is mostly per-page work: 2 MiB pages make it several times cheaper.
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, size)
        if hasattr(mmap, "MADV_DONTFORK"):
            # A forked child (a data loader's worker, say) must not share these pages
            # copy-on-write: the parent's next write would move it off the pages the GPU
            # writes to. cuMemHostAlloc memory is kept out of children by the driver.
            with contextlib.suppress(OSError):
                mapping.madvise(mmap.MADV_DONTFORK, offset, size)
        arena = whole[offset : offset + nbytes]
        ptr = arena.data_ptr()
        # One mapping registered in pieces: the arena stays contiguous, so the pinned chunks
        # can serve (copies split at their edges) while the rest is registered.
        self._ptr, self._nbytes = ptr, nbytes
        self._split_chunk = chunk if nbytes > chunk else 0
        registered: list[int] = []
        try:
            # Whole pages: the tail page past nbytes is mapped and registering it is harmless.
            for start in range(0, size, chunk):
                if self._closed:  # close() waits for this thread: stop pinning for nobody
                    raise MMCacheError(f"{self._name} closed while its host arena was pinned")
                piece = min(chunk, size - start)
                _populate(ptr + start, piece)
                began = time.perf_counter()
                driver.host_register(self._index, ptr + start, piece, "MMCACHE_CPU_CACHE_MB")
                held = time.perf_counter() - began  # the driver's lock, held for this chunk
                registered.append(ptr + start)
                hurry = on_pinned is None or on_pinned(arena, min(start + chunk, nbytes))
                if pause_s and start + chunk < size:  # none after the last: it is done
                    paced = min(held * PIN_PACE, _PACED_PAUSE_MAX_S)
                    self._stop.wait(pause_s if hurry else max(pause_s, paced))
        except BaseException:
            if on_pinned is None or not registered:
                self._ptr = self._nbytes = self._split_chunk = 0
                _release_registered(driver, self._index, tuple(registered), mapping)
                raise
            # Chunks already handed out may have copies in flight: they are unpinned by
            # unpin() (close, after its copies finish) or with the arena, never here.
            self._keep_registered(driver, registered, mapping)
            raise
        self._keep_registered(driver, registered, mapping)
        return arena

    def _keep_registered(
        self, driver: CudaDriver, registered: list[int], mapping: mmap.mmap
    ) -> None:
        """Unregister these chunks at unpin() or when the arena goes, whichever is first."""
        self._finalizer = weakref.finalize(
            self, _release_registered, driver, self._index, tuple(registered), mapping
        )
        self._finalizer.atexit = False

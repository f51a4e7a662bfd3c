"""The simulator's host arenas: poisoned on first hand-out, pinned chunk by chunk if asked."""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final, final

import torch

from mmcache.device.base import PIN_PACE, ArenaProgress
from mmcache.errors import MMCacheError

__all__ = ["ARENA_PAGE", "POISON_BYTE", "SimArenas"]

POISON_BYTE: Final = 0xFF
#: Host arenas are poisoned in pages of this many bytes, each on its first hand-out.
ARENA_PAGE: Final = 2 << 20


@dataclass(slots=True, eq=False)
class _Arena:
    """One arena: its identity, which pages were poisoned, and how much of it is pinned."""

    ref: weakref.ref[torch.Tensor]
    touched: bytearray
    pinned: int


@final
class SimArenas:
    """The host arenas of one SimDevice.

    With pin_chunk_s > 0 an arena pins in the background like a CUDA one, pin_chunk_bytes
    at a time, each chunk pin_chunk_s long; handing out bytes not pinned yet is an error,
    as using them on a GPU would be (a copy from pageable memory blocks, or is refused).
    """

    def __init__(self, name: str, pin_chunk_bytes: int, pin_chunk_s: float) -> None:
        if pin_chunk_bytes <= 0 or pin_chunk_s < 0:
            raise ValueError("pin_chunk_bytes must be > 0 and pin_chunk_s >= 0")
        self._name = name
        self.pin_chunk_bytes = pin_chunk_bytes
        self.pin_chunk_s = pin_chunk_s
        self._lock = threading.Lock()
        self._arenas: dict[int, _Arena] = {}  # by address
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def pinned_bytes(self) -> int:
        """Bytes of live arenas pinned now (0 once the device is closed)."""
        with self._lock:
            return sum(a.pinned for a in self._arenas.values() if a.ref() is not None)

    def host_arena(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        """A flat uint8 arena of nbytes, pinned at once unless pinned is False."""
        # Untouched pages cost no memory: each is poisoned when a block over it is first
        # handed out (hand_out), so an early read still shows poison, never zeros.
        # Huge pages where the kernel offers them: first touches are most of the cost.
        buffer = mmap.mmap(-1, nbytes)
        huge = getattr(mmap, "MADV_HUGEPAGE", None)
        if huge is not None:
            with contextlib.suppress(OSError):
                buffer.madvise(huge)
        arena = torch.frombuffer(buffer, dtype=torch.uint8)
        pages = bytearray(-(-nbytes // ARENA_PAGE))
        with self._lock:
            self._arenas[arena.data_ptr()] = _Arena(
                weakref.ref(arena), pages, nbytes if pinned else 0
            )
        return arena

    def pin_async(self, nbytes: int, on_pinned: ArenaProgress | None) -> Future[torch.Tensor]:
        """An arena pinned chunk by chunk on a thread; on_pinned(arena, ready) after each,
        the next chunk paced (PIN_PACE) where it says there is no hurry."""
        future: Future[torch.Tensor] = Future()
        try:
            arena = self.host_arena(nbytes, pinned=False)
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
            return future
        with self._lock:
            record = self._arenas[arena.data_ptr()]

        def pin() -> None:
            try:
                ready = 0
                pause = 0.0  # after a chunk reported in no hurry: PIN_PACE times its pinning
                while ready < nbytes:
                    if self._stop.wait(pause + self.pin_chunk_s):
                        raise MMCacheError(f"{self._name} closed while its host arena was pinned")
                    ready = min(ready + self.pin_chunk_bytes, nbytes)
                    with self._lock:
                        record.pinned = ready
                    hurry = on_pinned is None or on_pinned(arena, ready)
                    pause = 0.0 if hurry else self.pin_chunk_s * PIN_PACE
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(arena)

        thread = threading.Thread(target=pin, name=f"mmcache-pin-{self._name}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return future

    def hand_out(self, arena: torch.Tensor, start: int, stop: int) -> None:
        """Poison the pages under bytes start..stop that no block used before; refuse
        bytes not pinned yet."""
        key = arena.data_ptr()
        with self._lock:
            record = self._arenas.get(key)
            if record is not None and record.ref() is None:
                del self._arenas[key]  # an arena gone; its address was reused
                record = None
        if record is None or record.ref() is not arena:
            return  # not an arena of this device's making (an IPC pool is poisoned whole)
        if stop > record.pinned:
            raise RuntimeError(
                f"host arena bytes {start}..{stop} handed out, but only the first "
                f"{record.pinned} are pinned"
            )
        touched = record.touched
        for page in range(start // ARENA_PAGE, (stop - 1) // ARENA_PAGE + 1):
            if not touched[page]:
                # No block was ever handed out over this page: nothing live lies in it.
                arena[page * ARENA_PAGE : (page + 1) * ARENA_PAGE].fill_(POISON_BYTE)
                touched[page] = 1

    def close(self) -> None:
        """Stop pinning at the next chunk and unpin every arena."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        with self._lock:
            for record in self._arenas.values():
                record.pinned = 0

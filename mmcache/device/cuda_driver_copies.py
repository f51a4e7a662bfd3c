"""Copies queued by one driver call (cuMemcpyBatchAsync) per batch: within one GPU, and
from the pinned arena to it; torch's copies for a direction once the driver refused one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Final, final

import torch

from mmcache.device.cuda_arena import PinnedArena
from mmcache.device.cuda_driver import BatchCopier
from mmcache.device.cuda_streams import new_stream
from mmcache.errors import CopyFailedError

__all__ = ["LEGACY_DEFAULT_STREAM", "DriverCopies"]

_log = logging.getLogger(__name__)

#: the handle of CUDA's legacy default stream (torch's default stream)
LEGACY_DEFAULT_STREAM: Final = 0


@final
class DriverCopies:
    """The driver's batched copies of one GPU, by direction ("d2d", "h2d").

    Each method returns False where torch must copy instead (nothing of a refused call is
    queued, so copying the same ranges again is harmless).
    """

    __slots__ = ("_arena", "_copiers", "_device", "_name", "_side", "_side_lock")

    def __init__(
        self,
        name: str,
        device: torch.device,
        arena: PinnedArena,
        d2d: BatchCopier | None,
        h2d: BatchCopier | None,
    ) -> None:
        self._name = name
        self._device = device
        self._arena = arena
        self._copiers: dict[str, BatchCopier | None] = {"d2d": d2d, "h2d": h2d}
        # The side stream of batches on the legacy default stream and the two events that
        # order it, made at their first use; one batch at a time uses them (any thread).
        self._side: tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event] | None = None
        self._side_lock = threading.Lock()

    @property
    def d2d(self) -> BatchCopier | None:
        """Copies within the GPU; None without them, or once refused."""
        return self._copiers["d2d"]

    @property
    def h2d(self) -> BatchCopier | None:
        """Copies from the arena to the GPU; None without them, or once refused."""
        return self._copiers["h2d"]

    def within_gpu(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[int], stream: torch.cuda.Stream
    ) -> bool:
        """Queue each of srcs (dense tensors of this GPU) to the address in dsts (room for
        it, checked) as one batch on stream; False if the driver refused it."""
        ptrs, addresses, sizes = [], [], []
        for src, at in zip(srcs, dsts, strict=True):
            if src.nbytes:
                ptrs.append(src.data_ptr())
                addresses.append(at)
                sizes.append(src.nbytes)
        return self.batch("d2d", addresses, ptrs, sizes, stream)

    def upload(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[int], stream: torch.cuda.Stream
    ) -> bool:
        """Queue host copies (contiguous) to device addresses dsts (room for each, checked)
        as one batch on stream, each split where it crosses an arena chunk; False where
        torch copies them instead: fewer than two, a source outside the arena (the node's
        shared tier, a caller's memory), no batched uploads, or a refused batch."""
        arena = self._arena
        if len(srcs) < 2 or self._copiers["h2d"] is None:
            return False
        start, stop = arena.ptr, arena.ptr + arena.nbytes
        addresses: list[int] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for src, at in zip(srcs, dsts, strict=True):
            ptr, nbytes = src.data_ptr(), src.nbytes
            if not (start <= ptr and ptr + nbytes <= stop and src.is_contiguous()):
                return False
            for a, b in arena.chunk_pieces(ptr, nbytes) or ((0, nbytes),):
                if b > a:
                    addresses.append(at + a)
                    ptrs.append(ptr + a)
                    sizes.append(b - a)
        return self.batch("h2d", addresses, ptrs, sizes, stream)

    def batch(
        self,
        direction: str,
        dsts: list[int],
        srcs: list[int],
        sizes: list[int],
        stream: torch.cuda.Stream,
    ) -> bool:
        """Queue sizes[i] bytes from srcs[i] to dsts[i] by one call of direction's copier,
        in stream's order; False if the driver refused it, after which that direction
        goes through torch.

        The driver refuses batches on the legacy default stream: there they run on a side
        stream between two stream waits, which keep them in that stream's order.
        """
        copier = self._copiers[direction]
        assert copier is not None
        if not sizes:
            return True
        try:
            if stream.cuda_stream != LEGACY_DEFAULT_STREAM:
                copier.copy(dsts, srcs, sizes, stream.cuda_stream)
                return True
            with self._side_lock:
                # Events recorded again each batch: a wait takes the record before it, and
                # none is made (or destroyed) per batch, as wait_stream would.
                side, before, after = self._side_parts()
                before.record(stream)
                side.wait_event(before)
                copier.copy(dsts, srcs, sizes, side.cuda_stream)
                after.record(side)
                stream.wait_event(after)
            return True
        except CopyFailedError as exc:
            # The reason, not exc: a log record keeping its traceback would keep the sources.
            reason = str(exc)
            _log.warning("%s: %s; torch copies (%s) from now on", self._name, reason, direction)
            self._copiers[direction] = None
            return False

    def _side_parts(self) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
        """The side stream and its two events (each event's CUDA event is made at its first
        record, on the stream's device)."""
        if self._side is None:
            events = torch.cuda.Event(), torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._side = (new_stream(self._device, priority=0), *events)
        return self._side

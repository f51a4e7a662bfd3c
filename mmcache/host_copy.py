"""Copies between host tensors without torch's thread pool, and large ones off the loop.

A host read copies a feature out of the pinned arena into a tensor the caller owns.
torch's clone and copy_ would split a large copy over its intra-op threads, which spin
afterwards, and torch sizes that pool by the machine's cores, not by the cores the
process may use (a 1 MB read took 28.7 ms at p50 that way on the H200 host, with the
process kept to a few cores; BENCHMARKS.md, "Fourteenth session"). One memcpy avoids
that, but one thread copies an 8 MiB feature in about 0.6 ms, all of it on the event
loop. HostCopier copies small tensors at once with one memcpy, and splits large ones
over a few worker threads of its own, so the loop runs on meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Callable

import torch

__all__ = ["PARALLEL_COPY_BYTES", "HostCopier", "copy_host_bytes"]

MiB = 1 << 20
# Below this a copy runs at once on the calling thread: a 1 MiB memcpy took 58 µs on the
# H200 host, about what handing it to a worker and hearing back costs the loop.
PARALLEL_COPY_BYTES = 2 * MiB
_PIECE_BYTES = 1 * MiB  # no piece smaller: each costs a worker hand-off
_PIECE_ALIGN = 4096  # pieces start on page boundaries of the destination

# ctypes.memmove is a foreign function: a call lets go of the GIL while it copies.
_memmove: Callable[[int, int, int], object] = ctypes.memmove


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    for tensor, role in ((dst, "destination"), (src, "source")):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"host copy {role} must be a contiguous host tensor")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"host copy of {src.nbytes} bytes into a {dst.nbytes}-byte destination")


def copy_host_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of src into dst, two contiguous host tensors of one size, by one
    memcpy on the calling thread (which lets go of the GIL meanwhile)."""
    _check_pair(dst, src)
    if src.nbytes:
        _memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)


class HostCopier:
    """Copies host tensors: small ones at once, large ones in pieces on worker threads.

    threads=0 copies everything at once on the calling thread. The workers start on the
    first large copy, at most one fewer than the cores the process may use then, and
    stop with close(); copies queued by then still run.
    """

    def __init__(
        self,
        threads: int,
        *,
        parallel_bytes: int = PARALLEL_COPY_BYTES,
        piece_bytes: int = _PIECE_BYTES,
    ) -> None:
        if threads < 0:
            raise ValueError(f"threads must be >= 0, not {threads}")
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, not {piece_bytes}")
        self.threads = threads
        self.parallel_bytes = parallel_bytes
        self.piece_bytes = piece_bytes
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.workers = 0  # worker threads, once started (see _usable_workers)
        self._closed = False
        self.copies_in_flight = 0  # large copies queued whose last piece has not finished

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> asyncio.Future[None] | None:
        """Copy src's bytes into dst (see copy_host_bytes for what they must be).

        Returns None when the copy is done already, else a future of the running loop
        that is done when it is. The workers hold both tensors until their pieces are
        copied: a caller that stops waiting must still keep whatever backs src from
        being reused until the future is done. Bad arguments raise ValueError before a
        byte moves.
        """
        _check_pair(dst, src)
        nbytes = src.nbytes
        if nbytes < self.parallel_bytes or self.threads == 0 or self._closed:
            if nbytes:
                _memmove(dst.data_ptr(), src.data_ptr(), nbytes)
            return None
        executor = self._executor
        if executor is None:
            self.workers = self._usable_workers()
            executor = self._executor = concurrent.futures.ThreadPoolExecutor(
                self.workers, thread_name_prefix="mmcache-host-copy"
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        pieces = max(1, min(self.workers, nbytes // self.piece_bytes))
        step = -(-nbytes // pieces)
        step += -step % _PIECE_ALIGN
        spans = [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]
        dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()
        lock = threading.Lock()
        left = len(spans)
        failures: list[BaseException] = []
        tensors: tuple[torch.Tensor, ...] | None = (dst, src)  # alive until the last piece

        def finished() -> None:
            self.copies_in_flight -= 1
            if done.cancelled():
                return
            if failures:
                done.set_exception(failures[0])
            else:
                done.set_result(None)

        def piece(start: int, size: int) -> None:
            nonlocal left, tensors
            try:
                _memmove(dst_ptr + start, src_ptr + start, size)
            except BaseException as exc:  # reported through the future, not lost in a worker
                failures.append(exc)
            with lock:
                left -= 1
                last = left == 0
            if last:
                tensors = None
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:
                    pass  # the loop is closed: nobody is left to tell

        self.copies_in_flight += 1
        for start, size in spans:
            executor.submit(piece, start, size)
        return done

    def _usable_workers(self) -> int:
        """threads, but leaving one of the cores this process may use to the loop: with
        every core copying, the loop would wait for the copies it was meant to avoid."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return max(1, min(self.threads, cores - 1))

    def close(self) -> None:
        """Stop the workers once the copies queued so far are done; later copies run at once."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False)

"""Batched offloads into the arena: small sources gathered, the copies queued by one driver call."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import ClassVar, Final, final

import torch

from mmcache.device.base import Fence, batch_order
from mmcache.device.cuda_arena import PinnedArena
from mmcache.device.cuda_copies import CudaCopies, enqueue_error, flat_bytes
from mmcache.device.cuda_driver import BatchCopier
from mmcache.device.cuda_fence import CudaFence, order_after
from mmcache.device.cuda_memory import DeviceMemory
from mmcache.device.cuda_streams import OnStream
from mmcache.errors import CopyFailedError, InvalidValueError

__all__ = ["DEFAULT_BATCHED_PACK_MAX_BYTES", "DEFAULT_PACK_MAX_BYTES", "BatchedCopies"]

_log = logging.getLogger(__name__)

_MiB: Final = 1 << 20
DEFAULT_PACK_MAX_BYTES: Final = 1 * _MiB  # copies through torch: one copy_ call per run
# Through the driver's batched copies a range costs a little more host time and no kernel:
# only many small sources are worth gathering first (BENCHMARKS.md).
DEFAULT_BATCHED_PACK_MAX_BYTES: Final = 512 * 1024
# A packed run of small copies needs a device staging buffer of its size: keep it modest.
_PACK_RUN_MAX_BYTES: Final = 64 * _MiB

#: (sources, host offset, bytes) of one copy: the sources gathered first if several.
_Run = tuple[list[torch.Tensor], int, int]


def _gather(run: list[torch.Tensor]) -> torch.Tensor:
    """A run's sources back to back in one tensor (the one source itself if alone).

    The gather buffer comes from the current (D2H) stream's pool: later work on this stream
    reuses it only after the copy queued next has read it.
    """
    return run[0] if len(run) == 1 else torch.cat(run)


@final
class BatchedCopies:
    """copy_d2h_batch on one GPU: plans a batch's copies, queues them, falls back to torch.

    Not slotted: tests and a benchmark wrap packed_runs, owned_ranges and queue_batch on
    an instance to see what a batch became.
    """

    #: Batches of at least this many copies into the arena go through the driver's
    #: batched copies; fewer through torch's copy_.
    driver_min_runs: ClassVar[int] = 2

    def __init__(
        self,
        name: str,
        memory: DeviceMemory,
        arena: PinnedArena,
        copies: CudaCopies,
        copier: BatchCopier | None,
        pack_max_bytes: int | None,
    ) -> None:
        self._name = name
        self._memory = memory
        self._arena = arena
        self._copies = copies
        # Offloads into the arena go through cuMemcpyBatchAsync where the driver has it.
        self._copier = copier
        if pack_max_bytes is None:
            pack_max_bytes = (
                DEFAULT_PACK_MAX_BYTES if copier is None else DEFAULT_BATCHED_PACK_MAX_BYTES
            )
        self.pack_max_bytes = pack_max_bytes

    @property
    def copier(self) -> BatchCopier | None:
        """The driver's batched copies; None without them, or once the driver refused one."""
        return self._copier

    def copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> CudaFence:
        """Queue copies of srcs into host's bytes at offsets on the D2H stream, one fence.

        Small sources of one dtype and row shape whose ranges lie back to back in host
        memory (in any order) are gathered into one buffer by one kernel and moved by one
        copy. Several copies into the arena are queued by one driver call where the driver
        has batched copies; one copy goes through torch (a large feature's offload gains
        nothing through the driver), and so does every batch once the driver has refused
        one. The caller keeps the sources alive until the fence is done.

        owned (the cache's own sources, see CopyPlan "d2h" into): a batch of sources
        that need no gather goes to the driver as it is, each range only bounds-checked.
        """
        self._copies.check_open()
        ranges = self.owned_ranges(srcs, host, offsets) if owned else None
        runs = None if ranges is not None else self.packed_runs(batch_order(srcs, host, offsets))
        stream = self._copies.d2h
        try:
            if self._copier is not None and (
                ranges is not None
                or (
                    runs is not None
                    and len(runs) >= self.driver_min_runs
                    and self._arena.contains(host)
                )
            ):
                order_after(stream, after)
                try:
                    if ranges is not None:
                        self.queue_batch(*ranges, stream)
                    else:
                        assert runs is not None
                        self._copy_runs(runs, host, stream)
                    return self._copies.record_on(stream)
                except CopyFailedError as exc:
                    # With its arguments checked (an owned batch's are checked now, and a
                    # bad one raises here), the driver refuses the call itself (an
                    # unsupported platform), not this batch: torch's copies from now on.
                    # Nothing of a refused call is queued; copying again is harmless.
                    if runs is None:
                        runs = self.packed_runs(batch_order(srcs, host, offsets))
                    # The reason, not exc: a log record keeping exc's traceback would keep
                    # the batch's sources alive.
                    _log.warning("%s: %s; copying through torch from now on", self._name, str(exc))
                    self._copier = None
            assert runs is not None  # owned ranges imply the driver path, and runs if refused
            with OnStream(stream):
                order_after(stream, after)
                for run, start, nbytes in runs:
                    region = host[start : start + nbytes]
                    packed = _gather(run)
                    self._copies.copy_bytes(region, flat_bytes(packed, "source"), host=region)
                    del packed
                return self._copies.record_on(stream)
        except RuntimeError as exc:
            total = sum(src.nbytes for src in srcs)
            raise enqueue_error("batched device-to-host", total, exc) from exc

    def owned_ranges(
        self, srcs: Sequence[torch.Tensor], host: torch.Tensor, offsets: Sequence[int]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """(host addresses, device addresses, sizes) of a batch of the cache's own sources
        into the arena, for one driver call; None where the checked path applies (no batched
        copies, fewer than driver_min_runs sources, a target outside the arena, or a source
        small enough to be gathered with its neighbours).

        The sources were checked at put (see CopyPlan "d2h" into): checking each again
        here would cost the loop host time per feature, and the sort and runs as much.
        """
        arena = self._arena
        if (
            self._copier is None
            or len(srcs) < self.driver_min_runs
            or len(srcs) != len(offsets)
            or host.data_ptr() != arena.ptr
            or host.numel() != arena.nbytes
        ):
            return None
        pack_max = self.pack_max_bytes
        base, limit = arena.ptr, arena.nbytes
        dsts: list[int] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for src, offset in zip(srcs, offsets, strict=True):
            nbytes = src.nbytes
            if nbytes <= pack_max:
                return None
            if offset < 0 or offset + nbytes > limit:
                raise InvalidValueError(
                    f"a copy of {nbytes} bytes at offset {offset} falls outside the "
                    f"{limit}-byte host arena"
                )
            self._add_pieces(base + offset, src.data_ptr(), nbytes, dsts, ptrs, sizes)
        return dsts, ptrs, sizes

    def packed_runs(self, ordered: list[tuple[int, torch.Tensor]]) -> list[_Run]:
        """(sources, host offset, bytes) per copy, sources checked on the way.

        Back-to-back sources of one dtype and row shape form a run (torch.cat joins them
        along rows); sources over pack_max_bytes go alone.
        """
        pack_max = self.pack_max_bytes
        runs: list[_Run] = []
        run: list[torch.Tensor] = []
        run_start = run_end = 0
        run_kind: tuple[torch.dtype, torch.Size] | None = None
        for offset, src in ordered:
            if not self._memory.is_device_tensor(src):
                raise InvalidValueError(f"copy source is on {src.device}, not {self._name}")
            if not src.is_contiguous() or src.is_conj() or src.is_neg():
                # A conjugate or negative view's bytes are not its values: copying them
                # as bytes would be silently wrong.
                raise InvalidValueError(
                    "batched copies need contiguous sources with no lazy conjugate or "
                    "negation; compact them with copy_d2d first"
                )
            nbytes = src.nbytes
            shape = src.shape
            kind = (src.dtype, shape[1:]) if shape and nbytes <= pack_max else None
            if (
                kind is not None
                and kind == run_kind
                and offset == run_end
                and run_end - run_start + nbytes <= _PACK_RUN_MAX_BYTES
            ):
                run.append(src)
            else:
                if run:
                    runs.append((run, run_start, run_end - run_start))
                run, run_start, run_kind = [src], offset, kind
            run_end = offset + nbytes
        runs.append((run, run_start, run_end - run_start))
        return runs

    def queue_batch(
        self, dsts: list[int], srcs: list[int], sizes: list[int], stream: torch.cuda.Stream
    ) -> None:
        """The driver call of a batch (device addresses to host addresses, on stream)."""
        assert self._copier is not None
        self._copier.copy(dsts, srcs, sizes, stream.cuda_stream)

    def _copy_runs(self, runs: list[_Run], host: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Queue every run's copy into host (in the arena) by one driver call on stream.

        The stream is made current only for gathers: the driver call names it.
        """
        base = host.data_ptr()
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        gathered: list[torch.Tensor] = []  # referenced until the copies reading them are queued
        for run, start, nbytes in runs:
            if not nbytes:
                continue
            if len(run) == 1:
                packed = run[0]
            else:
                with OnStream(stream):
                    packed = _gather(run)
            gathered.append(packed)
            self._add_pieces(base + start, packed.data_ptr(), nbytes, dsts, srcs, sizes)
        if sizes:
            self.queue_batch(dsts, srcs, sizes, stream)

    def _add_pieces(
        self, at: int, ptr: int, nbytes: int, dsts: list[int], ptrs: list[int], sizes: list[int]
    ) -> None:
        """Add the copy of nbytes from device address ptr to host address at (in the arena)
        to a driver batch's lists, split where it crosses an arena chunk."""
        for a, b in self._arena.chunk_pieces(at, nbytes) or ((0, nbytes),):
            dsts.append(at + a)
            ptrs.append(ptr + a)
            sizes.append(b - a)

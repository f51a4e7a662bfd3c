"""Reads: serving a feature on the device, downloading it, reading the host copy, uploading."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import final

import torch

from mmcache.budget import FifoBudget
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State, row_range
from mmcache.core.grants import Grant
from mmcache.core.host import HostTier
from mmcache.core.index import holder
from mmcache.core.offload import OffloadPipeline
from mmcache.core.state import EvictionPlan, Release, TierState
from mmcache.device import Device, Fence, NewCopyPlan, Stream
from mmcache.errors import CopyFailedError, CopyTimeoutError, InvalidValueError
from mmcache.host_copy import copy_host_bytes_in_slices
from mmcache.waiting import wait_fences

__all__ = ["Reads", "copy_failure", "raise_if_failed"]


def raise_if_failed(ready: Fence) -> None:
    """A feature whose producing copy already failed is an error to read, never poison."""
    failure = copy_failure(ready)
    if failure is not None:
        raise failure


def copy_failure(ready: Fence) -> CopyFailedError | None:
    """The error to read a feature whose producing copy already failed, or None."""
    if ready.done() and ready.exception() is not None:
        return CopyFailedError(f"the copy that made this feature failed: {ready.exception()}")
    return None


@final
class Reads:
    """Every way a get gets its bytes, each resolved only after the copies it depends on.

    On the device a get returns a fresh alias ordered after the data's fence on the
    caller's stream; on the host, a copy the caller owns. A host hit that fits the GPU
    tier without waiting is promoted back to it by the upload that serves it.
    """

    def __init__(
        self,
        *,
        device: Device,
        state: TierState,
        counters: Counters,
        host: HostTier,
        pipeline: OffloadPipeline,
        carry_out: Callable[[Sequence[Release]], None],
        evict: Callable[[EvictionPlan], None],
        room_freed: Callable[[], None],
        changed: Callable[[], None],
        gpu_waiting: FifoBudget[tuple[int, Grant], Grant],
        when_done: Callable[[Sequence[Fence], Callable[[], None]], None],
        when_done_lazily: Callable[[Fence, Callable[[], None], Stream | None], None],
        promote: bool,
        copy_timeout: float,
        small_copy_bytes: int,
    ) -> None:
        self._device = device
        self._state = state
        self._counters = counters
        self._host = host
        self._pipeline = pipeline
        self._carry_out = carry_out
        self._evict = evict  # carries out an eviction the state made for a promotion
        self._room_freed = room_freed
        self._changed = changed  # the tiers' figures changed (a promotion)
        self._gpu_order = state.gpu_order
        self._host_order = state.host_order
        self._gpu_line = gpu_waiting.line  # a promotion never jumps the line of waiting puts
        self._ledger = state.ledger  # read here; changed through the state's verbs
        self._when_done = when_done
        self._when_done_lazily = when_done_lazily
        self._promote = promote
        #: seconds a read waits for a copy before it fails (copy_timeout_s)
        self.copy_timeout = copy_timeout
        # A small upload that stays the reader's is copied on the reader's stream: for it,
        # a copy stream's switch, event and wait cost more than the copy itself.
        self.small_copy_bytes = small_copy_bytes

    async def serve(
        self,
        found: Entry | Member,
        rows: slice | None,
        to_host: bool,
        stream: Stream,
    ) -> torch.Tensor:
        """get's read of a cached feature (or rows of it), from whichever tier holds it."""
        member = None
        if isinstance(found, Member):
            member = found
            entry = found.group
            span: tuple[int, int] | None = found.span(row_range(rows, found.shape))
        else:
            entry = found
            span = row_range(rows, entry.shape)
        del found
        state = entry.state
        if state is State.GPU or state is State.D2H:
            self._counters.hit_gpu()
            if state is State.GPU:
                self._gpu_order.touch(entry.key)
                entry.hits += 1  # a use for the admission filter (no call)
            assert entry.tensor is not None
            if to_host:
                if state is State.D2H:
                    return await self.read_host(entry, span)
                return await self.download(entry.tensor, entry.ready, span, entry)
            return await self.serve_device(entry.tensor, entry.ready, span, stream, entry)
        self._counters.hit_cpu()
        self._host_order.touch(entry.key)
        if to_host:
            return await self.read_host(entry, span)
        return await self.upload(entry, span, stream, member if rows is None else None)

    def touch(self, found: Entry | Member) -> None:
        """Mark found as just used in its tier's order, as serve does, without reading it."""
        entry = holder(found)
        state = entry.state
        if state is State.GPU:
            self._gpu_order.touch(entry.key)
        elif state is State.HOST:
            self._host_order.touch(entry.key)

    def can_borrow(self, found: Entry | Member) -> bool:
        """Whether borrow() can lend found's host bytes (it has a host copy)."""
        return holder(found).block is not None and self._host.pool is not None

    @contextlib.asynccontextmanager
    async def borrow(self, found: Entry | Member) -> AsyncIterator[torch.Tensor]:
        """A view of found's host copy for the block (a copy where it crosses two pinned
        chunks), after its offload; the block stays pinned meanwhile."""
        entry = holder(found)
        block, pool = entry.block, self._host.pool
        assert block is not None and pool is not None
        pool.pin(block)
        try:
            if entry.copy_fence is not None:
                self._counters.waited(await self.wait([entry.copy_fence]))
            if isinstance(found, Member):
                view = entry.host_view(*found.span(None), block)
            else:
                view = entry.host_whole(block)
            if self._device.one_pinned_range(view):
                yield view
            else:
                out = await self.host_copy(view)
                del view
                yield out
        finally:
            pool.unpin(block)

    def wants_host(self, device: str | torch.device | None) -> bool:
        """True for a host read ("cpu"); False for this cache's own device (None or its name)."""
        if device is None:
            return False
        name = str(device)
        if name == "cpu":
            return True
        own = self._device.name
        if name == own or name == own.split(":")[0]:
            return False
        raise InvalidValueError(
            f"get(device={device!r}): this cache returns tensors on {own!r}"
            f"{self._device.tensor_note} (device=None) or host copies (device='cpu'); move the "
            f"result yourself for another device"
        )

    async def wait(self, fences: Sequence[Fence]) -> float:
        """wait_fences bounded by copy_timeout_s (a fence that never completes fails the read)."""
        return await wait_fences(fences, self.copy_timeout)

    async def serve_device(
        self,
        tensor: torch.Tensor,
        ready: Fence,
        span: tuple[int, int] | None,
        stream: Stream,
        entry: Entry | None = None,
    ) -> torch.Tensor:
        """A fresh alias (or row view) of a device tensor, ordered after ready on stream;
        entry: the one whose tensor it is, its block marked used on stream once."""
        # The alias exists before any wait: a reader holds what it will read, so a release
        # that lands meanwhile cannot recycle it.
        out = tensor.detach() if span is None else tensor[span[0] : span[1]]
        if ready.ok():  # one call in the common case: done and good
            pass
        elif ready.done():
            # Checked here, not before the alias: a copy that failed in between must not
            # slip through as done. One that completed well since ok() is served.
            failure = copy_failure(ready)
            if failure is not None:
                del out
                raise failure
        else:
            if self._device.stream_ordered_reads:
                self._device.wait_on(stream, ready)
            else:
                try:
                    self._counters.waited(await self.wait([ready]))
                except BaseException:
                    del out  # a cancelled read must not keep it alive through its traceback
                    raise
        # Marked once a stream (after a wait, the entry may hold a newer block, marked by
        # another read: then this one is marked again, and the mark left to the newer).
        if entry is None or entry.used_on is not stream or entry.tensor is not tensor:
            self._device.use_on(out, stream)
            if entry is not None and entry.tensor is tensor:
                entry.used_on = stream
        return out

    async def download(
        self,
        tensor: torch.Tensor,
        ready: Fence,
        span: tuple[int, int] | None,
        entry: Entry | None = None,
    ) -> torch.Tensor:
        """A host copy the caller owns of a device tensor (or rows of it)."""
        raise_if_failed(ready)
        # The copy gets an alias of its own: queued work holds nothing, so what keeps the
        # bytes until it runs is the reader's tensor (get_or_compute's result, the only
        # holder once a discard releases the cache's alias) or the entry's reader list.
        src = tensor.detach() if span is None else tensor[span[0] : span[1]]
        dst, fence = self._device.submit(NewCopyPlan("d2h", (src,), after=(ready,)))
        assert fence is not None  # a download always has one
        if entry is not None:
            # A release of the tensor waits for this copy too.
            entry.add_device_reader(fence)
        del src
        started = time.perf_counter()
        self._counters.copy_started("d2h")
        try:
            self._counters.waited(await self.wait([fence]))
        except CopyTimeoutError:
            raise
        except CopyFailedError as e:
            self._counters.copy_failed("download", entry.key if entry else None, e)
            raise
        finally:
            if fence.done():
                self._counters.copy_finished("d2h", dst.nbytes, started)
            else:  # cancelled: account for it when it lands
                finished = self._counters.copy_finished
                self._when_done([fence], lambda: finished("d2h", dst.nbytes, started))
        return dst

    async def read_host(self, entry: Entry, span: tuple[int, int] | None) -> torch.Tensor:
        """A copy the caller owns of (rows of) the host copy, after the offload completes."""
        block = entry.block
        fence = entry.copy_fence
        pool = self._host.pool
        assert block is not None and pool is not None and fence is not None
        pool.pin(block)  # a discard while we wait must not recycle the block under us
        try:
            try:
                self._counters.waited(await self.wait([fence]))
            except CopyTimeoutError:
                self._pipeline.quarantine(entry, fence)
                raise
            view = entry.host_whole(block) if span is None else entry.host_view(*span, block)
            return await self.host_copy(view)
        finally:
            pool.unpin(block)

    async def host_copy(self, view: torch.Tensor) -> torch.Tensor:
        """A copy the caller owns of a view of the arena (pinned before this is called).

        Caller-owned, as a download's is: from torch's cache of pinned blocks on CUDA (no
        page faults once warm; a later upload of it is asynchronous). Copied a slice per
        loop turn (mmcache.host_copy), so a large one does not hold the loop: by memcpy,
        1 MiB a turn, or, once a burst of reads repays waking them and unless they stalled
        lately, on torch's intra-op threads, 1 MiB per thread a turn.
        """
        out = self._device.empty(tuple(view.shape), view.dtype, host=True)
        await copy_host_bytes_in_slices(out, view)
        return out

    def promotions(self, hits: Sequence[tuple[Entry | Member, int]]) -> list[bool] | None:
        """Which of a loop turn's host hits (each an entry or a group's member, and its
        bytes to the device) are promoted, as the state decides
        (TierState.plan_promotions), with the eviction made for them carried out; None:
        none is (promotion is off, or puts wait for room: a promotion never jumps their
        line)."""
        if not self._promote or self._gpu_line:
            return None
        decision = self._state.plan_promotions(hits)
        if decision.eviction is not None:
            self._evict(decision.eviction)
            self._changed()
        return decision.promote

    def promote(
        self, uploaded: Sequence[tuple[Entry | Member, torch.Tensor]], fence: Fence
    ) -> list[Entry]:
        """Make uploaded host hits (entries or group members, each with the device tensor
        its upload fills behind fence) GPU-resident (TierState.promote); returns the
        entries that now hold them."""
        entries, releases = self._state.promote(uploaded, fence)
        if releases:
            self._carry_out(releases)
        self._changed()
        return entries

    def track_upload(
        self, entries: Sequence[Entry], fence: Fence, nbytes: int, stream: Stream | None
    ) -> None:
        """Account for an upload copy of entries' bytes queued on stream (None: the H2D
        copy stream), and handle its failure when it lands."""
        started = time.perf_counter()
        self._counters.copy_started("h2d", len(entries))
        # Lazily: a read waits on the fence itself, so only accounting waits on this.
        self._when_done_lazily(
            fence, lambda: self._upload_done(entries, fence, nbytes, started), stream
        )

    async def upload(
        self,
        entry: Entry,
        span: tuple[int, int] | None,
        stream: Stream,
        member: Member | None = None,
    ) -> torch.Tensor:
        """A device copy of a host-resident entry (or of rows of it, or of a whole group
        member); promotes the entry or the member back to the GPU tier if it fits."""
        assert entry.block is not None and entry.copy_fence is not None
        promote = False
        if span is None or member is not None:
            found: Entry | Member = entry if member is None else member
            decided = self.promotions([(found, found.nbytes)])
            promote = decided is not None and decided[0]
        if span is None:
            src = entry.host_bytes()
            shape = entry.shape
        else:
            src = entry.host_bytes(*span)
            shape = (span[1] - span[0], *entry.shape[1:])
        after = [entry.copy_fence]
        # A small one that stays the reader's is copied on its stream, where the device can.
        on_reader = not promote and src.nbytes < self.small_copy_bytes
        fence: Fence | None
        with self._counters.counting_oom():
            reader = stream if on_reader else None
            dst, fence = self._device.submit(
                NewCopyPlan("h2d", (src,), shape, entry.dtype, after=after, stream=reader)
            )
        del src
        if not on_reader:
            assert fence is not None
            entry.add_host_reader(fence)
        else:
            Entry.add_host_stream((entry,), stream)  # the block's free records a fence there
            if fence is None:  # stream order alone covers it; dst is the reader's
                self._counters.uploaded_on_reader_stream(dst.nbytes)
                return dst
        if promote:
            entry = self.promote([(entry if member is None else member, dst)], fence)[0]
        self.track_upload([entry], fence, dst.nbytes, reader)
        if promote:
            return await self.serve_device(dst, fence, None, stream)
        try:
            return await self.serve_device(dst, fence, None, stream)
        except CopyTimeoutError:
            self._counters.quarantined()  # dst and the host block stay pinned by it
            raise
        finally:
            # The caller's alias keeps it alive.
            self._device.release(
                dst, after=() if self._device.copies_keep_destinations else (fence,)
            )

    def _upload_done(
        self, entries: Sequence[Entry], fence: Fence, nbytes: int, started: float
    ) -> None:
        self._counters.copy_finished("h2d", nbytes, started, len(entries))
        if fence.exception() is None:
            self._counters.uploaded(nbytes)
            return
        # Those promoted from the copy that failed hold no data: they are dropped.
        releases = self._state.upload_failed(entries, fence)
        if releases:
            self._carry_out(releases)
            self._room_freed()

"""Batch reads: the features of a request in one call, host hits uploaded by one copy batch."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, final

import torch

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State
from mmcache.core.reads import Reads, raise_if_failed
from mmcache.core.state import TierState
from mmcache.device import CopyPlan, Device, Fence, NewCopyPlan, Stream
from mmcache.errors import CopyTimeoutError, DeviceOutOfMemoryError
from mmcache.layouts import contiguous_strides
from mmcache.waiting import wait_fences

__all__ = ["UPLOAD_ALIGNMENT", "BatchReads"]

#: Byte alignment of each feature in a batch's shared device buffer: a multiple of every
#: dtype's size, and of the widest load a kernel reading the feature issues.
UPLOAD_ALIGNMENT = 256

#: (the output position, the entry to read, the group member read, or None for a whole entry)
_Upload = tuple[int, Entry, Member | None]


#: where a feature lies in a flat device buffer: its shape, dtype and byte offset
_Part = tuple[tuple[int, ...], torch.dtype, int]


def _typed_views(buffer: torch.Tensor, parts: list[_Part]) -> list[torch.Tensor]:
    """A contiguous tensor of each part's shape and dtype over buffer's bytes (flat uint8)
    from its offset, a multiple of its dtype's size: one view op each (a slice and two
    views cost 2.5 times as much), the buffer viewed as each dtype once, one call a batch."""
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    views: list[torch.Tensor] = []
    try:
        for shape, dtype, offset in parts:
            as_dtype = typed.get(dtype)
            if as_dtype is None:
                view = buffer.view(dtype)
                as_dtype = typed[dtype] = (view, int(view.storage_offset()))
            views.append(
                as_dtype[0].as_strided(
                    shape, contiguous_strides(shape), as_dtype[1] + offset // dtype.itemsize
                )
            )
    except BaseException:
        typed.clear()  # the traceback keeps this frame: it must not keep the buffer
        views.clear()
        buffer = view = as_dtype = None  # type: ignore[assignment]
        raise
    return views


class _Copies(NamedTuple):
    """The uploads of one destination: the host bytes each reads, and the distinct
    offload fences those bytes were written behind."""

    srcs: list[torch.Tensor]
    after: list[Fence]


@final
class BatchReads:
    """get_many on the device: every key looked up first, then one copy batch for the host
    hits and one wait for everything the outputs depend on.

    What get does per key, paid once per call where it can be shared: the H2D stream
    switch and ordering, the fence, the completion callback, the copy counters, the
    caller stream's wait and one device buffer for the host hits that are not promoted
    (promoted ones get their own memory, since the GPU tier then owns it).
    """

    def __init__(
        self,
        *,
        device: Device,
        state: TierState,
        counters: Counters,
        reads: Reads,
    ) -> None:
        self._device = device
        self._counters = counters
        self._index = state.index
        self._reads = reads
        self._gpu_order = state.gpu_order
        self._host_order = state.host_order

    async def get_many(self, keys: Sequence[Hashable], stream: Stream) -> list[torch.Tensor | None]:
        """The features of keys on the device, usable on stream; None for a miss."""
        out, waits, used = self.queue(keys, stream)
        await self.wait(waits, used, stream)
        return out

    def queue(
        self,
        keys: Sequence[Hashable],
        stream: Stream,
        *,
        count_repeats: bool = False,
        blame: dict[Fence, list[Hashable]] | None = None,
        deferred: list[int] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[Fence], list[torch.Tensor]]:
        """get_many up to its first await: every key looked up, every alias taken and every
        host hit's copy queued. Returns the outputs (usable on stream once wait() has
        ordered them), the fences they depend on and the device memory uploaded for them
        (wait() marks it used on stream; a GPU hit's block is marked here, once a stream).

        A key given twice is read once; count_repeats: each is a lookup all the same
        (the keys of several calls), else one (get_many's). With blame (the keys of
        several calls), a feature whose copy failed already is not an error here: blame
        maps each fence the outputs depend on (but those done and good) to the keys read
        behind it, so that only the callers of those keys fail. With deferred, host-tier
        hits are neither read nor counted: their positions are appended to it and their
        outputs left None (TurnReads reads them with its turn's other reads)."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        waits: list[Fence] = []
        used: list[torch.Tensor] = []  # one tensor per block of device memory uploaded
        marked: list[torch.Tensor] = []  # the GPU hits whose blocks stream has not used yet
        marking: list[Entry] = []  # their entries
        uploads: list[_Upload] = []
        first: dict[Hashable, int] = {}
        repeats: list[tuple[int, int]] = []
        touch_gpu = self._gpu_order.touch
        touch_host = self._host_order.touch
        index = self._index
        gpu_hits = missed = 0
        # Everything is looked up and every alias taken before the first await: a reader
        # holds what it will read, so nothing that lands or is evicted meanwhile changes it.
        for i, key in enumerate(keys):
            seen = first.get(key)
            if seen is not None:
                repeats.append((i, seen))
                continue
            first[key] = i
            found = index.get(key)
            if found is None:
                missed += 1
                continue
            if isinstance(found, Member):
                member: Member | None = found
                entry = found.group
            else:
                member = None
                entry = found
            state = entry.state
            if state is State.GPU or state is State.D2H:
                gpu_hits += 1
                if state is State.GPU:
                    touch_gpu(entry.key)
                    entry.hits += 1  # a use for the admission filter (no call)
                tensor = entry.tensor
                assert tensor is not None
                alias = tensor.detach() if member is None else tensor[member.start : member.stop]
                out[i] = alias
                if entry.used_on is not stream:  # its block not yet marked used on stream
                    marked.append(alias)
                    marking.append(entry)
                if not entry.ready.ok():  # one call in the common case: done and good
                    waits.append(entry.ready)
                    if blame is not None:
                        blame.setdefault(entry.ready, []).append(key)
            elif deferred is None:
                touch_host(entry.key)
                uploads.append((i, entry, member))
            else:
                deferred.append(i)
        if marked:  # now, before anything can fail; noted once recorded
            self._device.use_all_on(marked, stream)
            for entry in marking:
                entry.used_on = stream
        host_hits = len(uploads)
        if repeats and count_repeats:
            host_at = {i for i, _, _ in uploads}
            for _, seen in repeats:
                if seen in host_at:
                    host_hits += 1
                elif out[seen] is None:
                    missed += 1
                else:
                    gpu_hits += 1
        if gpu_hits or host_hits or missed:  # not a call where every key was deferred
            self._counters.looked_up(gpu_hits, host_hits, missed)
        if blame is None:
            for fence in waits:  # a feature whose producing copy failed: an error, no copies
                if fence.done():
                    raise_if_failed(fence)
        if uploads:
            # Each fence is blamed for its own copies' keys alone: a copy that fails on one
            # stream must not fail the callers whose features came by the other.
            for fence, behind in self._upload(uploads, out, used, stream):
                waits.append(fence)
                if blame is not None:  # a loop, not a comprehension: no frame of its own
                    uploaded: list[Hashable] = []
                    for i, _, _ in behind:
                        uploaded.append(keys[i])
                    blame[fence] = uploaded
        for i, seen in repeats:
            found_tensor = out[seen]
            out[i] = None if found_tensor is None else found_tensor.detach()
        return out, waits, used

    def _upload(
        self,
        uploads: list[_Upload],
        out: list[torch.Tensor | None],
        used: list[torch.Tensor],
        stream: Stream,
    ) -> list[tuple[Fence, list[_Upload]]]:
        """Queue the host hits' copies; promote those that fit. Small ones that stay the
        reader's share one buffer copied on its stream, the rest go behind one fence on
        the H2D stream; returns the fences the reads must order after, each with the
        uploads copied behind it."""
        small = self._reads.small_copy_bytes
        on_reader: list[_Upload] = []
        on_copy_stream: list[_Upload] = []
        promoted: list[bool] = []
        shared = 0
        hits: list[tuple[Entry | Member, int]] = []  # each, with its bytes to the device
        for _, entry, member in uploads:
            if member is None:
                hits.append((entry, entry.nbytes))
            else:
                hits.append((member, member.nbytes))
        decided = self._reads.promotions(hits)  # in order: the first ones take the room
        # Per destination: the host bytes each copy reads (sliced from the arena here: a
        # batch's hot path) and the offloads that wrote them, which the copies follow.
        reader = _Copies([], [])
        copy_stream = _Copies([], [])
        for k, upload in enumerate(uploads):
            _, entry, member = upload
            nbytes = hits[k][1]
            promote = decided is not None and decided[k] and nbytes > 0
            block = entry.block
            assert block is not None
            start = block.offset
            if member is not None:  # its rows of the group's block
                start += member.start * (entry.nbytes // entry.shape[0])
            if not promote and nbytes < small:
                on_reader.append(upload)
                copies = reader
            else:
                if not promote:  # its room in the shared buffer, aligned
                    shared += -(-nbytes // UPLOAD_ALIGNMENT) * UPLOAD_ALIGNMENT
                on_copy_stream.append(upload)
                promoted.append(promote)
                copies = copy_stream
            copies.srcs.append(block.arena[start : start + nbytes])
            written = entry.copy_fence
            if written is not None and written not in copies.after:
                copies.after.append(written)
        fences: list[tuple[Fence, list[_Upload]]] = []
        if on_reader:
            fence = self._upload_on_reader(on_reader, reader, out, stream)
            if fence is not None:
                fences.append((fence, on_reader))
        if on_copy_stream:
            fence = self._upload_on_copy_stream(
                on_copy_stream, copy_stream, promoted, shared, out, used
            )
            fences.append((fence, on_copy_stream))
        return fences

    def _upload_on_reader(
        self,
        uploads: list[_Upload],
        copies: _Copies,
        out: list[torch.Tensor | None],
        stream: Stream,
    ) -> Fence | None:
        """Copy host hits that stay the reader's into one buffer on its stream; the fence
        to order after, or None where stream order covers them."""
        device = self._device
        srcs = copies.srcs
        offsets: list[int] = []
        size = 0  # the buffer's, each feature's room aligned
        for src in srcs:
            offsets.append(size)
            size += -(-src.numel() // UPLOAD_ALIGNMENT) * UPLOAD_ALIGNMENT
        try:
            buffer, fence = device.submit(
                NewCopyPlan(
                    "h2d",
                    srcs,
                    (size,),
                    offsets=offsets,
                    after=copies.after,
                    stream=stream,
                )
            )
        except DeviceOutOfMemoryError:
            self._counters.alloc_failed()
            raise
        entries: list[Entry] = []
        moved = 0  # the features' bytes, padding left out
        # The views made here, not by _typed_views: one call fewer on get_many's path.
        typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # the buffer as each dtype
        for (i, entry, member), src, offset in zip(uploads, srcs, offsets, strict=True):
            shape = entry.shape if member is None else member.shape
            dtype = entry.dtype
            as_dtype = typed.get(dtype)
            if as_dtype is None:  # offsets are aligned: the buffer is whole items of dtype
                view = buffer.view(dtype)
                as_dtype = typed[dtype] = (view, int(view.storage_offset()))
            view, base = as_dtype
            out[i] = view.as_strided(
                shape, contiguous_strides(shape), base + offset // dtype.itemsize
            )
            entries.append(entry)
            moved += src.numel()
        del srcs
        Entry.add_host_stream(entries, stream)  # the blocks' frees record a fence there
        if fence is None:  # stream order alone covers them; the buffer is the reader's
            self._counters.uploaded_on_reader_stream(moved)
            return None
        self._reads.track_upload(entries, fence, moved, stream)
        device.release(
            buffer, after=() if device.copies_keep_destinations else (fence,)
        )  # the outputs keep it alive
        return fence

    def _upload_on_copy_stream(
        self,
        uploads: list[_Upload],
        copies: _Copies,
        promoted: list[bool],
        shared: int,
        out: list[torch.Tensor | None],
        used: list[torch.Tensor],
    ) -> Fence:
        """Queue host hits' copies on the H2D stream behind one fence: the promoted ones
        into memory of their own, the others into one shared buffer."""
        reads = self._reads
        device = self._device
        srcs = copies.srcs
        dsts: list[torch.Tensor] = []
        owned: list[torch.Tensor] = []  # allocations of ours, released if queuing fails
        buffer = None
        parts: list[_Part] = []  # the features that share the buffer
        at: list[int] = []  # and their places in dsts
        try:
            try:
                buffer = device.empty((shared,), torch.uint8) if shared else None
                if buffer is not None:
                    owned.append(buffer)
                offset = 0
                for (_, entry, member), src, promote in zip(uploads, srcs, promoted, strict=True):
                    shape = entry.shape if member is None else member.shape
                    dtype = entry.dtype
                    if promote or buffer is None:
                        # The tier will own it: its own memory, typed, not a view of another.
                        dsts.append(device.empty(shape, dtype))
                        owned.append(dsts[-1])
                        continue
                    at.append(len(dsts))
                    dsts.append(buffer)  # its view's place, filled below
                    parts.append((shape, dtype, offset))
                    offset += -(-src.numel() // UPLOAD_ALIGNMENT) * UPLOAD_ALIGNMENT
                if parts:
                    assert buffer is not None
                    for place, view in zip(at, _typed_views(buffer, parts), strict=True):
                        dsts[place] = view
                    del view  # dsts holds them, and goes if queuing fails
            except DeviceOutOfMemoryError:
                self._counters.alloc_failed()
                raise
            fence = device.submit(CopyPlan("h2d", srcs, dsts, after=copies.after))
        except BaseException:
            del dsts
            while owned:  # emptied: the traceback keeps this frame, and must not keep them
                device.release(owned.pop(), after=())  # nothing was queued: nothing reads it
            buffer = None
            raise
        del srcs
        nbytes_all = 0
        entries: list[Entry] = []
        uploaded: list[tuple[Entry | Member, torch.Tensor]] = []  # those promoted
        read: set[int] = set()  # entries whose host block these copies read
        for (i, entry, member), dst, promote in zip(uploads, dsts, promoted, strict=True):
            # The caller's own alias: the tier's tensor object goes back to the device alone.
            out[i] = alias = dst.detach() if promote else dst
            if promote or buffer is None:
                used.append(alias)
            nbytes_all += dst.nbytes
            if id(entry) not in read:  # members of one group share its block
                read.add(id(entry))
                entry.add_host_reader(fence)
            if promote:
                uploaded.append((entry if member is None else member, dst))
            else:
                entries.append(entry)
                if buffer is None:  # an empty feature: its own (empty) allocation
                    device.release(dst, after=() if device.copies_keep_destinations else (fence,))
        if uploaded:
            entries.extend(reads.promote(uploaded, fence))
        if buffer is not None:
            used.append(buffer)  # one record for every view of it
            # The outputs' views keep it alive for their holders.
            device.release(buffer, after=() if device.copies_keep_destinations else (fence,))
        reads.track_upload(entries, fence, nbytes_all, None)
        return fence

    def order(self, waits: list[Fence], used: list[torch.Tensor], stream: Stream) -> None:
        """wait() where the device orders reads on streams (no await): stream waits for
        the fences, a failed one raises."""
        device = self._device
        for fence in dict.fromkeys(waits):
            if not fence.ok():
                if not fence.done():
                    device.wait_on(stream, fence)
                raise_if_failed(fence)
        if used:
            device.use_all_on(used, stream)

    async def wait(self, waits: list[Fence], used: list[torch.Tensor], stream: Stream) -> None:
        """Order the served memory after the fences it depends on, on stream (or wait)."""
        device = self._device
        if device.stream_ordered_reads:
            self.order(waits, used, stream)
            return
        pending: list[Fence] = []
        for fence in waits:
            if fence.done():
                raise_if_failed(fence)
            elif fence not in pending:
                pending.append(fence)
        if pending:  # wait_fences raises if one of them fails
            try:
                waited = await wait_fences(pending, self._reads.copy_timeout, pending=True)
                self._counters.waited(waited)
            except CopyTimeoutError:
                self._counters.quarantined()  # the memory stays pinned by the copies
                raise
        if used:
            device.use_all_on(used, stream)

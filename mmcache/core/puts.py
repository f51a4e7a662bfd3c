"""Puts: taking ownership of values, reserving room, indexing entries (checks: put_checks)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import final

import torch

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, State
from mmcache.core.evictor import Evictor
from mmcache.core.host import HostTier
from mmcache.core.offload import OffloadPipeline
from mmcache.core.packing import BATCH_BYTES, GROUP_BELOW, Packings, group_spans, runs
from mmcache.core.producer_fences import ProducerFences
from mmcache.core.put_checks import PutChecks, owns_storage
from mmcache.core.state import Release, TierState
from mmcache.device import CopyPlan, Device, Fence, NewCopyPlan, Stream
from mmcache.host_pool import HostBlock

__all__ = ["Puts"]


@final
class Puts:
    """The put path behind put, put_many and put_split, once their arguments are checked.

    Values are owned first (a view compacted into storage of its own, small features
    packed into groups), then room is reserved for all of them at once (the GPU tier's,
    or host blocks when the GPU tier is off), then they are indexed. A put that fails
    or gives up releases what it took; one that replaces keys removes them first.
    """

    def __init__(
        self,
        *,
        device: Device,
        state: TierState,
        producers: ProducerFences,
        counters: Counters,
        evictor: Evictor,
        host: HostTier,
        landings: OffloadPipeline,
        packings: Packings,
        checks: PutChecks,
        carry_out: Callable[[Sequence[Release]], None],
        drop_if_failed: Callable[[Entry, Fence], None],
        when_done: Callable[[Sequence[Fence], Callable[[], None]], None],
        changed: Callable[[], None],
        gpu_capacity: int,
    ) -> None:
        self._device = device
        self._state = state
        self._producers = producers
        self._counters = counters
        self._ledger = state.ledger  # read here; changed through the state's verbs
        self._index = state.index  # likewise
        self._evictor = evictor
        self._host = host
        self._landings = landings
        self._carry_out = carry_out
        self._check_ready = drop_if_failed
        self._packings = packings
        self._checks = checks
        self._when_done = when_done
        self._changed = changed
        self._gpu_capacity = gpu_capacity
        self._small_copy_bytes = state.small_copy_bytes

    def takes_new(self, key: Hashable, value: object) -> bool:
        """Whether put_new can take a put of value under key: a new key, and a device tensor
        that owns its storage and fits the GPU tier."""
        return (
            isinstance(value, torch.Tensor)
            and self._device.is_device_tensor(value)  # first: nbytes raises for some layouts
            and 0 < value.nbytes <= self._gpu_capacity
            and key not in self._index
            and owns_storage(value)
        )

    async def put_new(
        self,
        key: Hashable,
        holder: list[torch.Tensor],
        stream: Stream,
        wait: bool,
        cost: float | None = None,
    ) -> bool:
        """put of one new key's device tensor that owns its storage and fits the GPU tier
        (takes_new), of a cache serving on this loop.

        What put_batch and _insert_units do for it, without their lists and loops, which
        a put of one feature would pay for on every call (BENCHMARKS.md). A put that must
        wait for room continues through _insert_units.
        """
        tensor = holder.pop()
        nbytes = tensor.nbytes
        ready = self._producers.fence(stream)
        own = self._device.adopt(tensor, stream)
        del tensor
        try:
            # Room now, nobody waiting before it: indexed with no grant and no await.
            admitted = self._evictor.room_for(nbytes)
            if admitted:
                shape = tuple(own.shape)
                entry = Entry(key, shape, own.dtype, nbytes, State.GPU, own, ready, cost=cost)
                self._state.admit(entry)
                del entry
        except BaseException:
            self._give_back([(own, ready)], [], [[]])
            del own  # nor may the traceback of a put that failed keep it alive
            raise
        if not admitted:
            return await self._insert_units(
                [key], [], [(0, 1)], [nbytes], [(own, ready)], [[]], ready, wait, cost
            )
        # No put waits now (room_for admits nothing ahead of one): none to wake.
        self._changed()
        return True

    async def put_rows(
        self,
        keys: list[Hashable],
        holder: list[torch.Tensor],
        rows: list[int],
        stream: Stream,
        wait: bool,
    ) -> bool:
        """put_split once its arguments are checked; holder is emptied once the cache owns it.

        The tensor is one unit when one host block can take it; otherwise runs of its
        features up to BATCH_BYTES each are copied into storage of their own.
        """
        tensor = holder[0]
        row_bytes = tensor.nbytes // tensor.shape[0]
        sizes = [n * row_bytes for n in rows]
        total = tensor.nbytes
        to_gpu = self._gpu_capacity > 0
        if not to_gpu and self._host.capacity == 0:
            return False
        checks = self._checks
        checks.check_fits(max(sizes), to_gpu)  # one feature too large: names the setting
        checks.check_group_fits(total, to_gpu)
        host_limit = self._host.limit()
        if len(keys) == 1 or not host_limit or total <= host_limit:
            spans = [(0, len(keys))]
        else:
            spans = runs(sizes, None, min(BATCH_BYTES, host_limit))
        produced = self._producers.fence(stream)
        owned: list[tuple[torch.Tensor, Fence]] = []
        try:
            if len(spans) == 1:
                owned.append(self._own(tensor, stream, produced))
            else:
                starts = [0, *itertools.accumulate(rows)]
                for i, j in spans:
                    owned.append(self._own(tensor[starts[i] : starts[j]], stream, produced))
        except BaseException:
            self._give_back(owned, [], [[] for _ in owned])
            raise
        holder.clear()
        del tensor
        return await self._insert_units(
            keys, rows, spans, sizes, owned, [[] for _ in spans], produced, wait
        )

    async def put_batch(
        self,
        items: list[tuple[Hashable, torch.Tensor]],
        stream: Stream,
        wait: bool,
        cost: float | None = None,
    ) -> bool:
        """put for one or more features: check all, take all, reserve once, insert all.

        Small features of one put_many that share dtype and row shape become groups
        (packing.group_spans): each is packed into one device tensor and cached as one entry.
        items is emptied once the cache owns the values. cost: put's, for a single feature.
        """
        keys = []
        sizes = []
        to_gpu = self._gpu_capacity > 0
        # Checked in one pass (keys are checked by put and put_many): per feature, every
        # call here is paid thousands of times a second for small features.
        if to_gpu:
            limit: float = self._gpu_capacity
        else:  # both tiers off: put returns False below, once every value is checked
            limit = self._host.limit() if self._host.capacity else math.inf
        on_device = self._device.is_device_tensor
        checks = self._checks
        for key, tensor in items:
            keys.append(key)
            if not isinstance(tensor, torch.Tensor) or not on_device(tensor):
                checks.check_value(tensor)  # raises, saying what is wrong
            nbytes = tensor.nbytes
            if nbytes == 0 or nbytes > limit:
                checks.check_value(tensor)  # raises for an empty tensor
                checks.check_fits(nbytes, to_gpu)  # raises, with the setting to change
            sizes.append(nbytes)
        total = sum(sizes)
        if not to_gpu and self._host.capacity == 0:
            return False
        checks.check_group_fits(total, to_gpu)
        if len(items) == 1:
            spans = [(0, 1)]
        else:
            below = min(self._small_copy_bytes, GROUP_BELOW)
            spans = group_spans(items, sizes, below, self._host.limit())
            if self._packings:
                self._packings.reap()  # the values of earlier groups, already read
        # Rows of each feature, for the members' ranges.
        rows = [t.shape[0] if t.dim() else 1 for _, t in items] if len(spans) < len(items) else []
        produced: Fence | None = None  # recorded for single features only: groups have their own
        owned: list[tuple[torch.Tensor, Fence]] = []
        # A group's values, held until its packing copy has read them (none for a single).
        sources: list[list[torch.Tensor]] = []
        try:
            for i, j in spans:
                if j - i == 1:
                    if produced is None:
                        produced = self._producers.fence(stream)
                    owned.append(self._own(items[i][1], stream, produced))
                    sources.append([])
                else:
                    values = [tensor for _, tensor in items[i:j]]
                    owned.append(self._pack(values, stream))
                    sources.append(values)
                    del values
        except BaseException:
            self._give_back(owned, [], sources)
            raise
        # From here on the cache owns the values: no frame of ours (nor a traceback of a
        # failed put) may keep the caller's tensors alive past their release.
        items.clear()
        del tensor
        return await self._insert_units(
            keys, rows, spans, sizes, owned, sources, produced, wait, cost
        )

    async def _insert_units(
        self,
        keys: list[Hashable],
        rows: list[int],
        spans: list[tuple[int, int]],
        sizes: list[int],
        owned: list[tuple[torch.Tensor, Fence]],
        sources: list[list[torch.Tensor]],
        produced: Fence | None,
        wait: bool,
        cost: float | None = None,
    ) -> bool:
        """Second half of a put: reserve room for the owned units, then index them.

        Unit u holds the features keys[i:j] of spans[u] (one entry, or a group whose
        members have rows[i:j] rows each); sources[u] are the values its packing copy
        reads, produced the fence of the producer's stream, if recorded. cost is that of
        every single feature (put gives one at most; groups have none).
        """
        to_gpu = self._gpu_capacity > 0
        total = sum(sizes)
        # Replace first, then reserve: the old values' bytes must not push others out
        # (nor be offloaded for nothing). A put that then fails leaves them absent.
        self._remove_keys(keys, wake=True)
        blocks: list[HostBlock] = []
        state = self._state
        grant = state.open_grant()
        try:
            # Without room now, a put waits (yielding to the loop); a put that finds it, the
            # common case, takes it without a coroutine of its own.
            waited = True
            try:
                if to_gpu:
                    ok = self._evictor.take(total, grant)
                    if ok:
                        waited = False
                    elif wait:
                        await self._evictor.wait(total, grant)
                        ok = True
                else:
                    unit_sizes = [sum(sizes[i:j]) for i, j in spans]
                    ok = await self._host.reserve(unit_sizes, wait, blocks, self._landings)
            except BaseException:
                self._evictor.give_back(grant)
                self._give_back(owned, blocks, sources)
                raise
            if not ok:
                self._give_back(owned, blocks, sources)
                self._counters.refused(len(keys))
                return False
            made: list[Entry] = []
            try:
                offloads, compacted = self._index_units(
                    keys, rows, spans, sizes, owned, sources, produced, blocks, made, waited, cost
                )
            except BaseException:
                # Nothing of a put that fails here stays: its entries leave the index, and
                # its budget and values go back.
                self._unindex(made)
                self._evictor.give_back(grant)
                self._give_back(owned, blocks, sources)
                raise
            if to_gpu:
                state.inserted(grant, total, len(keys))
        finally:
            state.close_grant(grant)
        if to_gpu:
            if self._evictor.waiting:
                self._evictor.wake()  # the next waiter may need these entries offloaded
        else:
            self._evictor.offload(offloads, charged_gpu=False)
        # Our compaction copies may fail (or have failed while we waited for room): such
        # an entry is dropped, once it is in the tier's lists and counts like the others.
        for entry in compacted:
            self._when_done([entry.ready], functools.partial(self._check_ready, entry, entry.ready))
        self._changed()
        return True

    def _index_units(
        self,
        keys: list[Hashable],
        rows: list[int],
        spans: list[tuple[int, int]],
        sizes: list[int],
        owned: list[tuple[torch.Tensor, Fence]],
        sources: list[list[torch.Tensor]],
        produced: Fence | None,
        blocks: list[HostBlock],
        made: list[Entry],
        waited: bool,
        cost: float | None,
    ) -> tuple[list[tuple[Entry, HostBlock]], list[Entry]]:
        """Index a put's units once their room is reserved (appending each entry to made).

        Returns the host-tier offloads to start (GPU tier off) and the entries whose
        compaction copies to check.
        """
        if waited:
            self._remove_keys(keys, wake=False)  # other puts of these keys done meanwhile
        to_gpu = self._gpu_capacity > 0
        offloads: list[tuple[Entry, HostBlock]] = []
        compacted: list[Entry] = []
        state = self._state
        for u, ((i, j), (own, ready)) in enumerate(zip(spans, owned, strict=True)):
            if j - i == 1:
                key = keys[i]
                entry = Entry(
                    key, tuple(own.shape), own.dtype, sizes[i], State.GPU, own, ready, cost=cost
                )
                made.append(entry)
                state.index_entry(entry, to_gpu)
            else:
                entry = state.index_group(keys[i:j], rows[i:j], own, ready, sum(sizes[i:j]), to_gpu)
                made.append(entry)
            if sources[u]:
                # Its values stay referenced until the packing copy has read them, and a
                # packing that failed drops the group then.
                self._packings.hold(ready, sources[u], entry)
            elif ready is not produced:
                compacted.append(entry)
            if not to_gpu:
                offloads.append((entry, blocks[u]))
        return offloads, compacted

    def _unindex(self, made: list[Entry]) -> None:
        """Take the entries of a failed put out of the index; its caller gives back the rest."""
        self._state.unindex(made)  # their tensors go back with the put's owned values

    def _remove_keys(self, keys: list[Hashable], *, wake: bool) -> None:
        """Remove what the index holds under keys (a put replacing them); wake: after each
        removal, let waiting puts use the room it made."""
        index = self._state.index
        if index.keys().isdisjoint(keys):
            return
        for key in keys:
            old = index.get(key)
            if old is not None:
                self._carry_out(self._state.remove(old))
                if wake:
                    self._evictor.wake()

    def _own(self, value: torch.Tensor, stream: Stream, ready: Fence) -> tuple[torch.Tensor, Fence]:
        """The cache's own alias of value; a view of a larger storage is compacted first."""
        if owns_storage(value):
            return self._device.adopt(value, stream), ready
        # Charging the budget for a view would under-count what it keeps alive: copy it
        # into storage of its own, ordered after the producer on the producer's stream.
        own = self._allocate(tuple(value.shape), value.dtype, stream)
        return own, self._device.submit(CopyPlan("d2d", (value,), (own,), stream=stream))

    def _pack(self, values: list[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A group's values packed into one device tensor of the cache's own, on stream."""
        with self._counters.counting_oom():
            packed, fence = self._device.submit(
                NewCopyPlan("d2d", values, rows=True, stream=stream)
            )
        assert fence is not None  # a d2d copy always has one
        return packed, fence

    def _allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """device.empty, counting an out-of-memory failure before it reaches the caller."""
        with self._counters.counting_oom():
            return self._device.empty(shape, dtype, stream)

    def _give_back(
        self,
        owned: list[tuple[torch.Tensor, Fence]],
        blocks: list[HostBlock],
        sources: list[list[torch.Tensor]],
    ) -> None:
        """Undo a put that took its values but will not insert them (emptying the lists).

        Emptied because the frames of a put that failed, which its traceback keeps, must
        not keep the values alive past their release.
        """
        assert len(owned) == len(sources)
        while owned:
            own, ready = owned.pop()
            values = sources.pop()
            self._device.release(own, after=[ready])
            del own
            if values:  # a packing copy may still read them
                self._packings.hold(ready, values, None)
        for block in blocks:
            self._state.free_block(block)
        blocks.clear()

"""Lifecycle: an entry's ways out of the cache and back onto the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import torch

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member, State
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.core.policy import EvictionPolicy
from mmcache.device import Device, Fence

__all__ = ["Lifecycle"]

WhenDone = Callable[[Sequence[Fence], Callable[[], None]], None]


@final
class Lifecycle:
    """Removes entries (discarded, replaced, dropped, lost) and promotes host hits.

    An entry leaves the index at once; its memory is released only after the fences of
    every copy that uses it, and its device bytes stay in the ledger until then.
    """

    def __init__(
        self,
        *,
        device: Device,
        ledger: TierLedger,
        counters: Counters,
        index: KeyIndex,
        gpu_order: EvictionPolicy,
        when_done: WhenDone,
        room_freed: Callable[[], None],
        changed: Callable[[], None],
    ) -> None:
        self._device = device
        self._ledger = ledger
        self._counters = counters
        self._index = index
        self._gpu_order = gpu_order
        self._when_done = when_done
        self._room_freed = room_freed  # hands GPU room on to waiting puts
        self._changed = changed  # the tiers' figures changed
        self._host: HostTier | None = None
        self._charged: Callable[[Entry], bool] = lambda entry: False

    def attach(self, host: HostTier, charged: Callable[[Entry], bool]) -> None:
        """The host tier, and whether an offload in flight is GPU-charged (the pipeline's)."""
        self._host = host
        self._charged = charged

    def remove(self, found: Entry | Member) -> None:
        """Remove a key's feature: its entry, or its place in a group."""
        if isinstance(found, Member):
            self.leave_group(found)
        else:
            self.unlink(found)

    def leave_group(self, member: Member) -> None:
        """Remove a member from the index; its group goes with its last member.

        Its rows stay charged to the group's tier until then: a group is one block of
        memory on either side, and slicing it would cost the copies it saves.
        """
        if not self._index.leave(member):
            return
        group = member.group
        state = group.state
        ledger = self._ledger
        if state is State.GPU:
            ledger.gpu_left(1)
        elif state is State.HOST:
            ledger.host_left(1)
        elif state is State.D2H:  # counted in the host tier since queued, in the GPU one if charged
            ledger.host_left(1)
            if self._charged(group):
                ledger.gpu_left(1)
        if group.count == 0:
            self.unlink(group)

    def unlink(self, entry: Entry) -> None:
        """Remove entry from the index and release what it holds after its fences."""
        self._index.forget(entry)
        state = entry.state
        tensor = entry.discard()
        if state is State.GPU:
            self._gpu_order.pop(entry.key, None)
            self._ledger.gpu_left(entry.count)
            assert tensor is not None
            self.release_device(
                tensor, entry.nbytes, [entry.ready, *entry.device_readers_pending()]
            )
        elif state is State.HOST:
            assert self._host is not None
            self._host.order.pop(entry.key, None)
            self._host.free_block(entry)
        # State.D2H: its landing releases both sides once the copy has finished.

    def drop(self, entry: Entry) -> None:
        """Lose an entry (a GPU one the host tier cannot take now, or a destroyed one)."""
        self._counters.lost(entry.count)
        self.unlink(entry)

    def lose(self, entry: Entry) -> None:
        """Drop an entry whose data a failed copy destroyed, and hand its room on."""
        self.drop(entry)
        self._room_freed()

    def check_ready(self, entry: Entry, ready: Fence) -> None:
        """A put whose producing copy failed (a compaction) must not serve poison: drop it."""
        if ready.exception() is None or entry.ready is not ready:
            return
        self._counters.copy_failed("compaction", entry.key, ready.exception())
        if entry.state is not State.GONE:
            self.lose(entry)

    def offload_lost(self, entry: Entry, failed: BaseException | None) -> None:
        """An offloaded entry that was discarded meanwhile, or whose copy failed."""
        if entry.state is State.D2H:  # the copy failed: the feature is lost
            self._counters.copy_failed("offload", entry.key, failed)
            self._counters.lost(self._index.forget(entry))
            entry.discard()  # its landing has released the tensor already
        assert self._host is not None
        self._host.free_block(entry)

    def release_device(self, tensor: torch.Tensor, nbytes: int, after: Sequence[Fence]) -> None:
        """Release a device tensor charged to the GPU tier once after's fences are done."""
        pending = [f for f in after if not f.done()]
        self._device.release(tensor, after=pending)
        ledger = self._ledger
        if not pending:
            ledger.release(nbytes)
            return
        ledger.release_later(nbytes)

        def released() -> None:
            ledger.released(nbytes)
            self._room_freed()

        self._when_done(pending, released)

    def promote_member(self, member: Member, tensor: torch.Tensor, fence: Fence) -> Entry:
        """A GPU-resident entry of its own for a group member, from its uploaded rows."""
        group = member.group
        entry = Entry(
            member.key, member.shape, group.dtype, member.nbytes, State.GPU, tensor, fence
        )
        self.leave_group(member)
        self._index[entry.key] = entry
        self._promoted(entry)
        return entry

    def promote_entry(self, entry: Entry, tensor: torch.Tensor, fence: Fence) -> None:
        """Make entry GPU-resident again (exclusive tiers: its host block is freed)."""
        assert self._host is not None
        self._host.order.pop(entry.key, None)
        self._host.free_block(entry)
        entry.promote(tensor, fence)
        self._promoted(entry)

    def _promoted(self, entry: Entry) -> None:
        """Charge a promoted GPU-state entry to the GPU tier, most recently used."""
        self._ledger.promote(entry.nbytes)
        self._gpu_order[entry.key] = entry
        self._counters.promoted()
        self._changed()

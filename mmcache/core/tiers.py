"""Tiers: the tier state and the parts that carry out its decisions, built and wired."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import final

from mmcache.budget import FifoBudget
from mmcache.core.batch_reads import BatchReads
from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, Member
from mmcache.core.evictor import Evictor
from mmcache.core.grants import Grant
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex
from mmcache.core.offload import OffloadPipeline
from mmcache.core.packing import Packings
from mmcache.core.producer_fences import ProducerFences
from mmcache.core.put_checks import PutChecks
from mmcache.core.puts import Puts
from mmcache.core.reads import Reads
from mmcache.core.state import Release, TierState
from mmcache.core.turn_reads import TurnReads, WhenDone
from mmcache.device import DONE, Device, Fence, Stream
from mmcache.metrics import CacheMetrics
from mmcache.node_host import NodeHost
from mmcache.settings import CacheSettings
from mmcache.stats import CacheStats

__all__ = ["Tiers"]


@final
class Tiers:
    """One cache's TierState and the parts around it, which carry out what it decides.

    The state (core/state.py) owns the index, both tiers' ledgers and orders and every
    entry transition, and returns what is left to the device as values; the parts here
    queue copies, await fences and report back through its verbs. carry_out() is the one
    place that releases memory the state gave up, and room_freed() the one wake-up for
    puts waiting for room. docs/design.md draws them and the paths.
    """

    def __init__(
        self,
        settings: CacheSettings,
        device: Device,
        metrics: CacheMetrics,
        *,
        when_done: WhenDone,
        when_done_lazily: Callable[[Fence, Callable[[], None], Stream | None], None],
        changed: Callable[[], None],
        node: NodeHost | None = None,
    ) -> None:
        self._metrics = metrics
        self._device = device
        self._when_done = when_done
        self._changed = changed  # the tiers' figures changed: push them (once a loop turn)
        gpu_capacity = settings.gpu_cache_bytes
        self.counters = counters = Counters(metrics)
        self.state = state = TierState(
            gpu_capacity=gpu_capacity,
            policy=settings.eviction_policy,
            counters=counters,
            done_fence=DONE,
            mark=device.record,
            evict_ahead=int(gpu_capacity * settings.evict_ahead),
            small_copy_bytes=settings.small_copy_bytes,
            admission=settings.promote_on_hit and settings.promote_policy == "tinylfu",
        )
        self.producers = ProducerFences(device)
        self.host = host = HostTier(
            device,
            state,
            settings.cpu_cache_bytes,
            alignment=settings.host_alignment,
            carry_out=self.carry_out,
            node=node,
        )
        # Puts waiting for GPU room, granted into their grants in arrival order.
        gpu_line: FifoBudget[tuple[int, Grant], Grant] = FifoBudget(
            state.take_if_free, state.return_grant
        )
        self.pipeline = pipeline = OffloadPipeline(
            device=device,
            state=state,
            counters=counters,
            carry_out=self.carry_out,
            after_landing=self.landed,
            lines=(gpu_line.line, host.line),
            changed=changed,
            copy_timeout=settings.copy_timeout_s,
        )
        self.evictor = evictor = Evictor(
            device=device,
            state=state,
            counters=counters,
            pipeline=pipeline,
            waiting=gpu_line,
            carry_out=self.carry_out,
            evict_ahead=int(gpu_capacity * settings.evict_ahead),
        )
        self.packings = Packings(when_done, self.drop_if_failed)
        self.put_checks = PutChecks(
            device=device,
            host=host,
            gpu_capacity=gpu_capacity,
            how_to_change=settings.how_to_change,
        )
        self.puts = Puts(
            device=device,
            state=state,
            producers=self.producers,
            counters=counters,
            evictor=evictor,
            host=host,
            landings=pipeline,
            packings=self.packings,
            checks=self.put_checks,
            carry_out=self.carry_out,
            drop_if_failed=self.drop_if_failed,
            when_done=when_done,
            changed=changed,
            gpu_capacity=gpu_capacity,
        )
        self.reads = reads = Reads(
            device=device,
            state=state,
            counters=counters,
            host=host,
            pipeline=pipeline,
            carry_out=self.carry_out,
            evict=evictor.carry_out,
            room_freed=self.room_freed,
            changed=changed,
            gpu_waiting=evictor.waiting,
            when_done=when_done,
            when_done_lazily=when_done_lazily,
            promote=settings.promote_on_hit,
            copy_timeout=settings.copy_timeout_s,
            small_copy_bytes=settings.small_copy_bytes,
        )
        self.batch_reads = batch_reads = BatchReads(
            device=device, state=state, counters=counters, reads=reads
        )
        self.turn_reads = TurnReads(
            batch_reads, device, counters, when_done, settings.copy_timeout_s
        )

    @property
    def index(self) -> KeyIndex:
        """Key -> its entry or group member (the state's index; read-only for callers)."""
        return self.state.index

    def carry_out(self, releases: Iterable[Release]) -> None:
        """Release the device memory the state gave up, each tensor after its fences."""
        device = self._device
        for release in releases:
            device.release(release.tensor, after=release.after)
            if release.later:
                self._when_done(
                    release.after, functools.partial(self._released_later, release.later)
                )

    def remove(self, found: Entry | Member) -> None:
        """Remove a key's feature (discard, close) and hand on the room it made."""
        self.carry_out(self.state.remove(found))

    def drop_if_failed(self, entry: Entry, ready: Fence) -> None:
        """Drop a put whose producing copy failed (a compaction, a packing), handing its
        room on."""
        releases = self.state.drop_if_failed(entry, ready)
        if releases:
            self.carry_out(releases)
            self.room_freed()

    def _released_later(self, nbytes: int) -> None:
        self.state.released(nbytes)
        self.room_freed()

    def landed(self, charged_gpu: bool) -> None:
        """An offload has landed: hand the room it made on."""
        if charged_gpu:
            self.evictor.wake()
        elif self.host.waiting:  # a put straight to the host tier can evict them now
            self.host.wake()
        self._changed()

    def room_freed(self) -> None:
        """GPU room came back: hand it on to waiting puts."""
        self.evictor.wake()
        self._changed()

    def closing(self) -> None:
        """No put inserts from now on, nor arms a timer of its own (the cache is closing)."""
        self.packings.close()
        self.host.close()
        self.evictor.close()

    def fail_waiting(self) -> None:
        """Raise CacheClosedError in every put waiting for room; watch landings at once."""
        self.pipeline.close()
        self.evictor.fail_waiting()
        self.host.fail_waiters()

    def push_gauges(self) -> None:
        """Tier sizes to the metrics."""
        ledger = self.state.ledger
        self._metrics.set_tier("gpu", ledger.used, ledger.gpu_entries)
        pool = self.state.pool
        self._metrics.set_tier("cpu", pool.used_bytes if pool else 0, ledger.cpu_entries)

    def stats(self) -> CacheStats:
        """A snapshot of the ledger, the host tier and the counters, with the audit's leaks."""
        leaked = self.audit()
        state = self.state
        ledger = state.ledger
        pool = state.pool
        quarantine = state.quarantine
        return CacheStats(
            gpu_bytes=ledger.used,
            cpu_bytes=pool.used_bytes if pool else 0,
            gpu_capacity_bytes=ledger.capacity,
            cpu_capacity_bytes=pool.capacity_bytes if pool else self.host.capacity,
            gpu_entries=ledger.gpu_entries,
            cpu_entries=ledger.cpu_entries,
            pending_copies=self.counters.pending_copies,
            leaked_bytes=leaked["gpu"] + leaked["cpu"],
            quarantined_bytes=quarantine.device_bytes() + quarantine.host_bytes(),
            host_ready=self.host.ready,
            host_ready_bytes=self.host.ready_bytes,
            node_host_bytes=self._node_host_bytes(),
            **self.counters.as_dict(),
        )

    def _node_host_bytes(self) -> int:
        """Bytes the node's shared host tier holds, each feature once (0: none shared)."""
        node = self.host.node
        usage = node.usage() if node is not None else None
        return 0 if usage is None else usage.used_bytes

    def audit(self) -> dict[str, int]:
        """Bytes in the ledgers that no entry, copy or pending release owns (should be 0)."""
        state = self.state
        pool = state.pool
        quarantine = state.quarantine
        leaked = state.ledger.leaked(
            state.index.held(),
            state.in_flight(),
            pool.used_bytes - pool.freeing_bytes if pool else 0,
            (quarantine.device_bytes(), quarantine.host_bytes()),
        )
        for tier, nbytes in leaked.items():
            self._metrics.set_leaked(tier, nbytes)
        return leaked

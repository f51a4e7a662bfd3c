"""Tiers: the parts of one cache, built and wired together."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

from mmcache.core.batch_reads import BatchReads
from mmcache.core.counters import Counters
from mmcache.core.evictor import Evictor
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex
from mmcache.core.ledger import TierLedger
from mmcache.core.lifecycle import Lifecycle
from mmcache.core.offload import OffloadPipeline
from mmcache.core.packing import Packings
from mmcache.core.policy import make_policy
from mmcache.core.producer_fences import ProducerFences
from mmcache.core.puts import Puts
from mmcache.core.quarantine import Quarantine
from mmcache.core.reads import Reads
from mmcache.device import Device, Fence
from mmcache.metrics import CacheMetrics
from mmcache.settings import CacheSettings
from mmcache.stats import CacheStats

__all__ = ["Tiers"]

WhenDone = Callable[[Sequence[Fence], Callable[[], None]], None]


@final
class Tiers:
    """Every part of one cache, each owning its state, and the few hand-overs between them.

    The parts call each other's methods only; what one part must tell another that
    it cannot know of (room came back, an offload landed) goes through the methods here.
    docs/design.md draws them and the paths of a put, an eviction, a landing and a hit.
    """

    def __init__(
        self,
        settings: CacheSettings,
        device: Device,
        metrics: CacheMetrics,
        *,
        when_done: WhenDone,
        when_done_lazily: Callable[[Fence, Callable[[], None]], None],
        changed: Callable[[], None],
    ) -> None:
        self._metrics = metrics
        self._changed = changed  # the tiers' figures changed: push them (once a loop turn)
        gpu_capacity = settings.gpu_cache_bytes
        self.ledger = ledger = TierLedger(gpu_capacity)
        self.counters = counters = Counters(metrics)
        self.index = index = KeyIndex()
        self.producers = ProducerFences(device)
        # The order of GPU victims only; the byte ledger is ours. LRU, the default, is an
        # OrderedDict: every offloaded feature is inserted, evicted and re-inserted there.
        self.gpu_order = make_policy(settings.eviction_policy)
        self.life = life = Lifecycle(
            device=device,
            ledger=ledger,
            counters=counters,
            index=index,
            gpu_order=self.gpu_order,
            when_done=when_done,
            room_freed=self.room_freed,
            changed=changed,
        )
        self.host = host = HostTier(
            device,
            settings.cpu_cache_bytes,
            alignment=settings.host_alignment,
            policy=settings.eviction_policy,
            counters=counters,
            ledger=ledger,
            unlink=life.unlink,
        )
        self.quarantine = Quarantine()
        self.pipeline = pipeline = OffloadPipeline(
            device=device,
            ledger=ledger,
            counters=counters,
            index=index,
            quarantine=self.quarantine,
            host_insert=host.order.__setitem__,
            release_device=life.release_device,
            lost=life.offload_lost,
            after_landing=self.landed,
            urgent=self.waiting_for_room,
            changed=changed,
            copy_timeout=settings.copy_timeout_s,
        )
        life.attach(host, pipeline.charged)
        self.evictor = evictor = Evictor(
            device=device,
            ledger=ledger,
            counters=counters,
            index=index,
            order=self.gpu_order,
            host=host,
            pipeline=pipeline,
            drop=life.drop,
            evict_ahead=int(gpu_capacity * settings.evict_ahead),
            small_copy_bytes=settings.small_copy_bytes,
        )
        self.packings = Packings(when_done, life.check_ready)
        self.puts = Puts(
            device=device,
            producers=self.producers,
            counters=counters,
            ledger=ledger,
            index=index,
            gpu_order=self.gpu_order,
            evictor=evictor,
            host=host,
            landings=pipeline,
            life=life,
            packings=self.packings,
            when_done=when_done,
            changed=changed,
            gpu_capacity=gpu_capacity,
            small_copy_bytes=settings.small_copy_bytes,
            how_to_change=settings.how_to_change,
        )
        self.reads = reads = Reads(
            device=device,
            counters=counters,
            ledger=ledger,
            host=host,
            pipeline=pipeline,
            life=life,
            gpu_order=self.gpu_order,
            gpu_waiting=evictor.waiting,
            when_done=when_done,
            when_done_lazily=when_done_lazily,
            promote=settings.promote_on_hit,
            copy_timeout=settings.copy_timeout_s,
            small_copy_bytes=settings.small_copy_bytes,
        )
        self.batch_reads = BatchReads(
            device=device,
            counters=counters,
            index=index,
            reads=reads,
            gpu_order=self.gpu_order,
            host_order=host.order,
        )

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

    def waiting_for_room(self) -> bool:
        """Whether a put waits for room in either tier."""
        return bool(self.evictor.waiting) or self.host.waiting

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
        ledger = self.ledger
        self._metrics.set_tier("gpu", ledger.used, ledger.gpu_entries)
        pool = self.host.pool
        self._metrics.set_tier("cpu", pool.used_bytes if pool else 0, ledger.cpu_entries)

    def stats(self) -> CacheStats:
        """A snapshot of the ledger, the host tier and the counters, with the audit's leaks."""
        leaked = self.audit()
        ledger = self.ledger
        pool = self.host.pool
        return CacheStats(
            gpu_bytes=ledger.used,
            cpu_bytes=pool.used_bytes if pool else 0,
            gpu_capacity_bytes=ledger.capacity,
            cpu_capacity_bytes=pool.capacity_bytes if pool else self.host.capacity,
            gpu_entries=ledger.gpu_entries,
            cpu_entries=ledger.cpu_entries,
            pending_copies=self.counters.pending_copies,
            leaked_bytes=leaked["gpu"] + leaked["cpu"],
            quarantined_bytes=self.quarantine.device_bytes() + self.quarantine.host_bytes(),
            host_ready=self.host.ready,
            host_ready_bytes=self.host.ready_bytes,
            **self.counters.as_dict(),
        )

    def audit(self) -> dict[str, int]:
        """Bytes in the ledgers that no entry, copy or pending release owns (should be 0)."""
        pool = self.host.pool
        quarantine = self.quarantine
        leaked = self.ledger.leaked(
            self.index.held(),
            self.pipeline.in_flight(),
            pool.used_bytes - pool.freeing_bytes if pool else 0,
            (quarantine.device_bytes(), quarantine.host_bytes()),
        )
        for tier, nbytes in leaked.items():
            self._metrics.set_leaked(tier, nbytes)
        return leaked

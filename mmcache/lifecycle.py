"""Lifecycle: what one FeatureCache owns and the loop it serves on, from construction to close.

The parts are built together or not at all (a part that fails lets go of those built
before it: the device the cache opened, its metrics), bound to the loop that starts the
cache, drained, and closed in order: the group's agreement first (a stuck peer must not
hold the close up), then puts waiting for room fail, running computations finish (each
within the close's timeout), the remote tier sends what it can (within
remote_timeout_sec), every entry is removed, the offloads and packing copies in flight
land (within the timeout), and the device closes last, off the loop.

The binding (the loop, its thread, closed or not) is read by every call of the facade:
`serving` is the loop while the cache is started and open, so that a call on it checks
one attribute. No locks: the cache's state changes only on that loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Any, final

import torch
from prometheus_client import CollectorRegistry

from mmcache.agreement import Agreement, check_group
from mmcache.closing import CloseOnce, off_the_loop
from mmcache.core.machine import check_budgets_fit
from mmcache.core.thread_hits import DRAIN_DELAY_S, ThreadHits
from mmcache.core.tiers import Tiers
from mmcache.device import Device, Fence, resolve_device
from mmcache.errors import CacheClosedError, CopyTimeoutError, WrongLoopError
from mmcache.host_copy import warm_up as warm_host_copies
from mmcache.metrics import CacheMetrics, DeferredPush, ensure_metrics_server
from mmcache.node_host import check_host_share, node_host_for
from mmcache.remote.tier import remote_tier_for
from mmcache.settings import CacheSettings
from mmcache.single_flight import SingleFlight
from mmcache.stats import CacheStats
from mmcache.waiting import FenceWatcher

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Lifecycle"]


@final
class Lifecycle:
    """One cache's parts (device, metrics, agreement, tiers, thread hits, remote tier,
    computations) and its binding to a loop: built, started, checked, drained, closed."""

    def __init__(
        self,
        settings: CacheSettings,
        device: str | Device,
        *,
        name: str,
        registry: CollectorRegistry | None,
        group: ProcessGroup | None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.thread = 0  # the loop's thread
        self.closed = False
        self.serving: asyncio.AbstractEventLoop | None = None  # the loop, while started and open
        if group is not None:
            check_group(group)  # before anything is allocated
        check_host_share(settings, group)
        self._owns_device = not isinstance(device, Device)
        self.device = resolve_device(device)
        try:
            check_budgets_fit(settings, self.device)  # before anything is registered
        except BaseException:
            if self._owns_device:
                self.device.close()
            raise
        self.metrics = CacheMetrics(name, registry)
        self.agreement: Agreement | None = None
        if group is not None:
            try:
                self.agreement = Agreement(
                    group, cache_name=name, device_name=self.device.name, metrics=self.metrics
                )
            except BaseException:
                self.metrics.close()
                if self._owns_device:
                    self.device.close()
                raise
        self.metrics.set_capacity("gpu", settings.gpu_cache_bytes)
        self.gauges = DeferredPush(self._push_tier_gauges)
        # Bound to the loop at start; its verbs are handed to the parts now.
        self._watcher = watcher = FenceWatcher()
        self.closing = CloseOnce()
        self.core = core = Tiers(
            settings,
            self.device,
            self.metrics,
            when_done=watcher.when_done,
            when_done_lazily=watcher.when_done_lazily,
            changed=self.gauges.request,
            node=node_host_for(settings, name, self.agreement, self.device),
        )
        # Resident hits served to other threads without a hand-off to the loop; the loop
        # applies their counts and recency (before each eviction plan, and stats()).
        self.thread_hits = ThreadHits(
            index=core.index,
            device=self.device,
            counters=core.counters,
            gpu_order=core.state.gpu_order,
        )
        core.state.run_before_plans(self.thread_hits.apply, self.thread_hits.unapplied)
        # The shared third tier (remote_url): asked on local misses, written in the background.
        self.remote = remote_tier_for(
            settings,
            name=name,
            core=core,
            device=self.device,
            changed=self.gauges.request,
            metrics=self.metrics,
        )
        # get_or_compute's computations, one per key: close waits for those running.
        self.inflight: SingleFlight[tuple[torch.Tensor, Fence]] = SingleFlight()

    async def start(self) -> None:
        """Bind to the running event loop and allocate the host arena (in the background)."""
        if self.closed:
            raise CacheClosedError("this FeatureCache was closed; create a new one")
        if self.loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.loop = self.serving = loop
        self.thread = threading.get_ident()
        # The first hit of a burst has the loop drain them DRAIN_DELAY_S later, not at once:
        # a loop that drained each hit as it came would take the GIL from the reading
        # thread once per hit (6 µs a resident hit became 33 on an H100 host).
        self.thread_hits.bind(
            functools.partial(
                loop.call_soon_threadsafe, loop.call_later, DRAIN_DELAY_S, self.thread_hits.drain
            )
        )
        self.gauges.bind(loop)
        core = self.core
        core.producers.bind(loop)
        core.packings.bind(loop)
        self._watcher.bind(loop)
        core.pipeline.bind(loop, self._watcher)
        warm_host_copies()  # on the loop's thread, where host reads copy
        port = self._settings.metrics_port
        if port is not None and self._registry is None:
            # One server per process serves every cache on the default registry.
            ensure_metrics_server(port, self._settings.metrics_addr)
        if self.remote is not None:
            self.remote.start()  # warns, in the background, of a server that can fill up
        arena = core.host.start(loop, self._watcher.when_done, self._host_ready)
        if arena is not None and arena.done():
            await asyncio.sleep(0)  # let the host tier take it: the simulator's is ready now
        self.gauges.request()

    async def close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Close once, in a task of its own that every call waits for (see closing.py)."""
        if not self.closing.begun:
            self.check_loop()
            self.closed = True  # before any await: no put or get starts from here on
            self.serving = None
            self.core.closing()
        await self.closing.run(functools.partial(self._close, timeout))

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """close()'s work, in a task of its own."""
        self.gauges.unbind()
        core = self.core
        core.producers.unbind()
        if self.agreement is not None:
            await self.agreement.close()  # a stuck peer must not hold close() up
        if timeout is None:
            timeout = self._settings.copy_timeout_s  # a stuck copy must not hang close() for ever
        core.fail_waiting()  # and watch landings at once from here on
        for task in self.inflight.running():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        if self.remote is not None:
            await self.remote.close()  # sends what it can within remote_timeout_sec
        remove = core.remove
        for found in list(core.index.values()):
            remove(found)
        if self.loop is not None:  # started: offloads may be in flight
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(core.pipeline.all_landed(), timeout)
        with contextlib.suppress(CopyTimeoutError):
            await core.packings.wait_all(timeout)  # one that never ends keeps its values
        self.gauges.request()
        await core.host.leave_node(timeout)  # host_share="node": once its copies have landed
        self.metrics.close()
        if self._owns_device:
            # Off the loop: unpinning a large arena takes the driver long enough to stall
            # it (BENCHMARKS.md), and the device also joins its threads.
            await off_the_loop(self.device.close)

    async def drain(self) -> None:
        """Wait until every queued copy, deferred release and remote write has completed."""
        core = self.core
        await core.pipeline.all_landed()
        while core.packings:  # a group lost to its packing copy may start more work
            await core.packings.wait_all(None)
            await core.pipeline.all_landed()
        if self.remote is not None:
            await self.remote.drain()

    def stats(self) -> CacheStats:
        """The tiers' stats (the ledger audited), with the remote tier's and the group's;
        the hits served to other threads are counted first (the loop applies them)."""
        self.thread_hits.apply_from(self.loop, self.thread, self._settings.copy_timeout_s)
        self.gauges.flush()
        stats = self.core.stats()
        if self.remote is not None:
            remote: dict[str, Any] = self.remote.stats()
            stats = dataclasses.replace(stats, **remote)
        if self.agreement is not None:
            stats = dataclasses.replace(stats, group_misses=self.agreement.misses)
        return stats

    # --- checks of the binding ----------------------------------------------------------

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread

    def check_open(self) -> None:
        if self.closed:
            raise CacheClosedError("this FeatureCache is closed")

    def check_loop(self) -> None:
        """Synchronous methods too must run on the cache's own loop (it has no locks)."""
        loop = self.loop
        if loop is None:
            return
        running = asyncio._get_running_loop()
        foreign = running is not loop if running is not None else not self.on_loop_thread()
        if foreign:
            raise WrongLoopError(
                "this FeatureCache belongs to another event loop or thread; use "
                "put_threadsafe()/get_threadsafe() from other threads"
            )

    def must_start(self) -> bool:
        """ready_to_serve's checks, with no await: raise if the cache is closed or belongs to
        another loop; True where it is not started yet (a group's lookup starts it inside
        its agreement, so that it has its place in the group's order from its call)."""
        if self.closed:
            raise CacheClosedError("this FeatureCache is closed")
        loop = self.loop
        if loop is None:
            return True
        if asyncio.get_running_loop() is not loop:
            raise WrongLoopError(
                "this FeatureCache belongs to another event loop; call it from the loop "
                "that started it (asyncio.run_coroutine_threadsafe from other threads)"
            )
        return False

    async def ready_to_serve(self) -> None:
        """Start the cache on the running loop if it is not started; raise if it is closed
        or belongs to another loop."""
        if self.closed:
            raise CacheClosedError("this FeatureCache is closed")
        loop = self.loop
        if loop is None:
            await self.start()
        elif asyncio.get_running_loop() is not loop:
            raise WrongLoopError(
                "this FeatureCache belongs to another event loop; call it from the loop "
                "that started it (asyncio.run_coroutine_threadsafe from other threads)"
            )

    # --- bookkeeping --------------------------------------------------------------------

    def _host_ready(self, capacity: int, ready: int) -> None:
        """The host arena's first ready bytes are pinned: report them and its capacity."""
        self.metrics.set_capacity("cpu", capacity)
        self.metrics.set_host_ready(ready)

    def _push_tier_gauges(self) -> None:
        """Tier sizes to the metrics (through self.gauges: once per loop iteration)."""
        self.core.push_gauges()

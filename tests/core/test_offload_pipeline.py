"""OffloadPipeline through its own interface: landing in order, one watch at a time,
reaping without a report, and the watchdog's quarantine of an overdue copy."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

import pytest
import torch
from prometheus_client import CollectorRegistry

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry, State
from mmcache.core.offload import OffloadPipeline
from mmcache.core.state import Release, TierState
from mmcache.device import DONE, Fence, SimDevice
from mmcache.host_pool import HostBlock
from mmcache.metrics import CacheMetrics
from mmcache.waiting import FenceWatcher


class HandFence(Fence):
    """A fence the test completes (from another thread, as a device's would be)."""

    def __init__(self) -> None:
        self._done = False
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done

    def complete(self) -> None:
        with self._lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class Rig:
    """A pipeline over a real tier state, the releases it carries out and its landings
    recorded."""

    def __init__(self, device: SimDevice, copy_timeout: float = 60.0) -> None:
        self.counters = Counters(CacheMetrics("p", CollectorRegistry()))
        self.state = TierState(
            gpu_capacity=1 << 20,
            policy="lru",
            counters=self.counters,
            done_fence=DONE,
            mark=device.record,
            evict_ahead=0,
            small_copy_bytes=0,
        )
        self.ledger = self.state.ledger
        self.index = self.state.index
        self.quarantine = self.state.quarantine
        self.host = self.state.host_order
        self.landed: list[bool] = []
        self.released: list[Release] = []
        self.waiting: list[object] = []  # a line of puts waiting for room
        self.watches: list[Sequence[Fence]] = []
        self.pipeline = OffloadPipeline(
            device=device,
            state=self.state,
            counters=self.counters,
            carry_out=self.released.extend,
            after_landing=self.landed.append,
            lines=(self.waiting,),
            changed=lambda: None,
            copy_timeout=copy_timeout,
        )

    def entry(self, key: Hashable, device: SimDevice) -> Entry:
        """A GPU entry of 1 KiB, indexed and charged to the ledger."""
        tensor = device.adopt(torch.zeros(256), device.current_stream())
        entry = Entry(key, (256,), torch.float32, 1024, State.GPU, tensor, DONE)
        self.state.admit(entry)
        self.state.gpu_order.pop(key, None)  # chosen as a victim
        return entry


@pytest.fixture
def device() -> Iterator[SimDevice]:
    dev = SimDevice()
    yield dev
    dev.close()


class RecordingWatcher(FenceWatcher):
    """A FenceWatcher that records the fences of each watch it is asked for."""

    def __init__(self, loop: asyncio.AbstractEventLoop, watches: list[Sequence[Fence]]) -> None:
        super().__init__(loop)
        self.watches = watches

    def when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        self.watches.append(list(fences))
        super().when_done(fences, callback, fresh=fresh)


def watched(rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    """Bind the rig's pipeline to a watcher that records each watch in rig.watches."""
    rig.pipeline.bind(loop, RecordingWatcher(loop, rig.watches))


ARENA = torch.zeros(4096, dtype=torch.uint8)


def block(offset: int) -> HostBlock:
    return HostBlock(offset, 1024, ARENA)


async def test_landings_are_handled_in_order_and_entries_become_host_resident(
    device: SimDevice,
) -> None:
    rig = Rig(device)
    watched(rig, asyncio.get_running_loop())
    fences = [HandFence(), HandFence()]
    entries = [rig.entry(k, device) for k in "ab"]
    rig.waiting.append(object())  # a put waits: watched at once
    for fence, entry, offset in zip(fences, entries, (0, 1024), strict=True):
        rig.pipeline.queue(fence, [(entry, block(offset))], charged_gpu=True)
    assert [e.state for e in entries] == [State.D2H, State.D2H] and len(rig.pipeline) == 2
    assert rig.watches == [[fences[0]]], "one watch, on the oldest"
    assert (rig.ledger.releasing, rig.ledger.cpu_entries) == (2048, 2)
    fences[1].complete()  # the later copy alone: nothing is handled before the oldest
    await asyncio.sleep(0.01)
    assert len(rig.pipeline) == 2
    fences[0].complete()
    await rig.pipeline.all_landed()
    assert [e.state for e in entries] == [State.HOST, State.HOST] and not rig.pipeline
    assert [e.key for e in rig.host.peek(8)] == ["a", "b"] and rig.landed == [True, True]
    assert (rig.ledger.used, rig.ledger.releasing, rig.ledger.gpu_entries) == (0, 0, 0)
    assert rig.counters.d2h_bytes == 2048 and rig.counters.pending_copies == 0


async def test_a_landed_offload_is_reaped_without_a_report(device: SimDevice) -> None:
    rig = Rig(device)
    watched(rig, asyncio.get_running_loop())
    fence = HandFence()
    rig.pipeline.queue(fence, [(rig.entry("a", device), block(0))], charged_gpu=True)
    assert rig.watches == [], "no put waits: the watch comes late"
    fence.complete()
    rig.pipeline.reap()
    assert not rig.pipeline and rig.landed == [True]


async def test_an_overdue_offload_is_quarantined_until_its_copy_lands(device: SimDevice) -> None:
    rig = Rig(device, copy_timeout=0.01)
    watched(rig, asyncio.get_running_loop())
    fence = HandFence()
    entry = rig.entry("a", device)
    rig.pipeline.queue(fence, [(entry, block(0))], charged_gpu=True)
    await asyncio.sleep(0.05)  # past copy_timeout: the watchdog ran
    assert entry in rig.quarantine and entry.state is State.GONE and "a" not in rig.index
    assert (rig.quarantine.device_bytes(), rig.quarantine.host_bytes()) == (1024, 1024)
    assert rig.counters.dropped == 1
    fence.complete()  # late, but it lands: the bytes come back
    await rig.pipeline.all_landed()
    assert not rig.quarantine and not rig.state.offloading(entry)
    assert len(rig.released) == 1 and entry.tensor is None  # the device tensor is released

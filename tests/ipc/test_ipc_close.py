"""Closing the IPC transport: what close() waits for, what it keeps, and that its blocking
releases (freeing the pool, unpinning and unmapping shared memory) stay off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import Rig, TimedFence, longest_loop_gap
from ipc_support import Transport, ipc_settings, settled_bytes, transport
from prometheus_client import CollectorRegistry

from mmcache.device import Fence, SimDevice
from mmcache.errors import CacheClosedError
from mmcache.ipc import FeatureReceiver, FeatureSender, SenderEndpoint, cuda_ipc
from mmcache.ipc import receiver as receiver_module
from mmcache.ipc.channel import SenderChannel
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.shm import SharedSegment

FEATURE_8MB = (1024, 2048)  # float32: 8 MiB


def a_sender(rig: Rig) -> FeatureSender:
    """A sender (not started) with a 1 MiB pool on rig's device."""
    return FeatureSender(ipc_settings(pool_mb=1), rig.device, registry=CollectorRegistry())


def segment_paths(endpoint: SenderEndpoint) -> list[str]:
    """The shared-memory files a sender links: control block, pool, fallback."""
    return [endpoint.control_path, endpoint.pool_path, endpoint.fallback_path]


def slowed(real: Callable[..., None], seconds: float) -> Callable[..., None]:
    """real, taking seconds longer on the calling thread (a large unpin or unmap)."""

    def slow(*args: object) -> None:
        time.sleep(seconds)
        real(*args)

    return slow


async def test_a_sender_frees_its_memory_off_the_loop(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=4) as tr:
        endpoint = tr.sender.endpoint
        paths = segment_paths(endpoint)
        monkeypatch.setattr(SharedSegment, "close", slowed(SharedSegment.close, 0.1))
        assert await longest_loop_gap(tr.sender.close()) < 0.1  # three segments: 0.3 s
        assert not any(map(os.path.exists, paths))  # close() returned once they were gone


async def test_a_receiver_leaves_its_senders_off_the_loop(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        channel_type = SenderChannel
        monkeypatch.setattr(channel_type, "close", slowed(channel_type.close, 0.2))
        assert await longest_loop_gap(tr.receivers[0].close()) < 0.1
        tr.sender.sweep()
        assert tr.sender.stats().receivers == 0  # close() returned once it had left


def _mapped(directory: str) -> list[str]:
    """The files of directory this process has mapped."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(None, 5)[-1].strip() for line in maps if directory in line})


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs procfs")
async def test_a_receiver_lets_go_of_a_sender_that_closed_once_it_meets_another() -> None:
    """A long-lived receiver whose senders are replaced keeps none of the old ones' memory
    mapped (a fallback of ipc_fallback_mb each, held in /dev/shm while mapped)."""
    receiver = FeatureReceiver(device=SimDevice())
    # On a device of its own: once closed, nothing of this process but the receiver maps it.
    old = FeatureSender(ipc_settings(pool_mb=1), "sim", registry=CollectorRegistry())
    await old.start()
    directory = os.path.dirname(old.endpoint.control_path)
    await receiver.connect(old.endpoint)
    pooled = await old.send(torch.ones(16))
    hosted = await old.send(torch.ones(512 << 10))  # 2 MiB: larger than the pool
    assert (pooled.where, hosted.where) == ("pool", "host")
    await receiver.receive(pooled)
    await receiver.receive(hosted)
    await old.close()
    del old
    assert _mapped(directory)  # the receiver's own mappings of the closed sender
    new = FeatureSender(ipc_settings(pool_mb=1), "sim", registry=CollectorRegistry())
    await new.start()
    try:
        await receiver.connect(new.endpoint)
        deadline = time.monotonic() + 2
        while True:  # left on a thread of its own
            gc.collect()
            if not _mapped(directory) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        assert _mapped(directory) == []
        handle = await new.send(torch.full((8,), 3.0))
        assert torch.equal(await receiver.receive(handle), torch.full((8,), 3.0))
    finally:
        await receiver.close()
        await new.close()


async def test_a_receiver_close_waits_for_an_open_lease(rig: Rig) -> None:
    async with transport(rig, consumers=1, pool_mb=1) as tr:
        receiver, value = tr.receivers[0], rig.tensor(64, 256, seed=3)
        handle = await tr.sender.send(value.clone())
        entered, done = asyncio.Event(), asyncio.Event()

        async def hold() -> None:  # another task's lease
            async with receiver.lease(handle) as view:
                entered.set()
                await done.wait()
                assert torch.equal(view, value)

        holding = asyncio.create_task(hold())
        await entered.wait()
        closing = asyncio.create_task(receiver.close(timeout=5))
        await asyncio.sleep(0.05)
        assert not closing.done()
        tr.sender.sweep()
        assert tr.sender.stats().receivers == 1  # not left while the lease reads
        done.set()
        await holding
        await asyncio.wait_for(closing, 5)
        tr.sender.sweep()
        stats = tr.sender.stats()
        assert (stats.receivers, stats.live_leases) == (0, 0)


async def test_a_lease_open_past_the_close_timeout_keeps_its_sender_mapped(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    async with transport(rig, consumers=1, pool_mb=1) as tr:
        receiver, value = tr.receivers[0], rig.tensor(64, 256, seed=4)
        handle = await tr.sender.send(value.clone())
        with caplog.at_level(logging.WARNING, logger="mmcache.ipc"):
            async with receiver.lease(handle) as view:
                await receiver.close(timeout=0.05)
                assert "still read" in caplog.text
                tr.sender.sweep()
                assert tr.sender.stats().receivers == 1  # neither left nor unmapped
                assert torch.equal(view, value)  # still the sender's memory
        await tr.sender.drain(timeout=5)  # the lease's end released the slice
        assert tr.sender.stats().live_leases == 0


async def eventually(condition: Callable[[], bool], timeout: float = 2.0) -> bool:  # noqa: ASYNC109
    """Whether condition() holds within timeout s (a release finishing on its own thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def copy_out_of(
    tr: Transport, receiver: FeatureReceiver, fence: Fence, *, verify: bool = False
) -> None:
    """A feature sent, leased and read by a copy that ends with fence, as a receive on a
    GPU leaves it: its slice released once fence is reported done."""
    handle = await tr.sender.send(torch.ones(64, 256))
    await asyncio.sleep(0.02)  # its copy into the pool has landed
    channel = receiver._channels[tr.sender.endpoint.control_path]
    channel.open(handle)
    receiver._release_after(channel, handle, fence, verify=verify)


class ReportedLate(TimedFence):
    """Done after after_s, its callbacks run report_s later (a busy waiter thread)."""

    __slots__ = ("_report_s",)

    def __init__(self, after_s: float, report_s: float) -> None:
        super().__init__(after_s)
        self._report_s = report_s

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        super().add_done_callback(functools.partial(self._late, fn))

    def _late(self, fn: Callable[[], None]) -> None:
        time.sleep(self._report_s)
        fn()


def left(tr: Transport) -> Callable[[], bool]:
    """Whether the sender of tr counts no receiver any more."""

    def check() -> bool:
        tr.sender.sweep()
        return tr.sender.stats().receivers == 0

    return check


async def test_a_kept_sender_is_left_once_its_lease_ends(rig: Rig) -> None:
    """Else the closed receiver would stay a live consumer, and every later send would
    wait for its release until the lease timeout."""
    async with transport(rig, consumers=2, pool_mb=1) as tr:
        closing, other = tr.receivers
        handle = await tr.sender.send(rig.tensor(64, 256, seed=5))
        async with closing.lease(handle):
            await closing.close(timeout=0.05)
        await other.receive(handle)

        def one_left() -> bool:
            tr.sender.sweep()
            return tr.sender.stats().receivers == 1

        assert await eventually(one_left)
        value = rig.tensor(64, 256, seed=6)
        later = await tr.sender.send(value.clone())
        assert torch.equal(await other.receive(later), value)
        assert await tr.sender.drain(timeout=2)  # no release owed by the closed receiver


async def test_a_copy_still_running_keeps_only_its_own_sender(sim_rig: Rig) -> None:
    async with (
        transport(sim_rig, consumers=1, pool_mb=1) as slow,
        transport(sim_rig, consumers=1, receivers=0, pool_mb=1) as quick,
    ):
        receiver = slow.receivers[0]
        await receiver.connect(quick.sender.endpoint)
        await copy_out_of(slow, receiver, TimedFence(0.3))
        await receiver.close(timeout=0.05)
        assert left(quick)()  # at once
        assert not left(slow)()  # kept while the copy runs
        assert await eventually(left(slow))  # once the copy has ended


async def test_a_receivers_own_device_closes_after_its_kept_sender(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, receivers=0, pool_mb=1) as tr:
        receiver = FeatureReceiver("sim")
        device = receiver.device
        assert isinstance(device, SimDevice)
        await receiver.connect(tr.sender.endpoint)
        value = torch.full((64, 256), 7.0)
        handle = await tr.sender.send(value.clone())
        async with receiver.lease(handle) as view:
            await receiver.close(timeout=0.05)
            assert not device.closed  # the lease's end still records on it
            assert torch.equal(view, value)
        assert await eventually(lambda: device.closed)


async def test_close_waits_for_readers_and_copies_within_one_timeout(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        handle = await tr.sender.send(torch.ones(64, 256))
        started = asyncio.Event()

        async def lease_for(seconds: float) -> None:
            async with receiver.lease(handle):
                started.set()
                await asyncio.sleep(seconds)

        leasing = asyncio.create_task(lease_for(0.25))
        await started.wait()
        await copy_out_of(tr, receiver, TimedFence(0.6))  # outlasts the timeout
        began = time.monotonic()
        await receiver.close(timeout=0.3)
        assert time.monotonic() - began < 0.45  # not 0.25 s for the lease, then 0.3 more
        await leasing
        assert await eventually(left(tr))


async def test_a_release_step_that_fails_leaves_the_others_done_and_reaches_close(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = a_sender(sim_rig)
    await sender.start()
    endpoint = sender.endpoint
    real_close = ControlBlock.close

    def failing_close(block: ControlBlock, unlink: bool) -> None:
        raise OSError("the control block cannot be closed")

    monkeypatch.setattr(ControlBlock, "close", failing_close)
    try:
        with pytest.raises(OSError, match="cannot be closed"):
            await sender.close()
        assert not any(map(os.path.exists, [endpoint.pool_path, endpoint.fallback_path]))
        assert await settled_bytes(sim_rig, 0) == 0  # the pool went back to the device
        with pytest.raises(OSError, match="cannot be closed"):
            await sender.close()  # every close() gets the error
    finally:
        monkeypatch.setattr(ControlBlock, "close", real_close)
        with contextlib.suppress(FileNotFoundError):  # the directory went, with what it held
            os.unlink(endpoint.control_path)


def slow_starting_sender(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> FeatureSender:
    """A sender whose start() takes 0.1 s making its fallback (as pinning it on a GPU does)."""
    sender = a_sender(rig)
    real_make_fallback = sender._memory.make_fallback

    async def slow_make_fallback() -> Any:
        await asyncio.sleep(0.1)
        return await real_make_fallback()

    monkeypatch.setattr(sender._memory, "make_fallback", slow_make_fallback)
    return sender


async def test_a_close_during_start_frees_what_start_made(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = slow_starting_sender(sim_rig, monkeypatch)
    starting = asyncio.create_task(sender.start())
    await asyncio.sleep(0.02)
    await sender.close()
    await starting  # it finished before close() freed what it made
    endpoint = sender.endpoint
    paths = segment_paths(endpoint)
    assert not any(map(os.path.exists, paths))
    assert sender._recycler.stopped
    assert await settled_bytes(sim_rig, 0) == 0


async def test_a_start_or_send_during_start_waits_for_it(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = slow_starting_sender(sim_rig, monkeypatch)
    first = asyncio.create_task(sender.start())
    await asyncio.sleep(0.02)
    await sender.start()  # returns once the first has finished
    assert first.done() and sender.endpoint.control_path
    await sender.close()


async def test_a_start_waiting_for_another_that_a_close_overtook_raises(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = slow_starting_sender(sim_rig, monkeypatch)
    first = asyncio.create_task(sender.start())
    await asyncio.sleep(0.02)
    second = asyncio.create_task(sender.start())
    await asyncio.sleep(0.02)
    await sender.close()
    await first
    with pytest.raises(CacheClosedError):
        await second  # an `async with sender:` body must not run on a closed sender


async def test_first_sends_together_start_the_sender_once(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = slow_starting_sender(sim_rig, monkeypatch)
    handles = await asyncio.gather(*(sender.send(torch.ones(64, 256)) for _ in range(2)))
    assert [h.where for h in handles] == ["pool", "pool"]
    stats = sender.stats()
    assert (stats.live_leases, stats.pool_used_bytes) == (2, 2 * 64 * 256 * 4)
    await sender.close(timeout=0.05)


async def test_a_sender_close_that_fails_while_waiting_still_frees(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender = a_sender(sim_rig)
    await sender.start()
    endpoint = sender.endpoint

    def failing_sweep() -> None:
        raise RuntimeError("the recycler broke")

    monkeypatch.setattr(sender, "_sweep", failing_sweep)
    await sender.send(torch.ones(64, 256))  # a lease for close() to wait for
    with pytest.raises(RuntimeError, match="the recycler broke"):
        await sender.close()
    paths = segment_paths(endpoint)
    assert not any(map(os.path.exists, paths))


async def test_a_channel_that_fails_to_close_leaves_the_others_and_the_device_closed(
    sim_rig: Rig,
) -> None:
    async with (
        transport(sim_rig, consumers=1, receivers=0, pool_mb=1) as first,
        transport(sim_rig, consumers=1, receivers=0, pool_mb=1) as second,
    ):
        receiver = FeatureReceiver("sim")
        device = receiver.device
        assert isinstance(device, SimDevice)
        await receiver.connect(first.sender.endpoint)
        await receiver.connect(second.sender.endpoint)
        broken = receiver._channels[first.sender.endpoint.control_path]
        real_close = broken.close

        def failing_close() -> None:
            real_close()
            raise OSError("cannot unmap")

        broken.close = failing_close  # type: ignore[method-assign]
        with pytest.raises(OSError, match="cannot unmap"):
            await receiver.close()
        second.sender.sweep()
        assert second.sender.stats().receivers == 0
        assert device.closed


async def test_a_sender_or_receiver_closes_the_device_it_made_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sender = FeatureSender(ipc_settings(pool_mb=1), "sim", registry=CollectorRegistry())
    await sender.start()
    receiver = FeatureReceiver("sim")
    await receiver.connect(sender.endpoint)
    for device in (sender.device, receiver.device):
        monkeypatch.setattr(device, "close", slowed(device.close, 0.2))
    assert await longest_loop_gap(receiver.close()) < 0.1
    assert await longest_loop_gap(sender.close()) < 0.1


class Pins:
    """pin_host that takes pin_s longer and records pins and unpins: the real one on a GPU,
    or with real=None a stand-in that needs none."""

    def __init__(
        self,
        pin_s: float,
        error: Exception | None = None,
        real: Callable[[int, torch.Tensor, bool], Callable[[], None]] | None = None,
    ) -> None:
        self.pin_s, self.error, self.real = pin_s, error, real
        self.pinned: list[int] = []
        self.unpinned: list[int] = []

    def __call__(
        self, ordinal: int, tensor: torch.Tensor, read_only: bool = False
    ) -> Callable[[], None]:
        time.sleep(self.pin_s)
        if self.error is not None:
            raise self.error
        unpin = self.real(ordinal, tensor, read_only) if self.real is not None else None
        self.pinned.append(tensor.data_ptr())

        def recorded() -> None:
            if unpin is not None:
                unpin()
            self.unpinned.append(tensor.data_ptr())

        return recorded


async def test_a_pin_whose_caller_was_cancelled_is_undone_once_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pins = Pins(0.1)
    monkeypatch.setattr(cuda_ipc, "pin_host", pins)
    pinning = asyncio.create_task(cuda_ipc.pin_off_the_loop(0, torch.ones(16)))
    await asyncio.sleep(0.02)
    pinning.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pinning
    assert await eventually(lambda: len(pins.unpinned) == 1)
    assert pins.unpinned == pins.pinned


async def test_a_pin_that_fails_raises_to_its_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_ipc, "pin_host", Pins(0.0, OSError("out of pinnable memory")))
    with pytest.raises(OSError, match="out of pinnable memory"):
        await cuda_ipc.pin_off_the_loop(0, torch.ones(16))


def test_a_pin_that_ends_after_its_loop_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    pins = Pins(0.2)
    monkeypatch.setattr(cuda_ipc, "pin_host", pins)
    loop = asyncio.new_event_loop()
    pinning = loop.create_task(cuda_ipc.pin_off_the_loop(0, torch.ones(16)))
    loop.run_until_complete(asyncio.sleep(0.02))  # pinning now, on its thread
    pinning.cancel()  # never run: the loop closes first, with its caller still waiting
    loop.close()
    deadline = time.monotonic() + 2
    while not pins.unpinned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pins.unpinned == pins.pinned and len(pins.pinned) == 1


async def test_a_start_cancelled_while_pinning_the_fallback_unpins_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rig.kind != "cuda":
        pytest.skip("only a CUDA sender pins its fallback")
    pins = Pins(0.2, real=cuda_ipc.pin_host)
    monkeypatch.setattr(cuda_ipc, "pin_host", pins)
    sender = FeatureSender(ipc_settings(pool_mb=1, fallback_mb=8), rig.device)
    starting = asyncio.create_task(sender.start())
    await asyncio.sleep(0.05)  # pinning
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert await eventually(lambda: len(pins.unpinned) == 1)
    assert pins.unpinned == pins.pinned


async def test_receives_that_meet_an_unmapped_fallback_together_pin_it_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rig.kind != "cuda":
        pytest.skip("only a CUDA receiver pins the fallback")
    pins = Pins(0.05, real=cuda_ipc.pin_host)
    async with transport(rig, consumers=1, pool_mb=0, fallback_mb=4) as tr:
        monkeypatch.setattr(cuda_ipc, "pin_host", pins)  # the receiver's pins only
        values = [rig.tensor(64, 256, seed=seed) for seed in (8, 9)]
        handles = [await tr.sender.send(v.clone()) for v in values]
        assert [h.where for h in handles] == ["host", "host"]
        got = await asyncio.gather(*(tr.receivers[0].receive(h) for h in handles))
        assert all(map(torch.equal, got, values))
        assert len(pins.pinned) == 1


async def test_close_inside_a_lease_does_not_wait_for_that_lease(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        handle = await tr.sender.send(torch.ones(64, 256))
        async with receiver.lease(handle) as view:
            began = time.monotonic()
            await receiver.close(timeout=None)
            assert time.monotonic() - began < 1
            assert torch.equal(view, torch.ones(64, 256))  # kept, still mapped
        assert await eventually(left(tr))


@pytest.mark.parametrize("how", ["gather", "shield", "wait_for", "task"])
async def test_close_through_a_task_started_inside_a_lease_does_not_wait_for_it(
    sim_rig: Rig, how: str
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        handle = await tr.sender.send(torch.ones(64, 256))
        began = time.monotonic()
        async with receiver.lease(handle):
            closing = receiver.close(timeout=None)
            if how == "gather":
                await asyncio.gather(closing)
            elif how == "shield":
                await asyncio.shield(closing)
            elif how == "wait_for":
                await asyncio.wait_for(closing, 5)
            else:
                await asyncio.create_task(closing)
        assert time.monotonic() - began < 1
        assert await eventually(left(tr))


async def test_a_second_close_inside_a_lease_does_not_wait_for_it(sim_rig: Rig) -> None:
    """One task closes while another holds a lease and closes inside it (its own cleanup):
    neither waits for the other."""
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        handle = await tr.sender.send(torch.ones(64, 256))
        entered = asyncio.Event()

        async def hold_then_close() -> None:
            async with receiver.lease(handle):
                entered.set()
                await asyncio.sleep(0.05)  # the first close() is waiting for this lease
                await receiver.close(timeout=None)

        holding = asyncio.create_task(hold_then_close())
        await entered.wait()
        await asyncio.wait_for(asyncio.gather(receiver.close(timeout=None), holding), 2)
        assert await eventually(left(tr))


async def test_a_sender_kept_by_a_receive_is_left_when_it_returns(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        handle = await tr.sender.send(torch.ones(64, 256))
        assert await tr.sender.drain(timeout=0) is False  # sent, not yet received
        await asyncio.sleep(0.05)  # its copy into the pool has landed
        device = receiver.device
        assert isinstance(device, SimDevice)
        with device.hold():  # the receive's copy out waits
            receiving = asyncio.create_task(receiver.receive(handle))
            await asyncio.sleep(0.02)
            await receiver.close(timeout=0.05)
            assert not left(tr)()
        assert torch.equal(await receiving, torch.ones(64, 256))
        assert await eventually(left(tr))


@pytest.mark.parametrize("switch_in", ["look", "warning"])
async def test_a_copy_reported_while_close_decides_leaves_nothing_kept(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch, switch_in: str
) -> None:
    """The copy's report, on another thread, may run between close()'s look at the channel
    and its mark being stored, or while the warning for a kept channel is written (here:
    a thread switch at either place)."""
    real_busy, real_warning = SenderChannel.busy, receiver_module.log.warning

    def busy_then_switch(channel: Any) -> bool:
        result = real_busy(channel)
        if sys._getframe(1).f_code.co_name == "_close":
            time.sleep(0.15)
        return result

    def switch_then_warn(*args: Any) -> None:
        time.sleep(0.15)
        real_warning(*args)

    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        await copy_out_of(tr, receiver, TimedFence(0.1))
        if switch_in == "look":
            monkeypatch.setattr(SenderChannel, "busy", busy_then_switch)
        else:
            monkeypatch.setattr(receiver_module.log, "warning", switch_then_warn)
        await receiver.close(timeout=0.05)
        assert await eventually(left(tr))


async def test_close_waits_for_a_done_copy_to_be_reported_before_leaving(
    sim_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Left before the report, the sender could reuse the slice, and the report's check
    would take that for a slice reclaimed under the read."""
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        await copy_out_of(tr, receiver, ReportedLate(0.1, 0.2), verify=True)
        with caplog.at_level(logging.WARNING, logger="mmcache.ipc"):
            await receiver.close(timeout=2)
            assert left(tr)()
            for _ in range(4):  # the slot is reused once reclaimed
                await tr.sender.send(torch.zeros(64, 256))
                await asyncio.sleep(0.05)
        assert caplog.records == []  # neither kept nor reported as reclaimed


def test_a_kept_sender_is_left_after_the_event_loop_has_ended() -> None:
    """The last copy out of a kept sender may be reported after asyncio.run() returned:
    the channel is still closed, without a loop, and the device made for it too."""
    device = SimDevice()
    made: list[tuple[FeatureSender, FeatureReceiver]] = []

    async def serve() -> None:
        registry = CollectorRegistry()
        sender = FeatureSender(ipc_settings(pool_mb=1), device, consumers=1, registry=registry)
        await sender.start()
        receiver = FeatureReceiver("sim")
        await receiver.connect(sender.endpoint)
        made.append((sender, receiver))
        tr = Transport(Rig(device, "sim"), sender, [receiver], registry)
        await copy_out_of(tr, receiver, TimedFence(0.3))
        await receiver.close(timeout=0.05)  # kept: the copy runs past the loop's end

    asyncio.run(serve())
    ((sender, receiver),) = made
    own_device = receiver.device
    assert isinstance(own_device, SimDevice)
    assert sender.stats().receivers == 1 and not own_device.closed
    deadline = time.monotonic() + 2
    while sender.stats().receivers and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert sender.stats().receivers == 0
        while not own_device.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert own_device.closed
    finally:
        endpoint = sender.endpoint
        for path in segment_paths(endpoint):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.rmdir(os.path.dirname(endpoint.control_path))  # the sender's own directory
        device.close()


async def test_a_receiver_close_cancelled_while_waiting_still_leaves_once_unread(
    sim_rig: Rig,
) -> None:
    """close()'s own task is cancelled only as the loop shuts down: each sender is then
    left once nothing reads it, the idle ones at once."""
    async with (
        transport(sim_rig, consumers=1, pool_mb=1) as read,
        transport(sim_rig, consumers=1, receivers=0, pool_mb=1) as idle,
    ):
        receiver = read.receivers[0]
        await receiver.connect(idle.sender.endpoint)
        handle = await read.sender.send(torch.ones(64, 256))
        entered, done = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with receiver.lease(handle):
                entered.set()
                await done.wait()

        holding = asyncio.create_task(hold())
        await entered.wait()
        closing = asyncio.create_task(receiver.close(timeout=5))
        await asyncio.sleep(0.02)
        assert receiver._closing._task is not None
        receiver._closing._task.cancel()
        await closing  # its work was cancelled: nothing left to wait for
        assert await eventually(left(idle))
        assert not left(read)()
        done.set()
        await holding
        assert await eventually(left(read))


async def test_a_receive_waiting_for_its_data_stops_when_the_receiver_closes(
    sim_rig: Rig,
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=16) as tr:
        receiver = tr.receivers[0]
        with sim_rig.hold():  # the copy into the pool is held: the handle is not ready
            handle = await tr.sender.send(torch.full(FEATURE_8MB, 5.0))
            receiving = asyncio.create_task(receiver.receive(handle))
            await asyncio.sleep(0.02)
            await asyncio.wait_for(receiver.close(timeout=5), 1)
            with pytest.raises(CacheClosedError):
                await receiving
        await tr.sender.drain(timeout=5)  # the receive gave its lease back
        assert tr.sender.stats().live_leases == 0


async def test_close_lets_a_host_copy_under_way_land_and_refuses_its_send(sim_rig: Rig) -> None:
    """The fallback is unpinned and unmapped only after copies into it have landed."""
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=16) as tr:
        with sim_rig.hold():
            sending = asyncio.create_task(tr.sender.send(torch.full(FEATURE_8MB, 3.0)))
            await asyncio.sleep(0.01)
            closing = asyncio.create_task(tr.sender.close(timeout=5))
            await asyncio.sleep(0.1)
            assert not closing.done()  # the 8 MiB copy into the fallback is held
            assert not sending.done()
        await asyncio.wait_for(closing, 5)
        with pytest.raises(CacheClosedError):
            await sending  # a handle of a closed sender would reach no receiver
        assert await settled_bytes(sim_rig, 0) == 0  # the feature and the pool are freed


async def test_a_send_granted_room_just_before_close_is_refused(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=0) as tr:
        first = await tr.sender.send(torch.full((256, 1024), 1.0))  # fills the pool
        assert first.where == "pool"
        waiting = asyncio.create_task(tr.sender.send(torch.full((256, 1024), 2.0)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        got = await tr.receivers[0].receive(first)  # releases the slice
        assert torch.equal(got, torch.full((256, 1024), 1.0))
        tr.sender.sweep()  # reclaims it and grants the waiting send its room
        await tr.sender.close(timeout=1)  # runs up to its first wait before the send resumes
        with pytest.raises(CacheClosedError):
            await waiting
        assert tr.sender.stats().live_leases == 0


async def test_close_keeps_the_fallback_a_cancelled_sends_copy_still_writes(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=16) as tr:
        sender = tr.sender
        kept: list[tuple[bool, int]] = []
        teardown = sender._memory.teardown

        def spy(
            control: ControlBlock | None, keep_pool: bool, copying: Sequence[Fence]
        ) -> Callable[[], None]:
            kept.append((keep_pool, sum(not f.done() for f in copying)))
            return teardown(control, keep_pool, copying)

        sender._memory.teardown = spy  # type: ignore[method-assign]
        unpinned: list[bool] = []
        sender._memory.unpin = functools.partial(unpinned.append, True)  # as on a GPU
        with sim_rig.hold():
            sending = asyncio.create_task(sender.send(torch.full(FEATURE_8MB, 3.0)))
            await asyncio.sleep(0.01)
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            await sender.close(timeout=0.2)  # its copy is still held
            assert kept == [(True, 1)]  # neither freed nor unpinned under the copy
            await asyncio.sleep(0.05)
            assert unpinned == []
        assert await eventually(lambda: unpinned == [True])  # once it has landed


async def test_a_sender_closed_with_leases_still_held_unpins_its_fallback(sim_rig: Rig) -> None:
    """Receivers read the fallback through mappings and pins of their own: a lease kept past
    the timeout keeps the pool, not the sender's pin."""
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=4) as tr:
        unpinned: list[bool] = []
        tr.sender._memory.unpin = functools.partial(unpinned.append, True)  # as on a GPU
        await tr.sender.send(torch.ones(64, 256))  # never released
        await tr.sender.close(timeout=0.05)
        assert unpinned == [True]


async def test_a_sender_close_whose_caller_is_cancelled_still_frees_and_a_second_waits(
    sim_rig: Rig,
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=16) as tr:
        endpoint = tr.sender.endpoint
        paths = segment_paths(endpoint)
        with sim_rig.hold():
            sending = asyncio.create_task(tr.sender.send(torch.full(FEATURE_8MB, 3.0)))
            await asyncio.sleep(0.01)
            first = asyncio.create_task(tr.sender.close(timeout=5))
            await asyncio.sleep(0.05)  # close() waits for the held copy
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            second = asyncio.create_task(tr.sender.close())
            await asyncio.sleep(0.05)
            assert not second.done() and all(map(os.path.exists, paths))
        await asyncio.wait_for(second, 5)  # the first close's work, finished
        assert not any(map(os.path.exists, paths))
        with pytest.raises(CacheClosedError):
            await sending


async def test_a_receiver_close_whose_caller_is_cancelled_still_leaves_and_a_second_waits(
    sim_rig: Rig,
) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1) as tr:
        receiver = tr.receivers[0]
        assert tr.sender.stats().receivers == 1
        await copy_out_of(tr, receiver, TimedFence(0.3))
        first = asyncio.create_task(receiver.close(timeout=5))
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.create_task(receiver.close())
        await asyncio.sleep(0.05)
        assert not second.done() and tr.sender.stats().receivers == 1
        await asyncio.wait_for(second, 5)  # the first close's work, finished
        assert left(tr)()

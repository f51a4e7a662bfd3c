"""Leases: late ones count as leaked, slow receivers keep their bytes, dead ones are reclaimed."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest
import torch
from conftest import Rig
from ipc_support import dead_pid, new_receiver, transport

from mmcache.device import SimDevice
from mmcache.ipc import HandleExpiredError, SenderGoneError, reclaim
from mmcache.ipc.control import ControlBlock


async def test_a_lease_past_its_timeout_counts_as_leaked_and_is_logged(
    sim_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mmcache.ipc")  # the recycler logs at any await
    async with transport(sim_rig, consumers=1, ipc_lease_timeout_s=0.05) as tr:
        handle = await tr.sender.send(torch.ones(64, 64))
        await asyncio.sleep(0.1)
        tr.sender.sweep()
        assert tr.sender.stats().leaked_bytes == 64 * 64 * 4
        assert tr.metric("mmcache_leaked_bytes", tier="ipc") == 64 * 64 * 4
        assert handle.describe() in caplog.text
        assert "MMCACHE_IPC_LEASE_TIMEOUT_SEC" in caplog.text
        # A late release ends the leak; the slice is reused only now.
        await tr.receivers[0].receive(handle)
        assert await tr.sender.drain(timeout=5)
        assert "released late" in caplog.text
        assert tr.sender.stats().leaked_bytes == 0
        assert tr.metric("mmcache_leaked_bytes", tier="ipc") == 0


async def test_a_slow_receiver_is_never_overwritten(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=2, pool_mb=1, ipc_lease_timeout_s=0.05) as tr:
        slow, fast = tr.receivers
        want = torch.randn(128, 1024)  # half the pool
        handle = await tr.sender.send(want.clone())
        await fast.receive(handle)
        async with slow.lease(handle) as view:
            await asyncio.sleep(0.1)  # well past the lease timeout
            for i in range(8):  # pool pressure: each needs the held half to go through it
                other = await tr.sender.send(torch.full((128, 1024), float(i)))
                await fast.receive(other)
                await slow.receive(other)
                await tr.sender.drain(timeout=0.05)
            assert tr.sender.stats().leaked_bytes == 128 * 1024 * 4
            assert torch.equal(view, want), "a held lease was overwritten"
        assert await tr.sender.drain(timeout=5)
        assert tr.sender.stats().leaked_bytes == 0


async def test_a_slice_open_in_any_live_receiver_is_not_reused(sim_rig: Rig) -> None:
    """Enough releases are not enough while another receiver still reads the slice."""
    async with transport(sim_rig, consumers=2, receivers=3, pool_mb=1) as tr:
        first, second, extra = tr.receivers
        want = torch.randn(128, 1024)
        handle = await tr.sender.send(want.clone())
        async with extra.lease(handle) as view:
            await first.receive(handle)
            await second.receive(handle)
            assert not await tr.sender.drain(timeout=0.05)
            assert tr.sender.stats().open_leases == 1
            for i in range(4):  # would reuse the held half of the pool if it were free
                other = await tr.sender.send(torch.full((128, 1024), float(i)))
                for receiver in (first, second, extra):
                    await receiver.receive(other)
            assert torch.equal(view, want), "a slice open in a live receiver was overwritten"
        assert await tr.sender.drain(timeout=5)


async def test_a_receiver_that_died_holding_a_lease_is_reclaimed(
    sim_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    async with transport(sim_rig, consumers=2, receivers=1) as tr:
        # The second consumer: a receiver process that opened the slice, then died.
        ghost = ControlBlock.attach(tr.sender.endpoint.control_path)
        pid = dead_pid()
        lane, _ = ghost.register(pid, peer_ok=True)
        handle = await tr.sender.send(torch.ones(1024))
        ghost.lease(handle.slot, lane, handle.seq)
        await tr.receivers[0].receive(handle)
        assert await tr.sender.drain(timeout=5)
        assert f"pid {pid} (lane {lane}) exited" in caplog.text
        stats = tr.sender.stats()
        assert (stats.receivers_lost, stats.receivers, stats.pool_used_bytes) == (1, 1, 0)
        # The sender keeps serving, and the dead receiver's lane is free for a new one.
        newcomer = new_receiver(sim_rig)
        handle = await tr.sender.send(torch.ones(8))
        assert torch.equal(await newcomer.receive(handle), torch.ones(8))
        assert torch.equal(await tr.receivers[0].receive(handle), torch.ones(8))
        await newcomer.close()
        assert await tr.sender.drain(timeout=5)
        ghost.close(unlink=False)


async def test_sends_owed_to_a_receiver_that_closed_are_reclaimed(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=2) as tr:
        first, second = tr.receivers
        handles = [await tr.sender.send(torch.full((256,), float(i))) for i in range(4)]
        for handle in handles:
            await first.receive(handle)
        await second.close()  # it will never receive them: the sender must not wait for it
        assert await tr.sender.drain(timeout=5)
        assert tr.sender.stats().receivers_lost == 1


async def test_no_credit_when_more_receivers_than_consumers_were_registered(
    sim_rig: Rig,
) -> None:
    """Which two of three receivers were its consumers is unknown: wait for real releases."""
    async with transport(sim_rig, consumers=2) as tr:
        first, second = tr.receivers
        ghost = ControlBlock.attach(tr.sender.endpoint.control_path)
        ghost.register(dead_pid(), peer_ok=True)
        handle = await tr.sender.send(torch.ones(512))
        await first.receive(handle)
        assert not await tr.sender.drain(timeout=0.1)
        assert tr.sender.stats().receivers_lost == 1
        assert tr.sender.stats().live_leases == 1, "reclaimed while a consumer had not read it"
        assert torch.equal(await second.receive(handle), torch.ones(512))
        assert await tr.sender.drain(timeout=5)
        ghost.close(unlink=False)


async def test_a_handle_reclaimed_for_a_dead_receiver_is_refused(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=2, receivers=1) as tr:
        ghost = ControlBlock.attach(tr.sender.endpoint.control_path)
        ghost.register(dead_pid(), peer_ok=True)
        handle = await tr.sender.send(torch.ones(512))
        await tr.receivers[0].receive(handle)
        assert await tr.sender.drain(timeout=5)
        late = new_receiver(sim_rig)
        with pytest.raises(HandleExpiredError, match="reclaimed"):
            await late.receive(handle)
        await late.close()
        ghost.close(unlink=False)


async def test_a_receiver_waiting_on_a_sender_that_closes_gets_a_clear_error(
    sim_rig: Rig,
) -> None:
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1) as tr:
        with device.hold():
            handle = await tr.sender.send(torch.ones(64))
            reader = asyncio.create_task(tr.receivers[0].receive(handle))
            await asyncio.sleep(0.02)
            await tr.sender.close(timeout=0.05)
            with pytest.raises((SenderGoneError, HandleExpiredError)):
                await asyncio.wait_for(reader, 5)


async def test_registration_records_the_receivers_pid(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=2) as tr:
        control = ControlBlock.attach(tr.sender.endpoint.control_path)
        lanes = control.lanes()
        assert [lane.pid for lane in lanes] == [os.getpid(), os.getpid()]
        assert tr.sender.stats().receivers == 2
        control.close(unlink=False)


async def test_a_quick_sweep_reads_the_oldest_leases_and_a_full_one_all(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Receivers release mostly in send order: a quick sweep stops at a run of leases
    still held, so its cost follows what it reclaims; a full sweep finds the rest."""
    monkeypatch.setattr(reclaim, "FULL_SWEEP_GAP_S", 3600.0)  # only sweep() runs a full one
    async with transport(sim_rig, consumers=1, ipc_recycle_interval_s=60) as tr:
        handles = [await tr.sender.send(torch.full((64,), float(i))) for i in range(3 + 20)]
        receiver = tr.receivers[0]
        for handle in handles[:3] + handles[-5:]:  # the 3 oldest, then 5 behind 15 held
            await receiver.receive(handle)
        await asyncio.sleep(0.01)  # the copies' releases are reported by the loop's looks
        tr.sender._reclaimer.last_full_sweep = time.monotonic()
        tr.sender._sweep(full=False)
        assert tr.sender.stats().live_leases == 20
        tr.sender.sweep()
        assert tr.sender.stats().live_leases == 15
        for handle in handles[3:-5]:
            await receiver.receive(handle)
        assert await tr.sender.drain(timeout=5)
        stats = tr.sender.stats()
        assert (stats.leaked_bytes, stats.pool_used_bytes) == (0, 0)

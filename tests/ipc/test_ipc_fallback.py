"""The host fallback, the path that leaked in the seed bug: device memory, budget, /dev/shm."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import shutil
import time

import pytest
import torch
from conftest import Rig
from ipc_support import MiB, Transport, ipc_settings, settled_bytes, transport

from mmcache.device import SimDevice
from mmcache.errors import ValueTooLargeError
from mmcache.ipc import FeatureHandle, FeatureSender, SharedMemoryFullError, TransportFullError
from mmcache.ipc.shm import SHM_DIR

FEATURE_8MB = (1024, 2048)  # float32: 8 MiB, an image embedding of the seed bug's size


async def _send_without_receiving(tr: Transport, count: int) -> list[int]:
    """Send count 8 MiB features that nobody receives; device memory after each send."""
    samples = []
    for i in range(count):
        value = torch.full(FEATURE_8MB, float(i))
        handle = await tr.sender.send(tr.on_device(value))
        del value
        assert handle.where == "host"
        samples.append(tr.rig.allocated_bytes())
    return samples


def _assert_flat(samples: list[int], baseline: int) -> None:
    grown = [s - baseline for s in samples if s != baseline]
    assert not grown, f"device memory grew by {max(grown) / MiB:.0f} MiB over {len(samples)} sends"


def _needs_shm(nbytes: int) -> None:
    free = shutil.disk_usage(SHM_DIR).free
    if free < nbytes + 64 * MiB:
        pytest.skip(f"{SHM_DIR} has {free / MiB:.0f} MiB free; this test needs {nbytes / MiB:.0f}")


async def test_seed_regression_fallback_keeps_device_memory_flat(rig: Rig) -> None:
    """Pool of 1 MB, 100 features of 8 MB sent without receiving: all fall back, memory flat."""
    _needs_shm(100 * 8 * MiB)
    async with transport(rig, consumers=1, pool_mb=1, fallback_mb=808) as tr:
        rig.settle()
        baseline = rig.allocated_bytes()
        samples = await _send_without_receiving(tr, 100)
        _assert_flat(samples, baseline)
        stats = tr.sender.stats()
        assert stats.fallbacks_by_reason == {"too_large": 100}
        assert tr.metric("mmcache_ipc_fallbacks_total", reason="too_large") == 100
        assert stats.live_leases == 100 and stats.leaked_bytes == 0
        # Every feature is still there, exactly, for the receiver that comes late.
        receiver = tr.receivers[0]
        for i, handle in enumerate(_handles(tr)):
            got = await receiver.receive(handle)
            assert torch.equal(got.cpu(), torch.full(FEATURE_8MB, float(i)))
            del got
        assert await tr.sender.drain(timeout=10)
        assert tr.sender.stats().fallback_used_bytes == 0
        assert await settled_bytes(rig, baseline) == baseline


def _handles(tr: Transport) -> list[FeatureHandle]:
    """The handles of the sends not yet released, in order (the test kept none)."""
    ledger = tr.sender._ledger
    assert ledger is not None
    handles = [lease.handle for lease in sorted(ledger, key=lambda lease: lease.handle.seq)]
    assert all(isinstance(h, FeatureHandle) for h in handles)
    return handles  # type: ignore[return-value]


async def test_seed_regression_test_catches_a_fallback_that_keeps_the_source(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above can fail: a fallback that keeps the device tensor (the seed bug) grows."""
    kept: list[torch.Tensor] = []

    def keep_source(self: FeatureSender, own: torch.Tensor, after: object) -> None:
        kept.append(own)  # like sending the plain tensor: the transport holds it

    monkeypatch.setattr(FeatureSender, "_release_source", keep_source)
    async with transport(rig, consumers=1, pool_mb=1, fallback_mb=88) as tr:
        rig.settle()
        baseline = rig.allocated_bytes()
        samples = await _send_without_receiving(tr, 10)
        with pytest.raises(AssertionError, match="device memory grew by 80 MiB"):
            _assert_flat(samples, baseline)
    kept.clear()


async def test_the_device_source_is_released_before_send_returns(sim_rig: Rig) -> None:
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False) as tr:
        baseline = device.allocated_bytes
        with device.hold():
            sending = asyncio.create_task(tr.sender.send(torch.ones(256, 256)))
            await asyncio.sleep(0.05)
            # The copy to host memory is held: send must not return, the source stays.
            assert not sending.done()
            assert device.allocated_bytes == baseline + 256 * 1024
        handle = await sending
        assert device.allocated_bytes == baseline, "send returned before releasing its source"
        assert torch.equal(await tr.receivers[0].receive(handle), torch.ones(256, 256))


async def test_a_host_lease_reads_the_shared_fallback_in_place(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=2) as tr:
        handle = await tr.sender.send(torch.arange(1000, dtype=torch.int64))
        async with tr.receivers[0].lease(handle) as view:
            assert view.device.type == "cpu"
            assert view.untyped_storage().nbytes() == 2 * MiB  # the shared arena, not a copy
            assert torch.equal(view, torch.arange(1000, dtype=torch.int64))


async def test_a_full_fallback_applies_backpressure_until_a_receiver_releases(
    sim_rig: Rig,
) -> None:
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=1) as tr:
        half = (128, 1024)  # 512 KiB of float32
        first = await tr.sender.send(torch.full(half, 1.0))
        await tr.sender.send(torch.full(half, 2.0))
        third = asyncio.create_task(tr.sender.send(torch.full(half, 3.0)))
        await asyncio.sleep(0.05)
        assert not third.done(), "send did not wait for room in a full fallback"
        assert tr.sender.stats().waiting_sends == 1
        await tr.receivers[0].receive(first)
        handle = await asyncio.wait_for(third, 5)
        assert torch.equal(await tr.receivers[0].receive(handle), torch.full(half, 3.0))


async def test_room_granted_to_a_send_cancelled_before_it_resumed_goes_back(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=1) as tr:
        half = (128, 1024)  # 512 KiB of float32
        first = await tr.sender.send(torch.full(half, 1.0))
        await tr.sender.send(torch.full(half, 2.0))
        third = asyncio.create_task(tr.sender.send(torch.full(half, 3.0)))
        await asyncio.sleep(0.05)
        assert tr.sender.stats().waiting_sends == 1
        with monkeypatch.context() as patched:
            patched.setattr(tr.sender, "_sweep", lambda: None)  # no grant while it releases
            await tr.receivers[0].receive(first)
        tr.sender.sweep()  # grants the waiting send its room...
        third.cancel()  # ...which it gives up before it resumes
        with pytest.raises(asyncio.CancelledError):
            await third
        stats = tr.sender.stats()
        assert (stats.waiting_sends, stats.live_leases, stats.leaked_bytes) == (0, 1, 0)
        assert stats.fallback_used_bytes == MiB // 2


async def test_a_full_fallback_with_wait_false_refuses_and_releases_the_source(
    sim_rig: Rig,
) -> None:
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=1) as tr:
        await tr.sender.send(torch.ones(256, 1024))
        baseline = sim_rig.allocated_bytes()
        with pytest.raises(TransportFullError, match="MMCACHE_IPC_FALLBACK_MB"):
            await tr.sender.send(torch.ones(16), wait=False)
        assert sim_rig.allocated_bytes() == baseline


async def test_backpressure_gives_up_after_the_lease_timeout(sim_rig: Rig) -> None:
    async with transport(
        sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=1, ipc_lease_timeout_s=0.2
    ) as tr:
        await tr.sender.send(torch.ones(256, 1024))
        baseline = sim_rig.allocated_bytes()
        started = time.monotonic()
        with pytest.raises(TransportFullError, match="MMCACHE_IPC_LEASE_TIMEOUT_SEC"):
            await tr.sender.send(torch.ones(16))
        assert 0.15 < time.monotonic() - started < 2
        assert sim_rig.allocated_bytes() == baseline
        assert tr.sender.stats().waiting_sends == 0


async def test_a_full_dev_shm_is_a_clear_error(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=8) as tr:
        baseline = sim_rig.allocated_bytes()

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        with monkeypatch.context() as patch:
            patch.setattr(os, "posix_fallocate", full)
            with pytest.raises(SharedMemoryFullError, match="shm-size"):
                await tr.sender.send(torch.ones(1024))
        assert sim_rig.allocated_bytes() == baseline
        assert tr.sender.stats().fallback_used_bytes == 0
        # Room in /dev/shm again: the sender goes on.
        handle = await tr.sender.send(torch.ones(1024))
        assert torch.equal(await tr.receivers[0].receive(handle), torch.ones(1024))


def _left_behind(directory: str) -> list[str]:
    """A sender's directory if it still exists, and what this process's file descriptors
    have open in it."""
    found = [directory] if os.path.exists(directory) else []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(directory):
                found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs procfs")
@pytest.mark.parametrize("reserved", [0, 1])
async def test_a_start_that_finds_dev_shm_full_leaves_nothing_open(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch, reserved: int
) -> None:
    """Whichever reservation finds /dev/shm full (0: the control block's, 1: the pool's),
    no descriptor of the failed sender's segments stays open."""
    fallocate = os.posix_fallocate
    made: list[str] = []

    def full_after(fd: int, offset: int, length: int) -> None:
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(made) > reserved:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    sender = FeatureSender(ipc_settings(), device=sim_rig.device)
    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", full_after)
        with pytest.raises(SharedMemoryFullError, match="shm-size"):
            await sender.start()
    del sender
    gc.collect()
    directory = os.path.dirname(made[0])
    assert _left_behind(directory) == []


async def test_a_feature_larger_than_pool_and_fallback_is_refused(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=1, fallback_mb=1) as tr:
        baseline = sim_rig.allocated_bytes()
        with pytest.raises(ValueTooLargeError, match="MMCACHE_IPC_POOL_MB"):
            await tr.sender.send(torch.ones(2 * MiB // 4))
        assert sim_rig.allocated_bytes() == baseline


async def test_a_cancelled_send_leaves_nothing_behind(sim_rig: Rig) -> None:
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1, use_cuda_ipc=False, fallback_mb=1) as tr:
        baseline = device.allocated_bytes
        with device.hold():
            copying = asyncio.create_task(tr.sender.send(torch.ones(128, 1024)))
            await asyncio.sleep(0.02)
            copying.cancel()
            with pytest.raises(asyncio.CancelledError):
                await copying
        await tr.sender.send(torch.ones(256, 1024))  # fills the fallback
        waiting = asyncio.create_task(tr.sender.send(torch.ones(16)))
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stats = tr.sender.stats()
        assert (stats.waiting_sends, stats.live_leases, stats.leaked_bytes) == (0, 1, 0)
        assert stats.fallback_used_bytes == 1 * MiB
        assert device.allocated_bytes == baseline

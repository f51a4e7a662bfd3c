"""The IPC protocol in one process: exact data, ready signal, releases, fallback reasons."""

from __future__ import annotations

import asyncio
import math
import os
import pickle
from typing import Any

import pytest
import torch
from conftest import Rig
from ipc_support import (
    MiB,
    ipc_settings,
    new_receiver,
    same_bytes,
    settled_bytes,
    transport,
)

from mmcache.device import SimDevice
from mmcache.errors import CacheClosedError, InvalidValueError, SettingsError
from mmcache.ipc import FeatureHandle, FeatureSender, HandleExpiredError
from mmcache.ipc.channel import SenderChannel
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.pool import ArenaViews


def _mixed_features() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(48, 96, generator=g)
    return [
        torch.randn(128, 64, generator=g).to(torch.bfloat16),
        torch.randn(3, 5, 7, generator=g),
        torch.randint(-(2**40), 2**40, (1000,), generator=g),
        torch.randint(0, 255, (77,), generator=g).to(torch.uint8),
        torch.rand(33, generator=g) > 0.5,
        torch.tensor(3.25),
        torch.empty(0, 16),
        wide.t(),  # a non-contiguous view
        wide[::2, 5:40],  # a strided slice of a larger storage
    ]


async def test_every_consumer_receives_exactly_what_was_sent(rig: Rig) -> None:
    async with transport(rig, consumers=2, pool_mb=2) as tr:
        baseline = rig.allocated_bytes()
        for value in _mixed_features():
            want = value.clone()
            handle = await tr.sender.send(tr.on_device(value))
            del value
            handle = FeatureHandle.from_bytes(handle.to_bytes())  # it crosses a process boundary
            for receiver in tr.receivers:
                got = await receiver.receive(handle)
                assert same_bytes(got, want), f"{handle.describe()}: wrong data"
                assert receiver.device.is_device_tensor(got)
                del got
        assert await tr.sender.drain(timeout=5)
        stats = tr.sender.stats()
        assert stats.pool_used_bytes == 0
        assert stats.live_leases == 0
        assert stats.leaked_bytes == 0
        assert stats.fallbacks == 0
        assert await settled_bytes(rig, baseline) == baseline


async def test_a_slice_is_reused_only_after_every_consumer_released_it(rig: Rig) -> None:
    async with transport(rig, consumers=2) as tr:
        first, second = tr.receivers
        handle = await tr.sender.send(tr.on_device(torch.ones(256, 256)))
        await first.receive(handle)
        tr.sender.sweep()
        assert tr.sender.stats().pool_used_bytes == 256 * 1024
        assert tr.sender.stats().live_leases == 1
        await second.receive(handle)
        assert await tr.sender.drain(timeout=5)
        assert tr.sender.stats().pool_used_bytes == 0


async def test_receive_waits_for_the_senders_copy(sim_rig: Rig) -> None:
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1) as tr:
        want = torch.randn(64, 64)
        with device.hold():
            handle = await tr.sender.send(want.clone())  # the pool path does not wait
            reader = asyncio.create_task(tr.receivers[0].receive(handle))
            await asyncio.sleep(0.05)
            assert not reader.done(), "receive returned while the sender's copy was held"
        assert torch.equal(await reader, want)


async def test_a_receiver_that_skips_the_ready_signal_reads_poison(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above can fail: without the wait, the copy-out reads the slice too early."""

    async def no_wait(*args: object) -> None:
        return None

    monkeypatch.setattr(SenderChannel, "wait_ready", no_wait)
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1) as tr:
        with device.hold():
            handle = await tr.sender.send(torch.randn(64, 64))
            reader = asyncio.create_task(tr.receivers[0].receive(handle))
            await asyncio.sleep(0.05)
            early = reader.done()
        got = await reader
        assert early
        assert torch.isnan(got).all(), "the early read should have seen the pool's poison"


async def test_a_pool_send_records_no_fence_of_its_producers(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy into the pool is ordered on the producer's stream itself: the fence of the
    tensors' makers is recorded only where a failure or the host fallback needs it."""
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1) as tr:
        producer = device.stream("encoder")
        want = sim_rig.tensor(128, 64)
        recorded: list[object] = []
        record = device.record

        def counted(stream: Any) -> Any:
            recorded.append(stream)
            return record(stream)

        monkeypatch.setattr(device, "record", counted)
        handle = await tr.sender.send(want.clone(), stream=producer)
        assert handle.where == "pool"
        assert producer not in recorded
        monkeypatch.undo()
        assert same_bytes(await tr.receivers[0].receive(handle), want)


@pytest.mark.parametrize(
    ("settings", "nbytes", "reason"),
    [
        ({"pool_mb": 1}, 2 * MiB, "too_large"),
        ({"pool_mb": 1, "use_cuda_ipc": False}, 4096, "disabled"),
        ({"pool_mb": 0}, 4096, "disabled"),
    ],
)
async def test_a_send_the_pool_cannot_take_falls_back_and_says_why(
    rig: Rig, settings: dict[str, Any], nbytes: int, reason: str
) -> None:
    async with transport(rig, consumers=1, **settings) as tr:
        want = torch.arange(nbytes // 4, dtype=torch.int32)
        handle = await tr.sender.send(tr.on_device(want.clone()))
        assert handle.where == "host"
        assert torch.equal(await tr.receivers[0].receive(handle), tr.on_device(want))
        assert tr.sender.stats().fallbacks_by_reason == {reason: 1}
        assert tr.metric("mmcache_ipc_fallbacks_total", reason=reason) == 1


async def test_a_full_pool_falls_back_with_reason_pool_full(rig: Rig) -> None:
    async with transport(rig, consumers=1, pool_mb=1) as tr:
        handles = [
            await tr.sender.send(tr.on_device(torch.full((128, 1024), float(i)))) for i in range(3)
        ]
        assert [h.where for h in handles] == ["pool", "pool", "host"]
        assert tr.metric("mmcache_ipc_fallbacks_total", reason="pool_full") == 1
        for i, handle in enumerate(handles):
            assert torch.equal(
                (await tr.receivers[0].receive(handle)).cpu(), torch.full((128, 1024), float(i))
            )
        assert await tr.sender.drain(timeout=5)
        # Released slices come back: the next send goes through the pool again.
        assert (await tr.sender.send(tr.on_device(torch.ones(128, 1024)))).where == "pool"


async def test_a_send_that_finds_the_pool_full_waits_for_a_release_instead_of_falling_back(
    rig: Rig,
) -> None:
    async with transport(rig, consumers=1, pool_mb=1, ipc_pool_wait_s=10.0) as tr:
        half = (128, 1024)  # 512 KiB: two fill the pool
        held = [await tr.sender.send(tr.on_device(torch.full(half, float(i)))) for i in range(2)]
        third = asyncio.create_task(tr.sender.send(tr.on_device(torch.full(half, 2.0))))
        await asyncio.sleep(0.05)
        assert not third.done(), "the send fell back instead of waiting for the pool"
        got = await tr.receivers[0].receive(held[0])  # frees the first slice once read
        handle = await asyncio.wait_for(third, 5)
        assert handle.where == "pool"
        assert tr.sender.stats().fallbacks == 0
        assert torch.equal(got.cpu(), torch.zeros(half))
        for i, h in ((1, held[1]), (2, handle)):
            assert torch.equal((await tr.receivers[0].receive(h)).cpu(), torch.full(half, i))
        assert await tr.sender.drain(timeout=5)


async def test_a_pool_held_by_its_readers_costs_one_wait_then_falls_back_at_once(
    rig: Rig,
) -> None:
    wait_s = 0.3
    async with transport(rig, consumers=1, pool_mb=1, ipc_pool_wait_s=wait_s) as tr:
        half = (128, 1024)
        held = [await tr.sender.send(tr.on_device(torch.full(half, float(i)))) for i in range(2)]
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = await tr.sender.send(tr.on_device(torch.ones(half)))
        waited = loop.time() - began
        began = loop.time()
        second = await tr.sender.send(tr.on_device(torch.ones(half)))
        again = loop.time() - began
        began = loop.time()
        third = await tr.sender.send(tr.on_device(torch.ones(half)), wait=False)
        unwaited = loop.time() - began
        assert (first.where, second.where, third.where) == ("host", "host", "host")
        assert waited >= wait_s
        assert again < wait_s / 2, "a second send waited for a pool nobody has freed"
        assert unwaited < wait_s / 2
        assert tr.sender.stats().fallbacks_by_reason == {"pool_full": 3}
        for handle in (*held, first, second, third):
            await tr.receivers[0].receive(handle)
        assert await tr.sender.drain(timeout=5)
        # The pool freed room: the next full pool is waited for again.
        refill = [await tr.sender.send(tr.on_device(torch.ones(half))) for _ in range(2)]
        assert [h.where for h in refill] == ["pool", "pool"]
        began = loop.time()
        assert (await tr.sender.send(tr.on_device(torch.ones(half)))).where == "host"
        assert loop.time() - began >= wait_s


async def test_a_receiver_without_peer_access_makes_sends_fall_back(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        # A receiver that registered as unable to read the sender's pool (another GPU).
        other = ControlBlock.attach(tr.sender.endpoint.control_path)
        lane, epoch = other.register(os.getpid(), peer_ok=False)
        handle = await tr.sender.send(torch.ones(16))
        assert handle.where == "host"
        assert tr.metric("mmcache_ipc_fallbacks_total", reason="no_peer") == 1
        assert torch.equal(await tr.receivers[0].receive(handle), torch.ones(16))
        other.leave(lane, epoch)
        other.close(unlink=False)
        tr.sender.sweep()
        handle = await tr.sender.send(torch.ones(16))
        assert handle.where == "pool"
        assert torch.equal(await tr.receivers[0].receive(handle), torch.ones(16))
        assert await tr.sender.drain(timeout=5)


async def test_pool_metrics_add_up_and_show_open_leases(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=2) as tr:
        handle = await tr.sender.send(torch.ones(64, 1024))
        first, second = tr.receivers
        capacity = tr.sender.stats().pool_capacity_bytes

        def states() -> dict[str, float]:
            tr.sender.sweep()
            return {
                s: tr.metric("mmcache_ipc_pool_bytes", state=s) for s in ("used", "leased", "free")
            }

        assert states() == {"used": 256 * 1024, "leased": 0, "free": capacity - 256 * 1024}
        async with first.lease(handle) as view:
            assert torch.equal(view, torch.ones(64, 1024))
            assert states() == {"used": 0, "leased": 256 * 1024, "free": capacity - 256 * 1024}
        await second.receive(handle)
        assert states() == {"used": 0, "leased": 0, "free": capacity}
        assert tr.metric("mmcache_leaked_bytes", tier="ipc") == 0


async def test_a_lease_is_zero_copy_and_keeps_its_slice(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        handle = await tr.sender.send(torch.arange(4096, dtype=torch.int32))
        receiver = tr.receivers[0]
        async with receiver.lease(handle) as view:
            # A view of the shared pool itself, not a copy.
            assert view.untyped_storage().nbytes() == tr.sender.stats().pool_capacity_bytes
            await asyncio.sleep(0.05)
            tr.sender.sweep()
            assert tr.sender.stats().live_leases == 1
            assert torch.equal(view, torch.arange(4096, dtype=torch.int32))
        assert await tr.sender.drain(timeout=5)


async def test_a_handle_received_after_its_slice_was_reclaimed_is_refused(rig: Rig) -> None:
    async with transport(rig, consumers=1) as tr:
        handle = await tr.sender.send(tr.on_device(torch.ones(8)))
        await tr.receivers[0].receive(handle)
        assert await tr.sender.drain(timeout=5)
        with pytest.raises(HandleExpiredError, match=f"#{handle.seq}"):
            await tr.receivers[0].receive(handle)


async def test_handles_are_small_picklable_values(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        handle = await tr.sender.send(torch.ones(2, 3, dtype=torch.bfloat16))
        copy = pickle.loads(pickle.dumps(handle))
        assert isinstance(copy, FeatureHandle) and copy == handle
        assert len(pickle.dumps(handle)) < 1024
        assert (copy.shape, copy.dtype, copy.nbytes) == ((2, 3), "bfloat16", 12)
        assert f"#{handle.seq}" in copy.describe() and str(os.getpid()) in copy.describe()
        await tr.receivers[0].receive(copy)


async def test_send_refuses_what_it_cannot_carry(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        with pytest.raises(InvalidValueError, match=r"torch\.Tensor"):
            await tr.sender.send([1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="consumers"):
            FeatureSender(ipc_settings(), device=sim_rig.device, consumers=0)


@pytest.mark.parametrize("arg", ["max_slices", "max_receivers"])
def test_a_sender_refuses_more_slots_or_lanes_than_its_control_block_holds(
    sim_rig: Rig, arg: str
) -> None:
    # Refused when made, naming the argument: not at start() as a "version mismatch".
    with pytest.raises(SettingsError, match=rf"^{arg} must be at most 1048576, not 2000000"):
        kwargs: dict[str, Any] = {arg: 2_000_000}
        FeatureSender(ipc_settings(), device=sim_rig.device, **kwargs)


async def test_a_closed_sender_unlinks_its_memory_and_refuses_sends(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        endpoint = tr.sender.endpoint
        await tr.sender.close()
        paths = [endpoint.control_path, endpoint.pool_path, endpoint.fallback_path]
        assert all(paths)
        assert not any(map(os.path.exists, paths))
        with pytest.raises(CacheClosedError):
            await tr.sender.send(torch.ones(4))
        # The simulator's device memory is back: the pool was its only allocation.
        assert sim_rig.allocated_bytes() == 0
        # A receiver that meets the closed sender gets a clear error.
        late = new_receiver(sim_rig)
        with pytest.raises(Exception, match="gone"):
            await late.connect(endpoint)
        await late.close()


async def test_a_receiver_reads_each_handle_once_even_while_another_still_holds_it(
    rig: Rig,
) -> None:
    """A second read by the same receiver would still be reading the slice once its first
    read's release lets the sender reuse it: it is refused, at once or concurrently."""
    async with transport(rig, consumers=2) as tr:
        first, second = tr.receivers
        want = rig.tensor(64, 32, seed=3)
        handle = await tr.sender.send(want.clone())
        reads = await asyncio.gather(
            first.receive(handle), first.receive(handle), return_exceptions=True
        )
        served = [r for r in reads if isinstance(r, torch.Tensor)]
        refused = [r for r in reads if isinstance(r, HandleExpiredError)]
        assert len(served) == 1 and len(refused) == 1, reads
        assert "already received" in str(refused[0])
        assert same_bytes(served[0], want)
        with pytest.raises(HandleExpiredError, match="already received"):
            async with first.lease(handle):
                pass
        assert same_bytes(await second.receive(handle), want)  # the other consumer still can
        assert await tr.sender.drain(timeout=5)


_VIEW_DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.complex128, torch.bool]


@pytest.mark.parametrize("arena_bytes", [4096, 4093], ids=["whole-items", "odd-size"])
@pytest.mark.parametrize("dtype", _VIEW_DTYPES, ids=str)
def test_arena_views_are_the_bytes_at_their_offset(dtype: torch.dtype, arena_bytes: int) -> None:
    """A feature's view of the pool is the same tensor as its bytes sliced and viewed,
    for every dtype, offset and shape (also one that an arena cannot view whole)."""
    flat = torch.arange(arena_bytes, dtype=torch.int32).to(torch.uint8)
    views = ArenaViews(flat)
    size = dtype.itemsize
    for offset in (0, 256, 3 * size, 1):
        for shape in [(), (0,), (3, 0, 2), (4, 5), (1, 1, 7), (2, 3, 4)]:
            if offset % size:
                continue
            nbytes = size * math.prod(shape)
            want = flat[offset : offset + nbytes].view(dtype).view(shape)
            got = views.view(offset, shape, dtype)
            assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
            assert got.is_contiguous() and got.data_ptr() == want.data_ptr()
            assert got.nbytes == want.nbytes  # the same bytes (NaN payloads compare unequal)
    with pytest.raises(RuntimeError):  # past the arena's storage
        views.view(arena_bytes - size, (2,), dtype)

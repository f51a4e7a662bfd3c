"""A send that fails or is refused gives back every byte and slot it reserved; the audit sees
room that no live send holds. (A send cancelled while it copies or waits for room:
test_ipc_fallback.py::test_a_cancelled_send_leaves_nothing_behind.)"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Rig
from ipc_support import Transport, same_bytes, settled_bytes, transport

from mmcache.device import SimDevice
from mmcache.errors import InvalidValueError
from mmcache.ipc import FeatureSender
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.leases import LeaseLedger


def _odd_layouts(rig: Rig) -> list[tuple[str, torch.Tensor]]:
    """A tensor of each layout send() must refuse, on the rig's device where it can be."""
    dense = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    with warnings.catch_warnings():  # torch calls sparse CSR "beta" and nested "prototype"
        warnings.simplefilter("ignore")
        cases = [
            ("sparse_coo", dense.to_sparse()),
            ("sparse_csr", dense.to_sparse_csr()),
            ("sparse_csc", dense.to_sparse_csc()),
            ("sparse_bsr", dense.to_sparse_bsr((2, 2))),
            ("nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
            (
                "nested",
                torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            ),
        ]
        if rig.kind == "sim":
            cases.append(("mkldnn", dense.to_mkldnn()))
            return cases
        return [(name, t.to(rig.device.name)) for name, t in cases]


async def _assert_all_given_back(tr: Transport, baseline: int) -> None:
    """Nothing of the sender's is reserved or leaked, drain() returns, no failed send is
    counted as sent or as a fallback, and it still works."""
    assert await tr.sender.drain(timeout=2)
    stats = tr.sender.stats()
    assert (stats.sends, stats.fallbacks, stats.fallbacks_by_reason) == (0, 0, {})
    assert stats.pool_used_bytes == 0
    assert stats.fallback_used_bytes == 0
    assert stats.live_leases == 0
    assert stats.waiting_sends == 0
    assert stats.leaked_bytes == 0
    assert await settled_bytes(tr.rig, baseline) == baseline  # the source went back too
    want = tr.rig.tensor(64, 32, seed=9)
    handle = await tr.sender.send(want.clone())
    got = await tr.receivers[0].receive(handle)
    assert same_bytes(got, want)
    del got
    assert await tr.sender.drain(timeout=2)


async def test_send_refuses_tensors_that_are_not_strided_before_reserving(rig: Rig) -> None:
    async with transport(rig, consumers=1) as tr:
        baseline = rig.allocated_bytes()
        for layout, value in _odd_layouts(rig):
            with pytest.raises(InvalidValueError, match=f"not a {layout}( \\(\\w+\\))? one"):
                await tr.sender.send(value)
            stats = tr.sender.stats()
            assert (stats.pool_used_bytes, stats.fallback_used_bytes) == (0, 0), layout
        del value
        await _assert_all_given_back(tr, baseline)


def _fail(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected failure")


#: (where the failure is injected, the transport's settings, how to inject it)
_Injector = Callable[[pytest.MonkeyPatch, FeatureSender], None]
_POINTS: dict[str, tuple[dict[str, Any], _Injector]] = {
    "pool copy": ({}, lambda mp, s: mp.setattr(s.device, "_copy_d2d_into", _fail)),
    "pool ready event": ({}, lambda mp, s: mp.setattr(s._writer, "_record_event", _fail)),
    "pool slot publish": ({}, lambda mp, s: mp.setattr(ControlBlock, "arm", _fail)),
    "pool lease": ({}, lambda mp, s: mp.setattr(LeaseLedger, "add", _fail)),
    "fallback copy": (
        {"use_cuda_ipc": False},
        lambda mp, s: mp.setattr(s.device, "_copy_d2h_batch", _fail),
    ),
    "fallback slot publish": (
        {"use_cuda_ipc": False},
        lambda mp, s: mp.setattr(ControlBlock, "arm", _fail),
    ),
    "fallback lease": (
        {"use_cuda_ipc": False},
        lambda mp, s: mp.setattr(LeaseLedger, "add", _fail),
    ),
}


@pytest.mark.parametrize("point", list(_POINTS))
async def test_a_send_that_fails_after_reserving_gives_everything_back(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    settings, inject = _POINTS[point]
    async with transport(rig, consumers=1, **settings) as tr:
        baseline = rig.allocated_bytes()
        with monkeypatch.context() as patched:
            inject(patched, tr.sender)
            for seed in range(3):  # repeatedly: each failure gives back all it took
                with pytest.raises(RuntimeError, match="injected failure"):
                    await tr.sender.send(rig.tensor(128, 64, seed=seed))
        await _assert_all_given_back(tr, baseline)


async def test_a_strided_fallback_send_whose_packing_fails_gives_everything_back(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dense buffer a strided feature is packed into on its way to the host fallback
    goes back too when the copy into it cannot be queued."""
    async with transport(rig, consumers=1, use_cuda_ipc=False) as tr:
        baseline = rig.allocated_bytes()
        with monkeypatch.context() as patched:
            patched.setattr(tr.sender.device, "_copy_d2d", _fail)
            for seed in range(3):
                with pytest.raises(RuntimeError, match="injected failure"):
                    await tr.sender.send(rig.tensor(64, 128, seed=seed).t())
        await _assert_all_given_back(tr, baseline)


@pytest.mark.parametrize("point", ["pool copy", "pool slot publish", "fallback copy"])
async def test_a_failed_send_gives_its_source_back_only_after_its_producer(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The source of a send that fails is released after the work queued on its stream
    before the send (the kernel that made it), however late that work ends."""
    settings, inject = _POINTS[point]
    device = sim_rig.device
    assert isinstance(device, SimDevice)
    async with transport(sim_rig, consumers=1, **settings) as tr:
        baseline = sim_rig.allocated_bytes()
        producer = device.stream("encoder")
        gate = threading.Event()
        device.launch(producer, lambda: gate.wait(10))
        value = sim_rig.tensor(128, 64)
        nbytes = value.untyped_storage().nbytes()
        with monkeypatch.context() as patched:
            inject(patched, tr.sender)
            with pytest.raises(RuntimeError, match="injected failure"):
                await tr.sender.send(value, stream=producer)
        del value
        await asyncio.sleep(0.05)
        assert sim_rig.allocated_bytes() == baseline + nbytes  # held behind its producer
        gate.set()
        await _assert_all_given_back(tr, baseline)


async def test_the_audit_counts_room_granted_to_a_send_that_ended(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        sender = tr.sender

        async def leaky_send() -> int:
            # A send path that takes room and ends without a lease or giving it back.
            placement = sender._room.try_place(4096, True, asyncio.current_task())
            assert placement is not None
            return placement.block.nbytes

        nbytes = await asyncio.create_task(leaky_send())
        assert sender.stats().leaked_bytes == nbytes
        assert not await sender.drain(timeout=0.1)  # the leak is what drain() waits on

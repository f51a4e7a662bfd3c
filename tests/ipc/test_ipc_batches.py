"""send_many / receive_many / lease_many: the features of one request in one publication."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import Rig
from ipc_support import same_bytes, settled_bytes, transport

from mmcache.errors import InvalidValueError
from mmcache.ipc import FeatureBatch, FeatureHandle, InvalidHandleError
from mmcache.ipc.writer import PART_ALIGNMENT


def _request_features() -> list[torch.Tensor]:
    """Features of one request: several dtypes and odd sizes (parts must stay aligned)."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(40, 24, generator=g)
    return [
        torch.randn(37, 64, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (5,), generator=g).to(torch.uint8),  # 5 bytes: next part unaligned
        torch.randn(3, 7, generator=g).double(),
        wide.t(),  # a non-contiguous view
        torch.empty(0, 8),
        torch.randint(-(2**40), 2**40, (9,), generator=g),
    ]


@pytest.mark.parametrize("path", ["pool", "host"])
async def test_a_batch_arrives_whole_in_order_and_frees_everything(rig: Rig, path: str) -> None:
    async with transport(rig, consumers=2, pool_mb=2, use_cuda_ipc=path == "pool") as tr:
        baseline = rig.allocated_bytes()
        values = _request_features()
        wants = [v.clone() for v in values]
        batch = await tr.sender.send_many([tr.on_device(v) for v in values])
        del values
        assert batch.where == path and len(batch) == len(wants)
        assert all(at % PART_ALIGNMENT == 0 for at, _, _ in batch.parts)
        batch = FeatureBatch.from_bytes(batch.to_bytes())  # it crosses a process boundary
        first, second = tr.receivers
        got = await first.receive_many(batch)
        assert len(got) == len(wants)
        for g, w in zip(got, wants, strict=True):
            assert same_bytes(g, w) and first.device.is_device_tensor(g)
        async with second.lease_many(batch) as views:
            for v, w in zip(views, wants, strict=True):
                assert same_bytes(v.cpu(), w)
        del got, views, g, v  # the loops' last views hold their buffers too
        assert await tr.sender.drain(timeout=5)
        stats = tr.sender.stats()
        assert (stats.live_leases, stats.leaked_bytes, stats.sends) == (0, 0, 1)
        assert stats.fallbacks == (path == "host")
        assert (stats.pool_used_bytes, stats.fallback_used_bytes) == (0, 0)
        assert tr.metric("mmcache_ipc_recycle_seconds_count") == 1  # one slice, reused once
        assert await settled_bytes(rig, baseline) == baseline


@pytest.mark.parametrize("rows_each", [256, 5], ids=["back-to-back", "gaps"])
async def test_a_batch_of_alike_features_arrives_exact_whichever_way_it_is_split(
    rig: Rig, rows_each: int
) -> None:
    """A request's features of one dtype and row shape: back to back in the slice (rows of
    8 KiB) they are split out of one view by rows, with gaps (rows of 5 x 96 bytes) viewed
    one by one; either way each arrives with its own shape and values, whether read into
    a copy or leased in place."""
    g = torch.Generator().manual_seed(5)
    wants = [
        torch.randn(rows_each + i, 2048 if rows_each == 256 else 24, generator=g) for i in range(4)
    ]
    async with transport(rig, consumers=1, pool_mb=32, use_cuda_ipc=True) as tr:
        batch = await tr.sender.send_many([tr.on_device(w) for w in wants])
        assert batch.where == "pool"
        ends = [at + w.nbytes for (at, _, _), w in zip(batch.parts, wants, strict=True)]
        starts = [at for at, _, _ in batch.parts[1:]]
        assert (starts == ends[:-1]) == (rows_each == 256)
        (receiver,) = tr.receivers
        async with receiver.lease_many(batch) as views:
            for v, w in zip(views, wants, strict=True):
                assert v.shape == w.shape and v.is_contiguous() and same_bytes(v.cpu(), w)
            del v
        del views
        batch = await tr.sender.send_many([tr.on_device(w) for w in wants])
        got = await receiver.receive_many(batch)
        for r, w in zip(got, wants, strict=True):
            assert r.shape == w.shape and r.is_contiguous() and same_bytes(r, w)
        del got, r
        assert await tr.sender.drain(timeout=5)
        assert tr.sender.stats().leaked_bytes == 0


async def test_one_batch_takes_one_slot_and_one_release(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1, pool_mb=2) as tr:
        batch = await tr.sender.send_many([torch.ones(256) for _ in range(16)])
        assert tr.sender.stats().live_leases == 1
        tr.sender.sweep()
        assert tr.sender.stats().live_leases == 1  # not released before it was read
        got = await tr.receivers[0].receive_many(batch)
        assert [float(t.sum()) for t in got] == [256.0] * 16
        assert await tr.sender.drain(timeout=5)


async def test_batches_and_single_handles_are_not_confused(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        receiver = tr.receivers[0]
        batch = await tr.sender.send_many([torch.ones(8), torch.zeros(4)])
        handle = await tr.sender.send(torch.ones(8))
        with pytest.raises(InvalidHandleError, match="receive_many"):
            await receiver.receive(batch)  # type: ignore[arg-type]
        with pytest.raises(InvalidHandleError, match="expected a FeatureBatch"):
            await receiver.receive_many(handle)  # type: ignore[arg-type]
        with pytest.raises(InvalidHandleError, match="not an IPC handle"):
            FeatureHandle.from_bytes(batch.to_bytes())
        with pytest.raises(InvalidHandleError, match="not an IPC batch handle"):
            FeatureBatch.from_bytes(handle.to_bytes())
        # Refused without being read or leased: both are still served.
        assert [float(t.sum()) for t in await receiver.receive_many(batch)] == [8.0, 0.0]
        assert float((await receiver.receive(handle)).sum()) == 8.0


async def test_send_many_refuses_bad_input_and_loses_nothing(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        with pytest.raises(InvalidValueError, match="at least one"):
            await tr.sender.send_many([])
        with pytest.raises(InvalidValueError, match=r"torch\.Tensor"):
            await tr.sender.send_many([torch.ones(4), "not a tensor"])  # type: ignore[list-item]
        stats = tr.sender.stats()
        assert (stats.sends, stats.live_leases, stats.pool_used_bytes) == (0, 0, 0)
        batch = await tr.sender.send_many([torch.ones(4)])  # still usable
        assert float((await tr.receivers[0].receive_many(batch))[0].sum()) == 4.0


async def test_an_altered_batch_is_refused_before_anything_is_read(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        receiver = tr.receivers[0]
        batch = await tr.sender.send_many([torch.ones(64), torch.full((32,), 2.0)])
        (a, sa, da), (b, sb, db) = batch.parts
        forged = [
            ((a, sa, da), (b + PART_ALIGNMENT, sb, db)),  # moved part
            ((a, sa, da), (b, (16, 2), db)),  # reshaped, same size
            ((a, sa, da), (b, sb, "int32")),  # retyped, same size
            ((a, sa, da),),  # a part dropped
            ((b, sb, db), (a, sa, da)),  # out of order
            ((a, (128,), da), (b, sb, db)),  # overlapping
            ((a, sa, da), (b + 2, sb, db)),  # misaligned
        ]
        for parts in forged:
            with pytest.raises(InvalidHandleError):
                await receiver.receive_many(dataclasses.replace(batch, parts=parts))
        with pytest.raises(InvalidHandleError):
            await receiver.receive_many(dataclasses.replace(batch, parts=()))
        got = await receiver.receive_many(batch)
        assert [float(t.sum()) for t in got] == [64.0, 64.0]

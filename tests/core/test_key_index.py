"""KeyIndex, Quarantine and SingleFlight through their own interfaces."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import TimedFence

from mmcache.core.entry import Entry, Member, State
from mmcache.core.index import KeyIndex, holder
from mmcache.core.quarantine import Quarantine
from mmcache.single_flight import SingleFlight

DONE = TimedFence(0)  # a fence already done


def _entry(key: str, nbytes: int = 64) -> Entry:
    return Entry(key, (16,), torch.float32, nbytes, State.GPU, None, DONE)


def test_a_group_indexes_one_member_per_key_and_goes_with_its_last() -> None:
    index = KeyIndex()
    packed = torch.zeros(6, 4)
    group = index.add_group(["a", "b", "c"], [1, 2, 3], packed, _entry("x").ready, 96)
    assert group.count == 3 and len(index) == 3
    b = index["b"]
    assert isinstance(b, Member) and (b.start, b.stop) == (1, 3) and holder(b) is group
    assert index.held() == [group] and index.holder("c") is group
    assert index.leave(b) and not index.leave(b)  # once only
    assert group.count == 2 and "b" not in index
    assert index.forget(group) == 2 and len(index) == 0 and group.members == []


def test_forget_leaves_a_key_that_names_another_entry() -> None:
    index = KeyIndex()
    old, new = _entry("k"), _entry("k")
    index["k"] = new  # old was replaced
    assert index.forget(old) == 0 and index["k"] is new
    assert index.forget(new) == 1 and "k" not in index


def test_quarantine_holds_bytes_until_released() -> None:
    quarantine = Quarantine()
    entry = _entry("k")
    assert not quarantine and entry not in quarantine
    quarantine.hold(entry, 64, 512)
    assert entry in quarantine and (quarantine.device_bytes(), quarantine.host_bytes()) == (64, 512)
    quarantine.release(entry)
    quarantine.release(entry)  # a second landing changes nothing
    assert not quarantine and quarantine.device_bytes() == 0


async def test_single_flight_shares_one_task_per_key_and_forgets_it_when_done() -> None:
    flight: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()
    calls = [0]

    async def compute() -> int:
        calls[0] += 1
        await gate.wait()
        return 7

    first, second = flight.run("k", compute), flight.run("k", compute)
    assert first is second and flight.running() == [first]
    other = flight.run("j", compute)
    assert other is not first
    gate.set()
    assert [await first, await other] == [7, 7]
    await asyncio.sleep(0)
    assert calls[0] == 2 and flight.running() == []


async def test_single_flight_forgets_a_failed_computation() -> None:
    flight: SingleFlight[int] = SingleFlight()

    async def failing() -> int:
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        await flight.run("k", failing)
    await asyncio.sleep(0)
    assert flight.running() == []

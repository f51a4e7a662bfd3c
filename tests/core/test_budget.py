"""FifoBudget: first come first served, and what a caller gave up goes back."""

from __future__ import annotations

import asyncio

import pytest

from mmcache.budget import FifoBudget


class Room:
    """A ledger of free bytes that FifoBudget grants from."""

    def __init__(self, free: int) -> None:
        self.free = free

    def take(self, nbytes: int) -> int | None:
        if nbytes > self.free:
            return None
        self.free -= nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        self.free += nbytes


async def test_the_head_is_served_first_even_when_a_later_caller_would_fit() -> None:
    room = Room(0)
    budget = FifoBudget(room.take, room.give_back)
    big, small = budget.join(10), budget.join(1)
    waits = [asyncio.create_task(budget.wait(w)) for w in (big, small)]
    room.free = 5
    budget.grant()
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)  # small fits, but big came first
    assert budget.wanted() == [10, 1]
    room.free = 11
    budget.grant()
    assert await asyncio.gather(*waits) == [10, 1]
    assert room.free == 0 and not budget


async def test_a_cancelled_caller_leaves_the_line_and_gives_back_its_grant() -> None:
    room = Room(0)
    budget = FifoBudget(room.take, room.give_back)
    first = asyncio.create_task(budget.wait(budget.join(4)))
    second = asyncio.create_task(budget.wait(budget.join(4)))
    await asyncio.sleep(0)
    room.free = 4
    budget.grant()  # granted to first, which is cancelled before it resumes
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert room.free == 4  # given back, not lost
    budget.grant()
    assert await second == 4
    assert not budget


async def test_a_caller_timing_out_in_line_leaves_it() -> None:
    room = Room(0)
    budget = FifoBudget(room.take, room.give_back)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await budget.wait(budget.join(1))
    assert not budget and len(budget) == 0


async def test_fail_all_raises_in_every_waiting_caller() -> None:
    room = Room(0)
    budget = FifoBudget(room.take, room.give_back)
    waits = [asyncio.create_task(budget.wait(budget.join(n))) for n in (1, 2)]
    await asyncio.sleep(0)
    budget.fail_all(lambda: RuntimeError("closing"))
    for wait in waits:
        with pytest.raises(RuntimeError, match="closing"):
            await wait
    assert room.free == 0 and not budget

"""Packings through its own interface: the values of packing copies are let go as each
copy finishes, in any order, and a copy still running is watched, never polled."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence

import torch

from mmcache.core.entry import Entry
from mmcache.core.packing import Packings
from mmcache.device.base import Fence


class HandFence(Fence):
    """A fence the test completes."""

    def __init__(self) -> None:
        self._done = False

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        raise NotImplementedError  # Packings watches through its when_done

    def wait(self, timeout: float | None = None) -> bool:
        return self._done

    def complete(self) -> None:
        self._done = True


class Watches:
    """when_done for Packings: records each watch; fire() runs those whose fences are done."""

    def __init__(self) -> None:
        self.armed: list[tuple[Sequence[Fence], Callable[[], None]]] = []

    def __call__(self, fences: Sequence[Fence], callback: Callable[[], None]) -> None:
        self.armed.append((fences, callback))

    def fire(self) -> None:
        done = [w for w in self.armed if all(f.done() for f in w[0])]
        self.armed = [w for w in self.armed if w not in done]
        for _, callback in done:
            callback()


def checked(found: list[tuple[Entry, Fence]]) -> Callable[[Entry, Fence], None]:
    return lambda group, fence: found.append((group, fence))


async def test_packings_finishing_out_of_order_let_go_of_their_values_and_none_is_polled() -> None:
    watches = Watches()
    packings = Packings(watches, checked([]))
    packings.bind(asyncio.get_running_loop())
    stuck, other = HandFence(), HandFence()
    stuck_values, other_values = [torch.zeros(4)], [torch.ones(4)]
    refs = [weakref.ref(stuck_values[0]), weakref.ref(other_values[0])]
    packings.hold(stuck, stuck_values, None)
    packings.hold(other, other_values, None)
    del stuck_values, other_values
    assert packings and packings.polling  # the loop's second look is armed
    other.complete()  # the later packing finishes first
    await asyncio.sleep(0.02)  # past the second look
    assert refs[1]() is None, "a finished packing's values kept behind a running one"
    assert refs[0]() is not None, "a running packing's values let go"
    assert not packings.polling, "a packing still running is polled"
    assert [fences for fences, _ in watches.armed] == [[stuck]], "one watch, on the running one"
    stuck.complete()
    watches.fire()
    assert not packings and refs[0]() is None


async def test_a_finished_packing_has_its_group_checked_once() -> None:
    found: list[tuple[Entry, Fence]] = []
    watches = Watches()
    packings = Packings(watches, checked(found))
    packings.bind(asyncio.get_running_loop())
    fence = HandFence()
    group = object()
    packings.hold(fence, [torch.zeros(4)], group)  # type: ignore[arg-type]
    packings.reap()
    assert found == [] and packings
    fence.complete()
    packings.reap()
    packings.reap()
    assert found == [(group, fence)] and not packings
    packings.close()
    assert not packings.polling  # its timer cancelled

"""Entry through its own interface: every change of state is one method that refuses a
transition the lifecycle does not have."""

from __future__ import annotations

import pytest
import torch
from conftest import TimedFence

from mmcache.core.entry import Entry, GroupKey, Member, State
from mmcache.host_pool import HostBlock

DONE = TimedFence(0)  # a fence already done
COPY = TimedFence(0)  # an offload's copy fence
ARENA = torch.zeros(4096, dtype=torch.uint8)


def _gpu_entry() -> tuple[Entry, torch.Tensor]:
    tensor = torch.zeros(16)
    return Entry("k", (16,), torch.float32, 64, State.GPU, tensor, DONE), tensor


def _fields(entry: Entry) -> tuple[object, ...]:
    """What the transitions change (read through a call: mypy keeps no narrowing across it)."""
    return entry.state, entry.tensor, entry.block, entry.ready, entry.copy_fence, entry.count


def _block() -> HostBlock:
    return HostBlock(0, 1024, ARENA)


def test_an_entry_goes_gpu_d2h_host_and_back_to_gpu() -> None:
    entry, tensor = _gpu_entry()
    block = _block()
    entry.begin_offload(block, COPY)
    assert _fields(entry) == (State.D2H, tensor, block, DONE, COPY, 1)  # the copy reads tensor
    landed = TimedFence(0)
    assert entry.land(landed) is tensor
    assert _fields(entry) == (State.HOST, None, block, landed, landed, 1)
    again = torch.ones(16)
    entry.promote(again, COPY)  # inclusive: it keeps its host copy
    assert _fields(entry) == (State.GPU, again, block, COPY, landed, 1)
    assert entry.demote() is again  # back to the host tier with no copy
    assert _fields(entry) == (State.HOST, None, block, landed, landed, 1)
    third = torch.ones(16)
    entry.promote(third, COPY)
    assert entry.discard() is third
    assert _fields(entry) == (State.GONE, None, block, COPY, landed, 1)
    assert entry.take_block() is block  # its host copy is freed apart
    assert _fields(entry) == (State.GONE, None, None, COPY, landed, 1)


def test_a_promoted_entry_gives_up_its_host_copy_and_stays_on_the_gpu() -> None:
    entry, _ = _gpu_entry()
    block = _block()
    entry.begin_offload(block, COPY)
    entry.land(DONE)
    again = torch.ones(16)
    entry.promote(again, COPY)
    assert entry.take_block() is block  # a host-tier eviction of its copy
    assert _fields(entry) == (State.GPU, again, None, COPY, DONE, 1)
    with pytest.raises(AssertionError, match="cannot demote"):
        entry.demote()  # no host copy left: leaving the GPU tier takes a copy again
    other = _block()
    entry.begin_offload(other, COPY)
    assert _fields(entry)[:3] == (State.D2H, again, other)


def test_discard_hands_back_only_a_gpu_entrys_tensor() -> None:
    entry, tensor = _gpu_entry()
    entry.begin_offload(_block(), COPY)
    assert entry.discard() is None
    assert _fields(entry)[:2] == (State.GONE, tensor), "a D2H one keeps it for its landing"
    assert entry.end_offload() is tensor and entry.tensor is None
    assert entry.take_block() is not None  # gone: its landing frees the block


def test_a_failed_copy_ends_the_offload_without_landing() -> None:
    entry, tensor = _gpu_entry()
    entry.begin_offload(_block(), COPY)
    assert entry.end_offload() is tensor
    assert _fields(entry)[:2] == (State.D2H, None)
    entry.discard()
    assert _fields(entry)[:2] == (State.GONE, None)


@pytest.mark.parametrize(
    ("setup", "change"),
    [
        ("host", lambda e: e.begin_offload(_block(), COPY)),  # HOST -> D2H
        ("gpu", lambda e: e.land(DONE)),  # GPU -> HOST without a copy
        ("host", lambda e: e.land(DONE)),  # landed twice
        ("gpu", lambda e: e.end_offload()),  # no offload to end
        ("gpu", lambda e: e.promote(torch.zeros(16), DONE)),  # GPU -> GPU
        ("host", lambda e: e.promote(torch.zeros(16), DONE)),  # no host copy to keep
        ("gpu", lambda e: e.demote()),  # no host copy to go back to
        ("host_with_block", lambda e: e.demote()),  # not on the GPU
        ("promoted", lambda e: e.begin_offload(_block(), COPY)),  # has a host copy: demoted
        ("promoted", lambda e: e.promote(torch.zeros(16), DONE)),  # GPU -> GPU
        ("gone", lambda e: e.discard()),  # discarded twice
        ("d2h", lambda e: e.take_block()),  # a copy is writing it
        ("gpu", lambda e: e.member_left()),  # not a group
        ("gpu", lambda e: e.drop_members()),  # not a group
    ],
)
def test_an_illegal_transition_raises_naming_the_state(setup: str, change: object) -> None:
    entry, _ = _gpu_entry()
    block = _block()
    if setup != "gpu":
        entry.begin_offload(block, COPY)
    if setup in ("host", "host_with_block", "promoted"):
        entry.land(DONE)
    if setup == "host":
        entry.take_block()
    if setup == "promoted":
        entry.promote(torch.ones(16), DONE)
    if setup == "gone":
        entry.discard()
    before = _fields(entry)
    state = entry.state.name
    with pytest.raises(AssertionError, match=f"internal error: entry 'k' in state {state}"):
        change(entry)  # type: ignore[operator]
    assert _fields(entry) == before, "a refused transition changes nothing"


def test_a_groups_members_are_set_once_leave_one_by_one_and_are_dropped() -> None:
    group = Entry(GroupKey("a", 2), (3, 4), torch.float32, 48, State.GPU, None, DONE, count=2)
    members = [Member(("a", group, 0, 1)), Member(("b", group, 1, 3))]
    with pytest.raises(AssertionError, match="cannot take 1 members"):
        group.add_members(members[:1])  # the count says two
    group.add_members(members)
    with pytest.raises(AssertionError, match="cannot take 2 members"):
        group.add_members(members)  # once only
    group.member_left()
    group.member_left()
    assert group.count == 0
    with pytest.raises(AssertionError, match=r"in state GPU .*count 0\) cannot lose a member"):
        group.member_left()
    assert group.drop_members() == members and group.members == []

"""NodeDirectory on its own: blocks, shared copies, references, and the blocks of a dead rank;
and one rank's NodeHostPool over it."""

from __future__ import annotations

import dis
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any

import pytest
import torch

from mmcache import node_directory
from mmcache.device import SimDevice
from mmcache.device.base import Fence
from mmcache.ipc.shm import SHM_DIR
from mmcache.node_directory import NodeDirectory
from mmcache.node_pool import NodeHostPool

KiB = 1024


def _path(tmp_path: Path) -> str:
    return os.path.join(SHM_DIR, f"mmcache-test-dir-{os.getpid()}-{tmp_path.name}")


def test_a_feature_is_shared_once_written_and_a_second_copy_gives_way(tmp_path: Path) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    try:
        first, second = directory.carve([4 * KiB]), directory.carve([4 * KiB, 8 * KiB])
        assert first == 0 and second == 4 * KiB  # best fit, back to back
        assert directory.publish(first, (1, 2)) is None  # shared from now on
        assert directory.adopt((1, 2), 4 * KiB) == first
        assert directory.adopt((1, 2), 8 * KiB) is None  # another size: another feature
        assert directory.adopt((3, 4), 4 * KiB) is None
        assert directory.publish(second, (1, 2)) == first  # landed second: take the first
        assert directory.usage().used_bytes == 16 * KiB
        assert directory.release(second)  # the copy landed second goes back at once
        assert directory.usage().used_bytes == 12 * KiB
        assert directory.release(first) and directory.release(second + 4 * KiB)
        assert directory.usage().used_bytes == 0 and directory.records() == []
    finally:
        directory.detach()
        os.unlink(path)


def test_a_directory_of_another_layout_in_use_is_refused_not_wiped(tmp_path: Path) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    try:
        held = directory.carve([4 * KiB])
        with open(path, "r+b") as f:  # as another mmcache version's rank 0 would have it
            f.seek(8)  # the header's version cell
            f.write((1).to_bytes(8, sys.byteorder))
        made: list[int] = []
        with pytest.raises(RuntimeError, match="layout 1"):
            NodeDirectory.open(path, 1, 64 * KiB, 4096, lambda: made.append(1))
        assert made == [] and os.path.getsize(path) > 0  # the arena was not made anew
        with open(path, "rb") as f:
            f.seek(8)
            assert int.from_bytes(f.read(8), sys.byteorder) == 1
        assert held == 0
    finally:
        directory.detach()
        os.unlink(path)


def _attach_and_die(path: str) -> None:
    directory = NodeDirectory.open(path, 1, 64 * KiB, 4096, lambda: None)
    only_mine = directory.carve([4 * KiB])
    assert only_mine is not None
    assert directory.adopt((1, 2), 4 * KiB) == 0  # held by rank 0 and by this one
    os._exit(0)  # no detach: the kernel drops its locks


def test_the_blocks_of_a_rank_that_died_are_swept(tmp_path: Path) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    try:
        shared = directory.carve([4 * KiB])
        assert shared == 0
        assert directory.publish(shared, (1, 2)) is None
        child = multiprocessing.get_context("spawn").Process(target=_attach_and_die, args=(path,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert directory.usage().blocks == 2 and directory.usage().ranks == (0, 1)
        assert directory.sweep() == 1  # its own block; the shared one is still rank 0's
        usage = directory.usage()
        assert (usage.blocks, usage.used_bytes, usage.ranks) == (1, 4 * KiB, (0,))
        assert [holders for _, _, holders, _, _ in directory.records()] == [0b1]
        assert directory.release(shared)  # the last holder: free
        assert directory.usage().used_bytes == 0
    finally:
        directory.detach()
        os.unlink(path)


class _Pending(Fence):
    """A copy that has not landed yet (the test lands it by hand)."""

    def done(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        raise AssertionError("the pool defers through its defer=, not the fence")

    def wait(self, timeout: float | None = None) -> bool:
        return False


def test_a_rank_holding_one_block_twice_keeps_it_until_both_references_go(
    tmp_path: Path,
) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    deferred: list[Callable[[], None]] = []

    def defer(fences: Sequence[Fence], then: Callable[[], None]) -> None:
        deferred.append(then)

    arena = torch.zeros(64 * KiB, dtype=torch.uint8)
    pool = NodeHostPool(SimDevice(), arena, directory, alignment=4 * KiB, defer=defer)
    try:
        first = pool.allocate(4 * KiB)
        assert first is not None
        arena[: 4 * KiB] = 7  # the feature's bytes, written
        assert pool.publish(first, "k", (4 * KiB,), torch.uint8) is None
        pool.free(first, after=[_Pending()])  # an upload still reads it: the free waits
        again = pool.adopt("k", (4 * KiB,), torch.uint8, 4 * KiB)
        assert again is not None and again.offset == first.offset  # the same block, twice
        deferred.pop()()  # the upload landed: the first reference goes
        # The directory has one bit for the rank: it must not hear of a release yet.
        assert [r[:3] for r in directory.records()] == [(0, 4 * KiB, 0b1)]
        assert bool((arena[: 4 * KiB] == 7).all()), "the bytes still held were poisoned"
        pool.free(again)
        assert directory.records() == [] and pool.used_bytes == 0
    finally:
        directory.detach()
        os.unlink(path)


def test_a_second_thread_waits_for_the_directory_lock_and_leaves_it_held(
    tmp_path: Path,
) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    inside, leave = threading.Event(), threading.Event()

    def loop_thread() -> None:  # in the middle of a change, as carve() on the event loop
        with directory._locked():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=loop_thread)
    holder.start()
    try:
        assert inside.wait(10)
        # stats() from another thread: a lockf of the process's own lock would pass at once,
        # and its unlock would let other processes change the table under the loop thread.
        reader = threading.Thread(target=directory.usage)
        reader.start()
        reader.join(0.3)
        assert reader.is_alive(), "usage() did not wait for the thread holding the lock"
        leave.set()
        reader.join(10)
        assert not reader.is_alive()
    finally:
        leave.set()
        holder.join(10)
        directory.detach()
        os.unlink(path)


_STORE_SUBSCR = dis.opmap["STORE_SUBSCR"]
_BINARY_OP = dis.opmap["BINARY_OP"]
_FIRST_INPLACE = 13  # BINARY_OP's arguments from here on are the in-place ones (a += b)


def _is_a_write(code: CodeType, at: int) -> bool:
    """Whether the instruction at byte offset at stores into a subscript (t[i] = v, t[i] |= v)."""
    op = code.co_code[at]
    return op == _STORE_SUBSCR or (op == _BINARY_OP and code.co_code[at + 1] >= _FIRST_INPLACE)


def _codes(module: ModuleType) -> list[CodeType]:
    """Every code object defined in module: its functions, methods and what they nest."""
    found: list[CodeType] = []
    todo = [
        f.__code__
        for owner in (module, *[c for c in vars(module).values() if isinstance(c, type)])
        for f in vars(owner).values()
        if isinstance(f, FunctionType) and f.__module__ == module.__name__
    ]
    while todo:
        code = todo.pop()
        found.append(code)
        todo += [c for c in code.co_consts if isinstance(c, CodeType)]
    return found


def _die_at(step: int) -> None:
    """Exit this process, as a SIGKILL would, right before its step-th write in
    node_directory.py from now on. The directory writes its shared cells by item
    assignment or in place (t[i] = v, t[i] |= v): dying before each of those in turn is
    dying at every point that differs."""
    seen = 0

    def before(code: CodeType, at: int) -> None:
        nonlocal seen
        if _is_a_write(code, at):
            seen += 1
            if seen == step:
                os._exit(0)

    if sys.version_info >= (3, 12):
        # Per-opcode trace events asked for from a trace function are not delivered on
        # 3.12 (and not always on 3.13): watch the module's instructions instead.
        monitoring = sys.monitoring  # type: ignore[attr-defined,unused-ignore]
        tool = monitoring.DEBUGGER_ID
        monitoring.use_tool_id(tool, "die_at")
        monitoring.register_callback(tool, monitoring.events.INSTRUCTION, before)
        for code in _codes(node_directory):
            monitoring.set_local_events(tool, code, monitoring.events.INSTRUCTION)
        return

    def each(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            before(frame.f_code, frame.f_lasti)
        return each

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != node_directory.__file__:
            return None
        frame.f_trace_opcodes = True
        return each

    sys.settrace(calls)


def _rank_1_works(path: str, step: int) -> None:
    """Rank 1's changes of every kind, dying at step (exit code 1: it finished first)."""
    _die_at(step)
    directory = NodeDirectory.open(path, 1, 64 * KiB, 4096, lambda: None)
    mine = directory.carve([4 * KiB])  # the hole at 0: before every record
    assert mine is not None
    directory.publish(mine, (9, 9))
    assert directory.adopt((7, 1), 4 * KiB) == 4 * KiB
    run = directory.carve([4 * KiB, 8 * KiB])  # the hole in the middle
    assert run is not None
    directory.release(mine)
    directory.release(run + 4 * KiB)
    directory.detach()
    sys.settrace(None)
    os._exit(1)


def test_a_rank_killed_at_any_point_of_a_change_leaves_the_directory_whole(
    tmp_path: Path,
) -> None:
    path = _path(tmp_path)
    directory = NodeDirectory.open(path, 0, 64 * KiB, 4096, lambda: None)
    try:
        # Rank 0 holds the blocks at 4 and 20 KiB; holes at 0 and at 8..20 KiB.
        for i in range(6):
            block = directory.carve([4 * KiB])
            assert block == i * 4 * KiB and directory.publish(block, (7, i)) is None
        for i in (0, 2, 3, 4):
            assert directory.release(i * 4 * KiB)
        before = directory.records()
        step, broken = 0, []
        while True:  # each fork dies one write further into rank 1's changes
            step += 1
            pid = os.fork()
            if pid == 0:
                _rank_1_works(path, step)
            _, status = os.waitpid(pid, 0)
            directory.sweep()
            usage = directory.usage()
            if directory.records() != before or (usage.blocks, usage.used_bytes) != (2, 8 * KiB):
                broken.append((step, directory.records(), usage))
                break
            if os.WEXITSTATUS(status) == 1:
                break  # rank 1 finished: every point of its changes was tried
        assert broken == [], f"a death left the directory torn: {broken[0]}"
        assert step > 10  # it did die inside the changes
    finally:
        directory.detach()
        os.unlink(path)

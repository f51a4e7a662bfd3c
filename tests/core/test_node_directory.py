"""NodeDirectory on its own: blocks, shared copies, references, and the blocks of a dead rank;
and one rank's NodeHostPool over it."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

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

"""NodeDirectory on its own: blocks, shared copies, references, and the blocks of a dead rank."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from mmcache.ipc.shm import SHM_DIR
from mmcache.node_directory import NodeDirectory

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

"""One host tier per node (host_share="node"): the ranks of a group share one arena in /dev/shm.

Each scenario runs its ranks as real processes (spawn) joined by gloo on loopback, each with
its own cache on the simulator and its own GPU budget, all sharing the node's host tier.
After every lookup a second group gathers each rank's answer and checks that they are the
same and exact; at checkpoints the ranks check the node's directory: each feature's bytes
held once, and every rank's own count of host bytes equal to the blocks the directory says
it holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import errno
import multiprocessing
import os
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from ranks import Report, run_ranks, same_bytes, value

from mmcache import CacheClosedError, CacheSettings, FeatureCache, GroupError, SettingsError
from mmcache.agreement import Agreement
from mmcache.device import SimDevice
from mmcache.ipc.errors import SharedMemoryFullError
from mmcache.node_directory import MAX_RANKS, NodeDirectory
from mmcache.node_host import NodeHost, _whereabouts, check_host_share, node_files

KEYS = 24
PEER_TIMEOUT_S = 2.0


def _cache(rank: int, name: str, gpu_kib: float, host_kib: float) -> FeatureCache:
    settings = CacheSettings(
        gpu_cache_mb=gpu_kib / 1024, cpu_cache_mb=host_kib / 1024, evict_ahead=0, host_share="node"
    )
    return FeatureCache(
        settings,
        device=SimDevice(latency_s=0.0004 * rank),
        name=name,
        registry=CollectorRegistry(),
        group=dist.group.WORLD,
    )


def directory_of(cache: FeatureCache) -> NodeDirectory:
    """The node's directory as this rank's cache holds it."""
    node = cache._core.host.node
    assert node is not None and node.directory is not None
    return node.directory


def node_check(cache: FeatureCache, rank: int) -> dict[str, int]:
    """This rank's view of the node, once every rank has drained: each feature once, and
    this rank's host bytes the blocks the directory says it holds."""
    records = directory_of(cache).records()
    stats = cache.stats()
    digests = [digest for _, _, _, digest, shared in records if shared]
    assert len(digests) == len(set(digests)), "a feature's bytes are on the node twice"
    private = [r for r in records if not r[4]]
    assert private == [], f"blocks never shared after every copy landed: {private}"
    mine = sum(nbytes for _, nbytes, holders, _, _ in records if holders >> rank & 1)
    assert mine == stats.cpu_bytes, f"rank {rank}: holds {mine} B, counts {stats.cpu_bytes} B"
    assert stats.node_host_bytes == sum(nbytes for _, nbytes, _, _, _ in records)
    assert stats.leaked_bytes == 0
    return {"node": stats.node_host_bytes, "mine": stats.cpu_bytes}


# --- agreement and one copy per node under random operations ------------------------------


def random_operations(rank: int, world: int, control: Any, seed: int, steps: int) -> Report:
    return asyncio.run(_random_operations(rank, world, seed, steps))


async def _random_operations(rank: int, world: int, seed: int, steps: int) -> Report:
    shared = random.Random(seed)  # the calls every rank makes: same keys, same order
    local = random.Random(seed * 1000 + rank)  # what only this rank does
    checking = dist.new_group(backend="gloo")
    # GPU budgets differ by rank (24 to 72 KiB); the node's host tier is 96 KiB.
    cache = _cache(rank, f"random{seed}", gpu_kib=24 + 16 * rank, host_kib=96)
    counts = {"lookups": 0, "agreed_hits": 0, "checkpoints": 0, "shared_bytes": 0}
    wrong: list[str] = []

    def agree(step: int, kind: str, found: list[torch.Tensor | None], keys: list[int]) -> None:
        """Every rank got the same hits, and each hit is exactly its key's feature."""
        mine = (step, kind, tuple(keys), tuple(t is not None for t in found))
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=checking)
        assert all(other == mine for other in everyone), f"ranks disagree: {everyone}"
        counts["lookups"] += 1
        for key, got in zip(keys, found, strict=True):
            if got is not None:
                counts["agreed_hits"] += 1
                if not same_bytes(got, value(key)):
                    wrong.append(f"step {step}: {kind} of {key}")

    async def checkpoint() -> None:
        await cache.drain()
        dist.barrier(group=checking)  # every rank's copies have landed
        figures = node_check(cache, rank)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, figures, group=checking)
        assert len({f["node"] for f in everyone}) == 1
        # What the ranks hold beyond the node's bytes is what sharing saved.
        counts["shared_bytes"] += sum(f["mine"] for f in everyone) - figures["node"]
        counts["checkpoints"] += 1
        dist.barrier(group=checking)  # nobody changes the node while another looks

    async with cache:
        assert await cache.wait_host_ready(30)
        for step in range(steps):
            roll = shared.random()
            if roll < 0.4:
                key = shared.randrange(KEYS)
                if local.random() < 0.85:  # some ranks do not keep it
                    await cache.put(key, value(key))
            elif roll < 0.5:
                if local.random() < 0.6:
                    cache.discard(local.randrange(KEYS))
            elif roll < 0.75:
                key = shared.randrange(KEYS)
                where = "cpu" if shared.random() < 0.3 else None
                agree(step, f"get {where}", [await cache.get(key, device=where)], [key])
            else:
                keys = [shared.randrange(KEYS) for _ in range(shared.randint(1, 8))]
                agree(step, "get_many", await cache.get_many(keys), keys)
            if local.random() < 0.15:
                await asyncio.sleep(0.002)  # lets this rank's copies land, not the others'
            if step % 25 == 24:
                await checkpoint()
        await checkpoint()
        # Close one rank at a time: each leaves nothing of its own in the node's arena.
        for closing in range(world):
            if closing == rank:
                await cache.close()
            dist.barrier(group=checking)
            if rank > closing:
                held = [r for r in directory_of(cache).records() if r[2] & ((2 << closing) - 1)]
                assert held == [], f"ranks up to {closing} closed and still hold {held}"
    return {**counts, "wrong": wrong, "files_left": node_files(f"random{seed}")}


@pytest.mark.parametrize(("world", "seed"), [(2, 1), (4, 2)])
def test_ranks_share_one_host_copy_of_each_feature_and_agree_on_every_hit(
    tmp_path: Path, world: int, seed: int
) -> None:
    steps = 150 if world == 2 else 80
    reports = run_ranks(tmp_path, world, random_operations, seed, steps)
    for rank, report in reports.items():
        assert report["wrong"] == [], f"rank {rank}"
    assert min(r["agreed_hits"] for r in reports.values()) > 0
    assert len({r["lookups"] for r in reports.values()}) == 1
    # The ranks did share host copies (else the test proves nothing).
    assert reports[0]["checkpoints"] >= 3 and reports[0]["shared_bytes"] > 0
    assert reports[world - 1]["files_left"] == []  # the last to close removed the node
    assert node_files(f"random{seed}") == []


# --- a rank killed between two calls ------------------------------------------------------


def lose_a_rank(rank: int, world: int, control: Any, store: str) -> Report:
    return asyncio.run(_lose_a_rank(rank, control, store))


async def _lose_a_rank(rank: int, control: Any, store: str) -> Report:
    cache = _cache(rank, "lose", gpu_kib=16, host_kib=256)
    await cache.start()
    assert await cache.wait_host_ready(30)
    for key in range(10):
        await cache.put(key, value(key))
    await cache.drain()
    first = await cache.get_many(list(range(10)))
    exact = all(t is not None and same_bytes(t, value(k)) for k, t in enumerate(first))
    if rank == 2:
        control.set()  # the parent kills this process now
        await asyncio.sleep(3600)
    await asyncio.to_thread(control.wait, 60)
    await asyncio.sleep(0.3)  # the kill has landed
    held_by_dead = sum(1 for r in directory_of(cache).records() if r[2] >> 2 & 1)
    started = time.monotonic()
    try:
        await cache.get(1)
        raised = ""
    except GroupError as exc:
        raised = str(exc)
    took = time.monotonic() - started
    # A new group of the survivors (the old one lost a peer for good).
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    # Close in turn: the first to close sweeps the dead rank's references away.
    if rank == 0:
        await cache.close()
    dist.barrier()
    held_after = -1
    if rank == 1:
        held_after = sum(1 for r in directory_of(cache).records() if r[2] & 0b101)
        await cache.close()
    dist.barrier()
    files_after_close = node_files("lose")
    # A new cache of the survivors starts, shares and serves.
    again = _cache(rank, "lose", gpu_kib=16, host_kib=256)
    async with again:
        assert await again.wait_host_ready(30)
        for key in range(10):
            await again.put(key, value(key))
        await again.drain()
        dist.barrier()
        found = await again.get_many(list(range(10)))
        serves = all(t is not None and same_bytes(t, value(k)) for k, t in enumerate(found))
        await again.drain()
        dist.barrier()
        node = node_check(again, rank)
        dist.barrier()
    return {
        "exact": exact,
        "held_by_dead": held_by_dead,
        "raised": raised,
        "took": took,
        "held_after": held_after,
        "files_after_close": files_after_close,
        "serves": serves,
        "node": node,
    }


def test_a_rank_killed_between_two_calls_leaves_the_node_to_the_others(tmp_path: Path) -> None:
    def between(processes: dict[int, Any], control: Any) -> None:
        assert control.wait(60), "rank 2 never got to its first call"
        processes[2].kill()
        processes[2].join(10)

    reports = run_ranks(
        tmp_path,
        3,
        lose_a_rank,
        str(tmp_path / "survivors"),
        timeout_s=PEER_TIMEOUT_S,
        between=between,
        reporting={0, 1},
    )
    for rank, report in reports.items():
        assert report["exact"], f"rank {rank}"
        assert report["held_by_dead"] > 0, "the dead rank held blocks of the node"
        assert "could not agree" in report["raised"]
        assert report["took"] < PEER_TIMEOUT_S + 2
        assert report["serves"]
        assert report["node"]["node"] == report["node"]["mine"]  # the same features, once
    assert reports[1]["held_after"] == 0, "rank 0's close swept the dead rank's blocks"
    assert reports[1]["files_after_close"] == []
    assert node_files("lose") == []


# --- in one process ---------------------------------------------------------------------


def test_a_node_host_tier_without_a_group_is_refused() -> None:
    settings = CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1, host_share="node")
    with pytest.raises(SettingsError, match=r"host_share='node'.*group="):
        FeatureCache(settings, device="sim", registry=CollectorRegistry())


def test_a_node_host_tier_for_a_group_too_large_is_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MMCACHE_HOST_SHARE", "node")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: MAX_RANKS + 1)
    with pytest.raises(SettingsError, match=rf"MMCACHE_HOST_SHARE.*up to {MAX_RANKS} ranks"):
        check_host_share(CacheSettings(), object())


def _node_host(name: str, capacity: int = 64 << 10) -> NodeHost:
    """A rank 0 alone on its node, without a group (its agreement only names the rank)."""
    alone = cast(Agreement, SimpleNamespace(rank=0))
    return NodeHost(name, alone, SimDevice(), capacity, 4096)


def _hold_fallocate(
    monkeypatch: pytest.MonkeyPatch, thread: str
) -> tuple[threading.Event, threading.Event]:
    """(making, go_on): the first posix_fallocate of the thread named thread sets making and
    waits for go_on, as reserving a big arena in /dev/shm takes long."""
    making, go_on = threading.Event(), threading.Event()
    fallocate = os.posix_fallocate

    def slow_fallocate(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == thread and not making.is_set():
            making.set()
            go_on.wait(10)
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow_fallocate)
    return making, go_on


def test_a_sibling_cache_leaves_a_node_segment_being_made_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A's directory exists, sized, its lock held, while its arena is reserved.
    making, go_on = _hold_fallocate(monkeypatch, "maker")
    a, b = _node_host("siblingA"), _node_host("siblingB")
    maker = threading.Thread(target=a._map, args=([_whereabouts(64 << 10)],), name="maker")
    maker.start()
    try:
        assert making.wait(10)
        # B's start sweeps abandoned segments: lockf never refuses this process its own
        # locks, so only knowing A's segment as this process's keeps B's sweep off it.
        b._map([_whereabouts(64 << 10)])
        go_on.set()
        maker.join(10)
        assert len(node_files("siblingA")) == 2, "B removed the segment A was making"
        assert a.directory is not None and a.directory.usage().ranks == (0,)
    finally:
        go_on.set()
        maker.join(10)
        a.close()
        b.close()
    assert node_files("siblingA") == [] and node_files("siblingB") == []


def test_usage_read_while_the_rank_leaves_the_node_is_none_not_an_error() -> None:
    """stats() may run on another thread while close() leaves the node: a thread that read
    the directory just before close() took it away finds it detached, and the usage is
    none, as once the rank has left."""
    host = _node_host("leaving")
    host._map([_whereabouts(64 << 10)])
    stale = host.directory
    assert stale is not None and host.usage() is not None
    host.close()
    host.directory = stale  # what the other thread still holds
    try:
        assert host.usage() is None
    finally:
        host.directory = None
    assert node_files("leaving") == []


@pytest.mark.parametrize("room_for", [0, 1])  # the directory's file, then the arena's
def test_a_full_dev_shm_fails_the_node_tier_at_setup_and_leaves_no_files(
    monkeypatch: pytest.MonkeyPatch, room_for: int
) -> None:
    fallocate = os.posix_fallocate
    calls = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) > room_for:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, length)

    # Unreserved, the arena's pages would be allocated on first touch: a SIGBUS, later.
    monkeypatch.setattr(os, "posix_fallocate", full)
    host = _node_host("fullshm")
    done: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    try:
        host._attach([_whereabouts(64 << 10)], done, lambda arena, nbytes: None)
        with pytest.raises(SharedMemoryFullError, match=r"no room for .*lower cpu_cache_mb"):
            done.result(0)
        assert host.directory is None
        assert node_files("fullshm") == []
    finally:
        host.close()


def test_a_close_during_the_attach_leaves_no_segment_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    making, go_on = _hold_fallocate(monkeypatch, "attach")  # the segment is being made
    host = _node_host("closeearly")
    done: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    arrived: list[int] = []
    attach = threading.Thread(
        target=host._attach,
        args=([_whereabouts(64 << 10)], done, lambda arena, nbytes: arrived.append(nbytes)),
        name="attach",
    )
    attach.start()
    try:
        assert making.wait(10)
        host.close()  # nothing attached yet: the attach thread must leave what it makes
        go_on.set()
        attach.join(10)
        assert node_files("closeearly") == [], "the node's segment outlived the close"
        assert arrived == [] and host.directory is None
        with pytest.raises(CacheClosedError):
            done.result(0)
    finally:
        go_on.set()
        attach.join(10)
        host.close()


def _attach_as_rank_1(name: str, everyone: list[bytes], attached: Any, leave: Any) -> None:
    """Rank 1 of name's node, in a process of its own: attach, say so, stay until told."""
    host = NodeHost(name, cast(Agreement, SimpleNamespace(rank=1)), SimDevice(), 64 << 10, 4096)
    host._map(everyone)
    attached.set()
    leave.wait(60)
    host.close()


def test_a_rank_attaching_as_the_last_one_leaves_keeps_its_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    everyone = [_whereabouts(64 << 10), _whereabouts(64 << 10)]  # one machine, two ranks
    ctx = multiprocessing.get_context("spawn")
    attached, leave = ctx.Event(), ctx.Event()
    rank_1 = ctx.Process(target=_attach_as_rank_1, args=("handover", everyone, attached, leave))
    detach = NodeDirectory.detach

    def detach_then_rank_1_attaches(directory: NodeDirectory, *args: Any) -> bool:
        others = detach(directory, *args)
        rank_1.start()  # rank 1 takes the directory's lock as soon as rank 0 lets it go
        assert attached.wait(60)
        return others

    host = _node_host("handover")
    host._map(everyone)
    monkeypatch.setattr(NodeDirectory, "detach", detach_then_rank_1_attaches)
    try:
        host.close()
        assert len(node_files("handover")) == 2, "rank 0 removed the files rank 1 attached to"
    finally:
        leave.set()
        rank_1.join(60)
    assert rank_1.exitcode == 0
    assert node_files("handover") == []


# --- a close that gives up on a copy still writing the node's arena ----------------------


def close_with_a_copy_in_flight(rank: int, world: int, control: Any) -> Report:
    return asyncio.run(_close_with_a_copy_in_flight(rank))


async def _close_with_a_copy_in_flight(rank: int) -> Report:
    checking = dist.new_group(backend="gloo")
    device = SimDevice()
    settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=64 / 1024, host_share="node")
    cache = FeatureCache(
        settings,
        device=device,
        name="inflight",
        registry=CollectorRegistry(),
        group=dist.group.WORLD,
    )
    await cache.start()
    assert await cache.wait_host_ready(30)
    served = None
    if rank == 0:
        with device.hold():
            await cache.put(0, value(0))  # its copy into the node's arena has not run
            await cache.close(timeout=0.2)  # gives up waiting for it
            dist.barrier(group=checking)  # rank 1 takes room in the node's arena
            dist.barrier(group=checking)
        device.synchronize()  # the copy runs at last
        node = cache._core.host.node
        assert node is not None
        for _ in range(500):  # its landing gives the block back, and the rank leaves
            if node.directory is None:
                break
            await asyncio.sleep(0.01)
        dist.barrier(group=checking)
    else:
        dist.barrier(group=checking)
        assert await cache.put(1, value(1))
        await cache.drain()
        dist.barrier(group=checking)
        dist.barrier(group=checking)
        async with cache.borrow(1) as view:
            assert view is not None
            served = same_bytes(view, value(1))
        await cache.close()
    dist.barrier(group=checking)
    return {"served": served, "files_left": node_files("inflight")}


def test_a_copy_still_running_after_close_never_writes_into_another_ranks_feature(
    tmp_path: Path,
) -> None:
    reports = run_ranks(tmp_path, 2, close_with_a_copy_in_flight)
    assert reports[1]["served"], "rank 0's late copy overwrote rank 1's feature"
    assert reports[1]["files_left"] == []

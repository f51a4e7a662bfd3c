"""Tensor-parallel groups: the ranks of a group agree on every lookup's hits (group=).

Each scenario runs its ranks as real processes (spawn) joined by gloo on loopback, each
with its own cache on the simulator, its own budgets and its own discards. After every
lookup a second group gathers each rank's answer and checks that they are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from ranks import Report, run_ranks, same_bytes, value
from tracebacks import tensors_held_by

from mmcache import CacheSettings, FeatureCache, GroupError, InvalidValueError
from mmcache.agreement import Agreement
from mmcache.device import SimDevice
from mmcache.metrics import CacheMetrics

KiB = 1024
KEYS = 24
#: The group's collective timeout in the scenarios where a peer dies or hangs.
PEER_TIMEOUT_S = 2.0


def _cache(
    rank: int,
    registry: CollectorRegistry,
    group: dist.ProcessGroup | None = None,
    name: str | None = None,
    **settings: Any,
) -> FeatureCache:
    """A rank's cache: its own budgets, and copies slower the higher its rank."""
    settings.setdefault("evict_ahead", 0)
    return FeatureCache(
        CacheSettings(**settings),
        device=SimDevice(latency_s=0.0004 * rank),
        name=f"rank{rank}" if name is None else name,
        registry=registry,
        group=dist.group.WORLD if group is None else group,
    )


def _own_group() -> dist.ProcessGroup:
    """A group of every rank for one scenario (a collective: every rank makes it in turn),
    so that ranks whose calls go out of step there do not take the others' with them."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
    assert isinstance(group, dist.ProcessGroup)
    return group


# --- agreement under random operations --------------------------------------------------


HostShare = Literal["rank", "node"]


def random_operations(
    rank: int,
    world: int,
    control: Any,
    seed: int,
    steps: int,
    on: str = "sim",
    host_share: HostShare = "rank",
) -> Report:
    return asyncio.run(_random_operations(rank, world, seed, steps, on, host_share))


async def _random_operations(
    rank: int, world: int, seed: int, steps: int, on: str, host_share: HostShare
) -> Report:
    """Random calls, the same on every rank, with rank-local puts, discards and (on the
    simulator) failed copies; a gloo group checks every lookup's hits. on: "sim", or
    "cuda" for a cache on the rank's own GPU (its group NCCL)."""
    shared = random.Random(seed)  # the calls every rank makes: same keys, same order
    local = random.Random(seed * 1000 + rank)  # what only this rank does
    checking = dist.new_group(backend="gloo")
    registry = CollectorRegistry()
    # Budgets differ by rank: 24 KiB to 72 KiB of GPU tier, 64 KiB down to 16 KiB of host.
    gpu_mb, host_mb = (24 + 16 * rank) / 1024, (64 - 16 * rank) / 1024
    # A node's host tier is named after the cache: one name on every rank shares it.
    name = f"tp{seed}" if host_share == "node" else f"rank{rank}"
    if on == "sim":
        cache = _cache(
            rank,
            registry,
            name=name,
            gpu_cache_mb=gpu_mb,
            cpu_cache_mb=host_mb,
            host_share=host_share,
        )
        home = torch.device("cpu")  # where the rank's features are made
    else:
        home = torch.device("cuda", rank)
        cache = FeatureCache(
            CacheSettings(
                gpu_cache_mb=gpu_mb, cpu_cache_mb=host_mb, evict_ahead=0, host_share=host_share
            ),
            device=str(home),
            name=name,
            registry=registry,
            group=dist.group.WORLD,
        )
    device = cache.device
    counts = {"lookups": 0, "agreed_hits": 0, "computed": 0, "faults": 0}
    wrong: list[str] = []

    def check(step: int, kind: str, found: list[torch.Tensor | None], keys: list[int]) -> None:
        """Every rank got the same hits, and each hit is exactly its key's feature."""
        hits = tuple(t is not None for t in found)
        mine = (step, kind, tuple(keys), hits)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=checking)
        assert all(other == mine for other in everyone), f"ranks disagree: {everyone}"
        counts["lookups"] += 1
        for key, got in zip(keys, found, strict=True):
            if got is not None:
                counts["agreed_hits"] += 1
                if not same_bytes(got.cpu(), value(key)):
                    wrong.append(f"step {step}: {kind} of {key}")

    async with cache:
        await cache.wait_host_ready(60)
        for step in range(steps):
            roll = shared.random()
            if roll < 0.35:
                key = shared.randrange(KEYS)
                if local.random() < 0.8:  # some ranks do not keep it
                    await cache.put(key, value(key).to(home))
            elif roll < 0.45:
                if local.random() < 0.6:
                    cache.discard(local.randrange(KEYS))
            elif roll < 0.7:
                key = shared.randrange(KEYS)
                where = "cpu" if shared.random() < 0.3 else None
                check(step, f"get {where}", [await cache.get(key, device=where)], [key])
            elif roll < 0.85:
                keys = [shared.randrange(KEYS) for _ in range(shared.randint(1, 8))]
                where = "cpu" if shared.random() < 0.2 else None
                check(step, f"get_many {where}", await cache.get_many(keys, device=where), keys)
            else:
                key = shared.randrange(KEYS)
                ran: list[int] = []

                def compute(key: int = key, ran: list[int] = ran) -> torch.Tensor:
                    ran.append(key)
                    return value(key).to(home)

                got = await cache.get_or_compute(key, compute)
                counts["computed"] += len(ran)
                # fn ran on every rank or on none: shown as a miss (ran) or a hit (did not).
                check(step, "get_or_compute", [None if ran else got], [key])
                if not same_bytes(got.cpu(), value(key)):
                    wrong.append(f"step {step}: get_or_compute of {key}")
            if local.random() < 0.15:
                await asyncio.sleep(0.002)  # lets this rank's copies land, not the others'
            if local.random() < 0.03 and isinstance(device, SimDevice):
                device.inject("copy_fails")
                counts["faults"] += 1
        await cache.drain()
        stats = cache.stats()
        metric = registry.get_sample_value("mmcache_group_misses_total", {"cache": name})
        node = cache._core.host.node
        segment = None if node is None else node._base  # the node's files, where it shares
    return {
        **counts,
        "wrong": wrong,
        "group_misses": stats.group_misses,
        "metric_group_misses": metric,
        "leaked_bytes": stats.leaked_bytes,
        "pending_copies": stats.pending_copies,
        "segment": segment,
    }


#: NCCL needs a GPU a rank: the cases of two ranks run where two GPUs are. A group of one
#: meets nobody (no collective runs): its case checks a cache on the GPU taking an NCCL
#: group, and a group of one answering as a larger one would.
_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
_ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")


@pytest.mark.parametrize(
    ("world", "seed", "on", "host_share"),
    [
        pytest.param(1, 5, "sim", "rank", id="1-sim"),
        pytest.param(2, 1, "sim", "rank", id="2-sim"),
        pytest.param(4, 2, "sim", "rank", id="4-sim"),
        # The agreement's collective on each rank's own GPU (the group's thread on the
        # cache's GPU, not GPU 0); with a node's host tier, its segment agreed through NCCL.
        pytest.param(1, 4, "cuda", "rank", id="1-nccl", marks=_ONE_GPU),
        pytest.param(2, 3, "cuda", "rank", id="2-nccl", marks=_TWO_GPUS),
        pytest.param(2, 3, "cuda", "node", id="2-nccl-node", marks=_TWO_GPUS),
    ],
)
def test_ranks_agree_on_every_hit_under_random_operations(
    tmp_path: Path, world: int, seed: int, on: str, host_share: HostShare
) -> None:
    steps = 90 if world == 4 else 160
    backend = "nccl" if on == "cuda" else "gloo"
    reports = run_ranks(
        tmp_path, world, random_operations, seed, steps, on, host_share, backend=backend
    )
    assert len(reports) == world
    segments = {r["segment"] for r in reports.values()}
    if host_share == "node":  # every rank on the node's one host tier
        assert len(segments) == 1 and None not in segments, segments
    else:
        assert segments == {None}
    for rank, report in reports.items():
        assert report["wrong"] == [], f"rank {rank}"
        assert report["leaked_bytes"] == 0 and report["pending_copies"] == 0, f"rank {rank}"
        assert report["metric_group_misses"] == report["group_misses"], f"rank {rank}"
    assert min(r["agreed_hits"] for r in reports.values()) > 0
    if world > 1:  # the ranks did disagree locally (else the agreement proves nothing)
        assert sum(r["group_misses"] for r in reports.values()) > 0
    else:  # nobody to disagree with: a miss is a local one, never a group miss
        assert reports[0]["group_misses"] == 0
    assert len({r["lookups"] for r in reports.values()}) == 1
    assert len({r["computed"] for r in reports.values()}) == 1


# --- scenarios of two ranks, run in one pair of processes ---------------------------------


def several_scenarios(rank: int, world: int, control: Any) -> Report:
    """Each scenario below in turn, each with caches of its own; a failure is its own."""

    async def all_of_them() -> Report:
        scenarios = {
            "compute": _compute_where_one_rank_misses,
            "compute_cancelled": _compute_whose_caller_is_cancelled,
            "compute_joined": _compute_while_a_computation_runs,
            "hold": _discard_while_agreeing,
            "cancel": _cancel_a_call,
            "other_keys": _other_keys,
            "lazy_start": _lookups_that_start_the_cache,
            "refused": _calls_refused_on_one_rank,
            "borrow": _borrow_where_one_rank_holds_it_on_the_gpu_only,
            "close_pending": _close_while_a_lookup_waits_for_a_rank,
        }
        reports: Report = {}
        for name, scenario in scenarios.items():
            try:
                reports[name] = await scenario(rank)
            except Exception:
                reports[name] = {"error": traceback.format_exc()}
        return reports

    return asyncio.run(all_of_them())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Report]:
    return run_ranks(tmp_path_factory.mktemp("two_ranks"), 2, several_scenarios)


def part(reports: dict[int, Report], name: str) -> dict[int, Report]:
    """Each rank's report of one of several_scenarios (failing with a rank's error)."""
    for rank, report in reports.items():
        assert "error" not in report[name], f"rank {rank}:\n{report[name]['error']}"
    return {rank: report[name] for rank, report in reports.items()}


# --- get_or_compute --------------------------------------------------------------------


async def _compute_where_one_rank_misses(rank: int) -> Report:
    registry = CollectorRegistry()
    ran: list[int] = []

    def compute() -> torch.Tensor:
        ran.append(rank)
        return value(3)

    async with _cache(rank, registry, gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        if rank == 0:
            await cache.put(3, value(3))  # only rank 0 has it
        assert (await cache.get(3) is None) is True  # a miss on both, though rank 0 holds it
        got = await cache.get_or_compute(3, compute)  # so fn runs on both
        ok = same_bytes(got, value(3))
        again = await cache.get_or_compute(3, compute)  # now both hold it: fn runs nowhere
        ok = ok and same_bytes(again, value(3))
        stats = cache.stats()
    return {"ran": ran, "exact": ok, "group_misses": stats.group_misses}


def test_get_or_compute_runs_fn_on_every_rank_where_any_rank_misses(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "compute")
    assert reports[0]["ran"] == [0] and reports[1]["ran"] == [1]
    assert reports[0]["exact"] and reports[1]["exact"]
    assert reports[0]["group_misses"] == 2 and reports[1]["group_misses"] == 0


async def _compute_whose_caller_is_cancelled(rank: int) -> Report:
    ran = asyncio.Event()

    def compute() -> torch.Tensor:
        ran.set()
        return value(4)

    async with _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        if rank == 0:
            calling = asyncio.create_task(cache.get_or_compute(4, compute))
            await asyncio.sleep(0.1)  # its agreement waits for rank 1
            calling.cancel()  # the request was aborted: the agreement still meets (a miss)
            with contextlib.suppress(asyncio.CancelledError):
                await calling
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ran.wait(), 3)
        else:
            await asyncio.sleep(0.3)
            await cache.get_or_compute(4, compute)
        for _ in range(100):  # the computation's put lands
            if 4 in cache:
                break
            await asyncio.sleep(0.01)
        held = 4 in cache
    return {"ran": ran.is_set(), "held": held}


def test_get_or_compute_runs_fn_on_every_rank_though_a_caller_is_cancelled(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "compute_cancelled")
    assert reports[0] == reports[1] == {"ran": True, "held": True}


async def _compute_while_a_computation_runs(rank: int) -> Report:
    ran: list[int] = []

    async def compute() -> torch.Tensor:
        ran.append(rank)
        await asyncio.sleep(1.0 if rank == 0 else 0)  # rank 0's is still running at call 2
        return value(6)

    async with _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        first = asyncio.create_task(cache.get_or_compute(6, compute))
        if rank == 0:
            await asyncio.sleep(0.2)
        else:
            await asyncio.wait([first])  # rank 1 holds 6 before it makes call 2
        second = asyncio.create_task(cache.get_or_compute(6, compute))
        got = await asyncio.gather(first, second)
        exact = all(same_bytes(t, value(6)) for t in got)
        stats = cache.stats()
    return {"ran": ran, "exact": exact, "group_misses": stats.group_misses}


def test_get_or_compute_joins_a_running_computation_on_every_rank_or_on_none(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "compute_joined")
    # Call 2: rank 0 still computes 6, rank 1 holds it: both count it a hit, fn runs nowhere.
    assert reports[0]["ran"] == [0] and reports[1]["ran"] == [1]
    assert reports[0]["exact"] and reports[1]["exact"]
    assert reports[0]["group_misses"] == reports[1]["group_misses"] == 0


# --- what a rank hit is held until it is served --------------------------------------------


async def _discard_while_agreeing(rank: int) -> Report:
    async with _cache(rank, CollectorRegistry(), gpu_cache_mb=48 / 1024, cpu_cache_mb=0) as cache:
        await cache.put(5, value(5))
        if rank == 1:
            await asyncio.sleep(0.3)  # rank 0 waits for this rank's answer meanwhile
            got = await cache.get(5)
        else:
            reading = asyncio.create_task(cache.get(5))
            await asyncio.sleep(0.1)  # its local read is done: it waits for rank 1
            assert cache.discard(5)  # released, and its memory handed to other features
            for key in (6, 7, 8, 9):
                await cache.put(key, value(key))
            got = await reading
        exact = got is not None and same_bytes(got, value(5))
        stats = cache.stats()
    return {"exact": exact, "leaked": stats.leaked_bytes}


def test_a_hit_is_held_until_served_though_discarded_while_the_ranks_agree(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "hold")
    assert reports[0]["exact"] and reports[1]["exact"]
    assert reports[0]["leaked"] == 0 and reports[1]["leaked"] == 0


# --- a call whose caller is cancelled ------------------------------------------------------


async def _cancel_a_call(rank: int) -> Report:
    async with _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        for key in (1, 2, 3):
            await cache.put(key, value(key))
        if rank == 0:
            first = asyncio.create_task(cache.get(1))
            second = asyncio.create_task(cache.get(2))  # made after the first: its turn is next
            await asyncio.sleep(0)  # both calls are made; the second waits for the first
            second.cancel()
            got = [await first]
            cancelled = False
            try:
                await second
            except asyncio.CancelledError:
                cancelled = True
        else:
            await asyncio.sleep(0.3)
            got = [await cache.get(1), await cache.get(2)]
            cancelled = True
        got.append(await cache.get(3))  # the ranks still pair their calls: 3 with 3
        exact = all(
            t is not None and same_bytes(t, value(k))
            for k, t in zip((1, 3) if rank == 0 else (1, 2, 3), got, strict=True)
        )
    return {"exact": exact, "cancelled": cancelled}


def test_a_call_whose_caller_is_cancelled_still_meets_the_other_ranks(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "cancel")
    assert reports[0]["cancelled"] and reports[0]["exact"] and reports[1]["exact"]


# --- ranks that call with other keys -----------------------------------------------------


async def _other_keys(rank: int) -> Report:
    errors: list[str] = []
    async with _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        await cache.put(1, value(1))
        for keys in ([1, 2 + rank], [1] * (1 + rank), list(range(300 + rank))):
            try:
                await cache.get_many(keys)
            except GroupError as exc:
                errors.append(str(exc))
        # Every rank raised at the same call: the next one, with the same keys, is served.
        got = await cache.get(1)
        exact = got is not None and same_bytes(got, value(1))
    return {"errors": errors, "exact": exact}


def test_ranks_calling_with_other_keys_all_get_a_clear_error(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "other_keys")
    for report in reports.values():
        assert len(report["errors"]) == 3 and report["exact"]
        assert "different keys" in report["errors"][0]
        assert "different numbers of keys" in report["errors"][1]
        assert "different numbers of keys" in report["errors"][2]  # 300 and 301: two rounds


async def _lookups_that_start_the_cache(rank: int) -> Report:
    cache = _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1)
    if rank == 1:
        await cache.start()  # rank 0's first lookup starts its cache

    async def lookup(keys: list[int]) -> str:
        try:
            return repr(await cache.get_many(keys))
        except GroupError as exc:
            return str(exc)

    # Made in this order on both ranks: rank 0's second must not overtake its first.
    answers = await asyncio.gather(lookup([1]), lookup([2, 3]), lookup([4]))
    await cache.close()
    return {"answers": answers}


def test_lookups_keep_their_order_though_the_first_starts_the_cache(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "lazy_start")
    for report in reports.values():
        assert report["answers"] == ["[None]", "[None, None]", "[None]"]


async def _calls_refused_on_one_rank(rank: int) -> Report:
    errors: list[str] = []
    group = _own_group()
    async with _cache(rank, CollectorRegistry(), group, gpu_cache_mb=1, cpu_cache_mb=1) as cache:
        await cache.put(1, value(1))
        unhashable: Any = [1]
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: cache.get(1.5 if rank == 0 else 2),  # a key rank 0 refuses
            lambda: cache.get_many([1, 2], device="meta" if rank == 1 else None),
            lambda: cache.get_or_compute(unhashable if rank == 1 else 1, lambda: value(1)),
        ]
        for call in calls:
            try:
                await call()
                errors.append("")
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        got = await cache.get(1)  # the ranks' calls still pair: 1 with 1
        exact = got is not None and same_bytes(got, value(1))
    return {"errors": errors, "exact": exact}


def test_a_call_refused_on_one_rank_fails_on_every_rank_and_later_calls_pair(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "refused")
    refused_by = (0, 1, 1)
    for i, refusing in enumerate(refused_by):
        mine, other = reports[refusing]["errors"][i], reports[1 - refusing]["errors"][i]
        assert mine.startswith(("InvalidKeyError", "InvalidValueError")), mine
        assert other.startswith("GroupError") and "refused on another rank" in other, other
    assert reports[0]["exact"] and reports[1]["exact"]


# --- local calls ----------------------------------------------------------------------------


async def _borrow_where_one_rank_holds_it_on_the_gpu_only(rank: int) -> Report:
    group = _own_group()
    # Rank 0 keeps its features on the host (no GPU tier), rank 1 on the GPU.
    gpu_mb = 0 if rank == 0 else 1
    registry = CollectorRegistry()
    async with _cache(rank, registry, group, gpu_cache_mb=gpu_mb, cpu_cache_mb=1) as cache:
        for key in (1, 2):
            await cache.put(key, value(key))
        await cache.drain()
        async with cache.borrow(1) as view:  # local: a view (rank 0) or a host copy (rank 1)
            borrowed = view is not None and same_bytes(view, value(1))
        try:
            got = {key: await cache.get(key) for key in (2, 1)}  # the ranks' calls still pair
            exact = all(t is not None and same_bytes(t, value(k)) for k, t in got.items())
            raised = ""
        except GroupError as exc:
            exact, raised = False, str(exc)
    return {"borrowed": borrowed, "exact": exact, "raised": raised}


def test_borrow_is_local_with_a_group(two_ranks: dict[int, Report]) -> None:
    reports = part(two_ranks, "borrow")
    for report in reports.values():
        assert report == {"borrowed": True, "exact": True, "raised": ""}


# --- close ---------------------------------------------------------------------------------


async def _close_while_a_lookup_waits_for_a_rank(rank: int) -> Report:
    group = _own_group()
    cache = _cache(rank, CollectorRegistry(), group, gpu_cache_mb=1, cpu_cache_mb=1)
    await cache.start()
    await cache.put(1, value(1))
    got = ""
    if rank == 0:
        waiting = asyncio.create_task(cache.get(1))
        await asyncio.sleep(0.2)  # it waits for rank 1
        await cache.close()
        try:
            await waiting
        except BaseException as exc:  # CancelledError included: what its caller is handed
            got = type(exc).__name__
        else:
            got = "served"
    else:
        await asyncio.sleep(0.5)  # then answers rank 0's collective, which went on
        await cache.get(1)
        await cache.close()
    await asyncio.to_thread(dist.barrier)  # rank 0 stays until rank 1's get has met it
    return {"got": got}


def test_close_fails_a_lookup_waiting_for_the_other_ranks_with_cache_closed_error(
    two_ranks: dict[int, Report],
) -> None:
    reports = part(two_ranks, "close_pending")
    assert reports[0]["got"] == "CacheClosedError"  # not CancelledError: it was not cancelled


# --- a peer that dies or hangs -----------------------------------------------------------


def lose_a_peer(rank: int, world: int, control: Any, how: str) -> Report:
    return asyncio.run(_lose_a_peer(rank, control, how))


async def _lose_a_peer(rank: int, control: Any, how: str) -> Report:
    cache = _cache(rank, CollectorRegistry(), gpu_cache_mb=1, cpu_cache_mb=1)
    await cache.start()
    await cache.put(1, value(1))
    first = await cache.get(1) is not None
    if rank == 1:
        control.set()  # the parent kills this process now, or it just stops calling
        await asyncio.sleep(3600)
    await asyncio.to_thread(control.wait, 60)
    await asyncio.sleep(0.2)  # the kill has landed
    started = time.monotonic()
    held: list[str] = []
    try:
        await cache.get(1)
        raised = ""
    except GroupError as exc:
        raised = str(exc)
        held = tensors_held_by(exc)
    took = time.monotonic() - started
    try:
        await cache.get_many([1])
        again = ""
    except GroupError as exc:
        again = str(exc)
    again_took = time.monotonic() - started - took
    closing = time.monotonic()
    await cache.close()
    return {
        "first_hit": first,
        "held": held,
        "raised": raised,
        "took": took,
        "again": again,
        "again_took": again_took,
        "close_took": time.monotonic() - closing,
    }


@pytest.mark.parametrize("how", ["killed", "stuck"])
def test_a_peer_that_dies_or_hangs_is_an_error_within_the_timeout(tmp_path: Path, how: str) -> None:
    def between(processes: dict[int, Any], control: Any) -> None:
        assert control.wait(60), "rank 1 never got to its first call"
        if how == "killed":
            processes[1].kill()
            processes[1].join(10)
        # stuck: rank 1 sleeps, alive, and makes no further call

    reports = run_ranks(
        tmp_path, 2, lose_a_peer, how, timeout_s=PEER_TIMEOUT_S, between=between, reporting={0}
    )
    report = reports[0]
    assert report["first_hit"]
    assert "could not agree" in report["raised"]
    assert report["held"] == []  # the error keeps no hit it read alive
    assert "rank 0 of a gloo group of 2" in report["raised"]
    assert report["took"] < PEER_TIMEOUT_S + 2
    if how == "stuck":
        assert report["took"] > PEER_TIMEOUT_S - 0.5  # it did wait for the peer, for its timeout
    assert "failed earlier" in report["again"] and report["again_took"] < 0.5
    assert report["close_took"] < 5


# --- in one process -----------------------------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store1'}", rank=0, world_size=1
    )
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("group", [object(), "gloo", 1])
def test_a_group_that_is_not_a_process_group_is_refused(group: Any) -> None:
    with pytest.raises(InvalidValueError, match="ProcessGroup"):
        FeatureCache(device="sim", registry=CollectorRegistry(), group=group)


async def test_a_group_of_one_serves_as_without_a_group(world_of_one: dist.ProcessGroup) -> None:
    settings = CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1)
    async with FeatureCache(
        settings, device="sim", registry=CollectorRegistry(), group=world_of_one
    ) as cache:
        assert cache.group is world_of_one
        await cache.put(1, value(1))
        got = await cache.get(1)
        assert got is not None and same_bytes(got, value(1))
        both = await cache.get_many([1, 2])
        assert both[0] is not None and same_bytes(both[0], value(1)) and both[1] is None
        assert cache.stats().group_misses == 0


async def test_touch_refreshes_recency_without_a_read(sim_rig: Any) -> None:
    settings = CacheSettings(gpu_cache_mb=16 / 1024, cpu_cache_mb=0, evict_ahead=0)
    async with FeatureCache(settings, device=sim_rig.device, registry=CollectorRegistry()) as cache:
        for key in (1, 2):
            await cache.put(key, torch.randn(8, 256))  # 8 KiB each
        before = cache.stats()
        assert cache.touch(1) and not cache.touch(3)
        assert cache.stats().hits_gpu == before.hits_gpu  # not counted as a read
        await cache.put(4, torch.randn(8, 256))  # evicts the least recently used: 2
        assert 1 in cache and 2 not in cache


async def _on_the_group_thread(group: dist.ProcessGroup, gpu: int) -> str:
    """The name of the thread that an agreement on GPU gpu runs its collectives on (a job
    queued as an NCCL rank's would be)."""
    agreement = Agreement(
        group, cache_name="tp", device_name="cpu", metrics=CacheMetrics("tp", CollectorRegistry())
    )
    agreement._on = torch.device("cuda", gpu)  # as an NCCL group's rank on that GPU has it
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str] = loop.create_future()
    agreement._queue(lambda: threading.current_thread().name, done, loop)
    try:
        return await asyncio.wait_for(done, 10)
    finally:
        await agreement.close()


async def test_the_group_thread_runs_on_the_caches_gpu(
    world_of_one: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NCCL group's collectives run on the cache's GPU, not on the thread's default
    (GPU 0): torch's object collectives take the calling thread's current GPU."""
    chosen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: chosen.append((threading.current_thread().name, torch.device(device))),
    )
    thread = await _on_the_group_thread(world_of_one, 1)
    assert chosen == [(thread, torch.device("cuda", 1))]


async def test_a_group_thread_that_cannot_use_the_gpu_fails_each_call_at_once(
    world_of_one: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a timeout later, as a stuck peer would: the call raises the GPU's error."""

    def refuse(device: object) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        await _on_the_group_thread(world_of_one, 7)
    assert time.monotonic() - started < 5

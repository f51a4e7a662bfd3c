"""Ranks of a torch.distributed group as real processes (spawn), joined by gloo on loopback
(or by NCCL, a GPU a rank): run_ranks runs a scenario on each and returns their reports (the
tensor-parallel group tests' and the SGLang adapter's)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Report = dict[str, Any]


def value(key: int) -> torch.Tensor:
    """The feature of key: the same bytes on every rank, 2 to 12 KiB."""
    g = torch.Generator().manual_seed(1000 + key)
    return torch.randn(2 + key % 11, 256, generator=g)


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether got holds exactly want's bytes, dtype and shape."""
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    )


def _rank_main(
    scenario: Callable[..., Report],
    rank: int,
    world: int,
    store_path: str,
    timeout_s: float,
    outbox: Any,
    args: tuple[Any, ...],
    backend: str,
) -> None:
    """One rank's process: join the group, run the scenario, report (or its error)."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU a rank
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        report = scenario(rank, world, *args)
    except BaseException:
        report = {"error": traceback.format_exc()}
    outbox.put((rank, report))
    outbox.close()
    outbox.join_thread()
    os._exit(0)  # no teardown of a group whose peers may be gone


def run_ranks(
    tmp_path: Path,
    world: int,
    scenario: Callable[..., Report],
    *args: Any,
    timeout_s: float = 30.0,
    between: Callable[[dict[int, Any], Any], None] | None = None,
    reporting: set[int] | None = None,
    backend: str = "gloo",
) -> dict[int, Report]:
    """Run scenario(rank, world, *args) on world spawned ranks; their reports by rank.
    backend "nccl" puts rank r on GPU r.

    between(processes, control), if given, runs in the parent while the ranks run; only
    the ranks in reporting (default: all) are waited for, the others are killed after.
    """
    expected = set(range(world)) if reporting is None else reporting
    ctx = multiprocessing.get_context("spawn")
    outbox = ctx.Queue()
    control = ctx.Event()
    store = str(tmp_path / "store")
    processes = {
        rank: ctx.Process(
            target=_rank_main,
            args=(scenario, rank, world, store, timeout_s, outbox, (control, *args), backend),
            daemon=True,
        )
        for rank in range(world)
    }
    for process in processes.values():
        process.start()
    reports: dict[int, Report] = {}
    try:
        if between is not None:
            between(processes, control)
        deadline = time.monotonic() + 90
        while not expected <= set(reports) and time.monotonic() < deadline:
            if any(not processes[r].is_alive() for r in expected - set(reports)):
                time.sleep(0.5)  # its report may still be in the pipe
                if outbox.empty():
                    break
            try:
                rank, report = outbox.get(timeout=0.5)
            except Exception:
                continue
            reports[rank] = report
    finally:
        for rank, process in processes.items():
            if rank in reports:
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    assert expected <= set(reports), f"no report from ranks {sorted(expected - set(reports))}"
    for rank, report in reports.items():
        assert "error" not in report, f"rank {rank}:\n{report['error']}"
    return reports

"""A bounded soak on the simulator: thousands of concurrent operations with holds,
cancellations and injected faults; every read exact, memory flat, nothing leaked.

The soak itself is tests/soak.py (run it longer, or on a GPU, from the command line).
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
from soak import SoakConfig, SoakReport, run_soak

MAX_RSS_GROWTH_MIB = 48.0  # values in flight reach ~15 MiB; a leak of every op would be GBs


pytestmark = pytest.mark.usefixtures("no_collection_during_reports")


async def soak(config: SoakConfig) -> SoakReport:
    """run_soak with the cyclic garbage collector on, as in a server: the fixture keeps it
    off around the test, and the cycles of thousands of cancelled operations, left to
    pile up for the whole run, would read as RSS growth."""
    gc.enable()
    try:
        return await run_soak(config)
    finally:
        gc.disable()


def summary(report: SoakReport) -> str:
    lines = [f"{name}: {value}" for name, value in report.rows()]
    lines += [f"mismatch: {m}" for m in report.mismatch_examples]
    lines += [f"error: {e}" for e in report.errors[:10]]
    return "\n".join(lines)


def assert_sound(report: SoakReport) -> None:
    text = summary(report)
    assert report.mismatches == 0, text
    assert not report.errors, text
    assert report.budget_violations == 0, text
    assert report.max_leaked_bytes_in_flight == 0, text
    assert report.leaked_bytes == 0, text
    assert report.pending_copies_after_drain == 0, text
    assert report.device_bytes == report.gpu_entry_bytes, text
    assert report.rss_samples >= 10, text
    assert report.rss_max_growth_mib < MAX_RSS_GROWTH_MIB, text
    assert report.entries_retained == 0, text  # nothing (a timer, a callback) outlives its entry


async def test_soak_with_holds_cancellations_and_failed_allocations() -> None:
    report = await soak(SoakConfig(seconds=25, warmup_s=6, faults=("alloc_fails",), seed=7))
    assert_sound(report)
    # It did what it claims: a real load, with every adversary at work.
    text = summary(report)
    assert report.total_ops >= 10_000, text
    assert report.reads_checked >= 2_000, text
    assert report.cancelled >= 100 and report.holds >= 20, text
    assert report.faults_fired >= 50, text
    # Each fault fails its operation; one in a turn's shared upload fails each get of it.
    assert report.expected_errors["DeviceOutOfMemoryError"] >= report.faults_fired, text
    s = report.stats
    assert s["evictions_gpu"] > 1_000 and s["evictions_cpu"] > 100, text
    # Host hits race evictions all along; how many are promoted is the policy's and the
    # load's (never past waiting puts, and only over colder GPU entries: a faster machine
    # keeps more puts waiting), so none is required here (test_promotion, test_admission
    # and the state machine exercise promotion).
    assert s["hits_cpu"] > 1_000, text
    assert report.model_versions < 5_000, text  # the checker's own memory stays flat too


async def test_soak_with_failed_copies_too() -> None:
    report = await soak(
        SoakConfig(
            seconds=12,
            warmup_s=4,
            faults=("copy_fails", "alloc_fails"),
            fault_rate_hz=80,
            seed=11,
        )
    )
    assert_sound(report)
    assert report.expected_errors["CopyFailedError"] > 0, summary(report)


def test_the_soak_runs_as_a_script_from_any_directory(tmp_path: Path) -> None:
    """benchmarks/gpu_suite.sh runs it as `python3 tests/soak.py`: it finds mmcache and the
    benchmarks' helpers by its own path."""
    script = Path(__file__).resolve().parents[1] / "soak.py"
    done = subprocess.run(
        [sys.executable, str(script), "--seconds", "1", "--warmup", "0.2", "--workers", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "| verdict | PASS |" in done.stdout

"""The benchmark scripts run on a machine without a GPU: the simulator columns, or a clean exit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: script -> arguments for a short run without a GPU
RUNS: dict[str, list[str]] = {
    "bench_host_pool.py": ["--quick"],
    "bench_host_reads.py": ["--device", "sim", "--quick", "--gap-ms", "1"],
    "bench_ipc.py": ["--device", "sim", "--quick"],
    "bench_offload.py": ["--device", "sim"],
    "bench_ops.py": ["--quick"],
    "bench_remote.py": ["--device", "sim", "--quick"],  # without redis-server: says so, exits 0
    "gpu_probe.py": ["--quick"],  # CUDA only: says so and exits 0
}


def _run(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *RUNS[name], *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=BENCHMARKS.parent,
    )


@pytest.mark.parametrize("name", sorted(RUNS))
def test_benchmark_runs_without_a_gpu(name: str) -> None:
    done = _run(name)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def test_bench_offload_reports_exact_reads_and_no_leaks_on_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    done = _run("bench_offload.py", "--out", str(out), "--loop-cores", "fast")
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    speeds = {int(core): us for core, us in results["cores"]["speeds"].items()}
    pinned = results["cores"]["pinned_to"]
    assert pinned and set(pinned) <= set(speeds)
    assert min(speeds, key=lambda core: speeds[core]) in pinned
    assert all(speeds[core] <= 1.15 * min(speeds.values()) for core in pinned)
    assert set(results["cores"]["loop_ran_on"]) - {-1} <= set(pinned)  # -1: core unknown
    assert f"pinned to cores {', '.join(map(str, pinned))}" in done.stdout
    assert results["gc_frozen_objects"] > 0
    assert f"garbage collector: {results['gc_frozen_objects']:,} objects" in done.stdout
    for name, row in results["sizes"].items():
        assert row["burst_features"] == max(1, (8 << 20) // row["feature_bytes"]), name
        mmcache = row["mmcache"]
        assert mmcache["gets"]["exact"], name
        assert mmcache["stats"]["leaked_bytes"] == 0, name
        assert mmcache["offload"]["dropped"] == 0, name
        assert mmcache["offload"]["gbps"] > 0, name
        if (8 << 20) // row["feature_bytes"] > 1:  # put_many groups of 8 MiB hold several
            assert mmcache["offload_many"]["gbps"] > 0, name
            assert mmcache["offload_many"]["dropped"] == 0, name


def test_bench_offload_can_leave_gc_alone_and_yield_after_every_feature(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    done = _run(
        "bench_offload.py", "--out", str(out), "--rounds", "1", "--no-gc-freeze", "--burst-mb", "0"
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results["gc_frozen_objects"] == 0
    assert "garbage collector: nothing frozen (--no-gc-freeze)" in done.stdout
    assert {row["burst_features"] for row in results["sizes"].values()} == {1}


async def test_the_offload_producer_yields_after_each_burst_of_features() -> None:
    """The benchmark's producer loop hands over a burst, then lets the loop run others."""
    sys.path.insert(0, str(BENCHMARKS))
    from _common import put_in_groups

    order: list[object] = []

    class Recorder:
        async def put(self, key: int, value: object) -> bool:
            order.append(key)
            return True

        async def put_many(self, items: list[tuple[int, object]]) -> bool:
            order.extend(key for key, _ in items)
            return True

    async def other_work() -> None:
        while True:
            order.append("loop")
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    order.clear()
    features: list[object] = list(range(12))
    await put_in_groups(Recorder(), features, 1, burst=4)  # type: ignore[arg-type]
    assert order[:14] == [0, 1, 2, 3, "loop", 4, 5, 6, 7, "loop", 8, 9, 10, 11]
    order.clear()
    await put_in_groups(Recorder(), list(range(8)), 2, burst=4)  # type: ignore[arg-type]
    assert order[:9] == [0, 1, 2, 3, "loop", 4, 5, 6, 7]
    other.cancel()

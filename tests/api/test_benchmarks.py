"""The benchmark scripts run on a machine without a GPU: the simulator columns, or a clean exit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_runs import ChildRuns, selected_tests
from conftest import without_a_gpu

from mmcache import FeatureCache

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

#: script -> arguments for a short run without a GPU
RUNS: dict[str, list[str]] = {
    "bench_adapters.py": ["--device", "sim", "--quick"],
    "bench_cold_start.py": ["--device", "sim", "--quick", "--size", "64KB"],
    "bench_groups.py": ["--quick"],  # TP 2 over gloo on loopback
    "bench_host_pool.py": ["--quick"],
    "bench_host_reads.py": ["--device", "sim", "--quick", "--gap-ms", "1"],
    "bench_node_host.py": ["--quick"],  # TP 2 over gloo on loopback, host_share both ways
    "bench_ipc.py": ["--device", "sim", "--quick"],
    "bench_offload.py": ["--device", "sim"],
    "bench_ops.py": ["--quick"],
    "bench_policy.py": ["--quick"],
    "bench_serving.py": ["--device", "sim", "--quick", "--sizes", "64KB", "--seconds", "0.3"],
    "bench_remote.py": ["--device", "sim", "--quick"],  # without redis-server: says so, exits 0
    "gpu_probe.py": ["--quick"],  # CUDA only: says so and exits 0
    "profile_ops.py": ["--features", "64", "--gpu-features", "8", "--top", "5"],
}


#: The adapter benchmark with SGLang hidden, as on a GPU machine for figures only.
_HIDE_SGLANG = (
    "import runpy, sys; sys.modules['sglang'] = None; "
    "sys.argv = ['bench_adapters.py', *{args!r}]; "
    "runpy.run_path('benchmarks/bench_adapters.py', run_name='__main__')"
)

#: The module's other child runs: test -> (run key, script, arguments after RUNS'); OUT
#: stands for the run's own JSON file.
_TEST_RUNS: dict[str, tuple[str, str, list[str]]] = {
    "test_bench_ipc_measures_every_path_exact_on_the_simulator": (
        "ipc",
        "bench_ipc.py",
        ["--out", "OUT"],
    ),
    "test_bench_offload_can_leave_gc_alone_and_yield_after_every_feature": (
        "offload-gc-alone",
        "bench_offload.py",
        ["--out", "OUT", "--rounds", "1", "--no-gc-freeze", "--burst-mb", "0"],
    ),
    "test_bench_cold_start_serves_while_the_arena_pins": (
        # 1 MB features: a 440 MiB arena, 55 simulated chunks of 2.5 ms, so at least
        # 0.14 s of pinning; the first window closes before it can end.
        "cold-start",
        "bench_cold_start.py",
        ["--size", "1MB", "--windows", "0.1", "0.4", "--rounds", "1", "--out", "OUT"],
    ),
    "test_bench_serving_reports_every_design_exact_on_the_simulator": (
        "serving",
        "bench_serving.py",
        ["--out", "OUT", "--op-calls", "100"],
    ),
    "test_bench_serving_alternates_rounds_and_reports_each_designs_median": (
        "serving-rounds",
        "bench_serving.py",
        ["--out", "OUT", "--op-calls", "0", "--rounds", "3"],
    ),
}
#: Runs each test starts itself: figures a busy host would spoil, or a quick refusal.
_ALONE = {
    "serving-no-rounds": [
        str(BENCHMARKS / "bench_serving.py"),
        *RUNS["bench_serving.py"],
        "--rounds",
        "0",
    ],
    # bench_offload --loop-cores fast keeps to the cores it timed fastest.
    "offload-fast-cores": [
        str(BENCHMARKS / "bench_offload.py"),
        *RUNS["bench_offload.py"],
        "--out",
        "OUT",
        "--loop-cores",
        "fast",
    ],
}


class Children:
    """This module's benchmark runs, every GPU hidden (on a GPU host too: the scripts' CUDA
    runs are gpu_suite.sh's), from the repository root; each writes its JSON to out(key)."""

    def __init__(self, out_dir: Path) -> None:
        self._out_dir = out_dir
        runs: dict[str, list[str]] = {name: [str(BENCHMARKS / name), *RUNS[name]] for name in RUNS}
        for key, script, extra in _TEST_RUNS.values():
            runs[key] = [str(BENCHMARKS / script), *RUNS[script], *extra]
        runs.update(_ALONE)
        adapters = [*RUNS["bench_adapters.py"], "--out", "OUT"]
        runs["adapters-without-sglang"] = ["-c", _HIDE_SGLANG.format(args=adapters)]
        out = {key: [self._swap_out(key, arg) for arg in argv] for key, argv in runs.items()}
        self.runs = ChildRuns(out, cwd=BENCHMARKS.parent, timeout=120, env=without_a_gpu())

    def _swap_out(self, key: str, arg: str) -> str:
        if arg == "OUT":
            return str(self.out(key))
        return arg.replace("'OUT'", repr(str(self.out(key))))

    def out(self, key: str) -> Path:
        return self._out_dir / f"{key}.json"

    def result(self, key: str) -> subprocess.CompletedProcess[str]:
        return self.runs.result(key, alone=key in _ALONE)


@pytest.fixture(scope="module")
def children(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Children]:
    """The runs of the module's selected tests, started side by side from the first (where
    the host has cores to spare: tests/child_runs.py)."""
    made = Children(tmp_path_factory.mktemp("benchmarks"))
    keys: list[str] = []
    for item in selected_tests(request):
        if item.originalname == "test_benchmark_runs_without_a_gpu":
            keys.append(str(item.callspec.params["name"]))
        elif item.originalname in _TEST_RUNS:
            keys.append(_TEST_RUNS[item.originalname][0])
        elif (
            item.originalname == "test_bench_adapters_times_the_caches_thread_calls_without_sglang"
        ):
            keys.append("adapters-without-sglang")
    made.runs.start(keys)
    yield made
    made.runs.close()


@pytest.mark.parametrize("name", sorted(set(RUNS) - {"bench_ipc.py"}))  # its own test below
def test_benchmark_runs_without_a_gpu(name: str, children: Children) -> None:
    done = children.result(name)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def test_bench_adapters_times_the_caches_thread_calls_without_sglang(children: Children) -> None:
    """Where SGLang is not installed (a GPU machine for figures only), the thread path's
    rows are still timed, on a loop thread of the adapter's kind."""
    done = children.result("adapters-without-sglang")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(children.out("adapters-without-sglang").read_text())
    assert results["adapter"] is False
    assert set(results["results"]) == {
        "round trip (trivial coroutine)",
        "FeatureCache.get_resident_threadsafe GPU hit",
        "FeatureCache.get_threadsafe GPU hit",
        "FeatureCache.get on the loop, GPU hit, handed off",
        "FeatureCache.get_threadsafe miss",
        "FeatureCache.get_resident_threadsafe GPU hit, again",
    }
    assert all(row["p50_us"] > 0 for row in results["results"].values())
    assert "FeatureCache on sim" in done.stdout
    assert "declined" not in done.stdout  # every resident read was served on the simulator


def test_bench_ipc_measures_every_path_exact_on_the_simulator(children: Children) -> None:
    done = children.result("ipc")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(children.out("ipc").read_text())
    paths = ("pool receive", "pool lease", "fallback", "torch.mp queue")
    rows = {(row["path"], row["size"], row["batch"]): row for row in results["rows"]}
    assert set(rows) == {(p, s, b) for p in paths for s in ("64KB", "1MB", "8MB") for b in (1, 16)}
    for key, row in rows.items():
        assert row["wrong"] == 0 and row["features_per_s"] > 0, key
        assert row["features"] % 16 == 0, key
        if row["path"] != "torch.mp queue":
            assert row["leaked_bytes"] == 0, key
        if row["path"] == "fallback":
            assert row["fallbacks"] == row["sends"] == row["features"] // row["batch"], key
    assert [r["path"] for r in results["latency"]] == list(paths)
    assert all(r["p50_us"] > 0 for r in results["latency"])
    steady = results["steady"]
    assert steady["sends"] > 0 and 0 <= steady["pool_full_share"] <= 1
    assert steady["wrong"] == 0 and steady["leaked_bytes"] == 0
    for path in paths:
        assert f"| {path} | 8MB | 16 |" in done.stdout
    assert "Steady stream:" in done.stdout


def test_bench_offload_reports_exact_reads_and_no_leaks_on_the_simulator(
    children: Children,
) -> None:
    done = children.result("offload-fast-cores")  # alone: it times the cores
    assert done.returncode == 0, done.stderr
    results = json.loads(children.out("offload-fast-cores").read_text())
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


def test_bench_offload_can_leave_gc_alone_and_yield_after_every_feature(
    children: Children,
) -> None:
    done = children.result("offload-gc-alone")
    assert done.returncode == 0, done.stderr
    results = json.loads(children.out("offload-gc-alone").read_text())
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


def _serving() -> Any:
    """The bench_serving module, imported from the checkout's benchmarks."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_serving

    return bench_serving


def test_bench_cold_start_serves_while_the_arena_pins(children: Children) -> None:
    done = children.result("cold-start")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(children.out("cold-start").read_text())
    assert results["wrong_values"] == 0 and results["leaked_bytes"] == 0
    assert set(results["runs"]) == {"SGLang-style (non_blocking + event)", "mmcache get"}
    for name, runs in results["runs"].items():
        (run,) = runs
        assert all(rate > 0 for rate in run["requests_per_s"]), name
    (mm,) = results["runs"]["mmcache get"]
    # Pinned in part at the first window's end; whole (if within the run) after 0.1 s at least.
    assert mm["pinned_fraction"][0] < 1.0
    assert mm["arena_pinned_s"] is None or mm["arena_pinned_s"] > 0.1
    assert "mmcache ÷ SGLang-style" in done.stdout


def test_cold_start_windows_count_each_request_once() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_cold_start

    times = [0.0, 0.2, 0.49, 0.5, 1.2, 2.5]
    assert bench_cold_start.per_window(times, [0.5, 1.0, 2.0]) == [6.0, 2.0, 1.0]


def _small_serving_config() -> Any:
    serving = _serving()
    return serving.Config(
        device="sim",
        sizes=("64KB",),
        concurrency=8,
        catalogue=32,
        seconds=0.2,
        warmup_s=0.1,
        op_calls=60,
    )


def test_bench_serving_reports_every_design_exact_on_the_simulator(children: Children) -> None:
    serving = _serving()
    done = children.result("serving")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "simulated" in done.stdout
    results = json.loads(children.out("serving").read_text())
    assert results["simulated"] and results["wrong_values"] == 0 and results["leaked_bytes"] == 0
    row = results["sizes"]["64KB"]
    assert set(row["strategies"]) == set(serving.STRATEGIES)
    for name, figures in row["strategies"].items():
        if name == serving.MM_MANY and not hasattr(FeatureCache, "get_many"):
            assert figures == {"skipped": "n/a (no get_many)"}
            continue
        assert figures["wrong_values"] == 0, name
        assert figures["requests"] > 0 and figures["requests_per_s"] > 0, name
        assert figures["front_end_units"] > 0, name
        assert 0 < figures["gpu_hit_share"] <= 1, name
    for name in (serving.MM_GET, serving.MM_MANY):
        if "skipped" not in row["strategies"][name]:
            assert row["strategies"][name]["leaked_bytes"] == 0
            assert row["strategies"][name]["host_ready"]
    assert row["ratios"][f"{serving.MM_GET} / floor"] > 0
    classes = row["operations"]["classes"]
    for name in ("GPU hit", "host hit -> device", "put that evicts"):
        assert classes[name]["calls"] > 0 and classes[name]["median_us"] > 0, name
    full = row["operations"]["full_tier_puts"]
    # The catalogue is put once into a GPU tier of a fifth of it: most puts evict.
    assert full["features_evicted"] >= 0.7 * 32 and full["us_per_feature_evicted"] > 0
    assert serving.FULL_TIER_PUTS in done.stdout
    assert row["operations"]["wrong_values"] == 0 and row["operations"]["leaked_bytes"] == 0


def test_bench_serving_alternates_rounds_and_reports_each_designs_median(
    children: Children,
) -> None:
    done = children.result("serving-rounds")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(children.out("serving-rounds").read_text())
    assert results["config"]["rounds"] == 3 and results["wrong_values"] == 0
    for name, figures in results["sizes"]["64KB"]["strategies"].items():
        if "skipped" in figures:
            continue
        rates = figures["rounds_requests_per_s"]
        assert len(rates) == 3 and all(rate > 0 for rate in rates), name
        assert figures["requests_per_s"] == sorted(rates)[1], name  # the median round's row
    # Each round's mmcache window over the same round's floor, then their median.
    serving = _serving()
    size = results["sizes"]["64KB"]["strategies"]
    floor, ours = size[serving.FLOOR], size[serving.MM_GET]
    pairs = zip(ours["rounds_requests_per_s"], floor["rounds_requests_per_s"], strict=True)
    each = [a / b for a, b in pairs]
    paired = results["sizes"]["64KB"]["paired_ratios"][f"{serving.MM_GET} / floor"]
    assert paired["median"] == pytest.approx(sorted(each)[1])
    assert paired["min"] == pytest.approx(min(each)) and paired["max"] == pytest.approx(max(each))
    assert "each round's ratio, median (range)" in done.stdout
    assert "3 rounds, designs alternated" in done.stdout
    assert children.result("serving-no-rounds").returncode == 2  # refused by argparse


async def test_bench_serving_runs_get_many_where_the_cache_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before FeatureCache.get_many exists, a stand-in of gets runs the design's path."""
    serving = _serving()
    if not hasattr(FeatureCache, "get_many"):

        async def get_many(
            self: FeatureCache, keys: list[Any], **kwargs: Any
        ) -> list[torch.Tensor | None]:
            return [await self.get(key, **kwargs) for key in keys]

        monkeypatch.setattr(FeatureCache, "get_many", get_many, raising=False)
    results = await serving.run(_small_serving_config())
    many = results["sizes"]["64KB"]["strategies"][serving.MM_MANY]
    assert many["requests"] > 0 and many["wrong_values"] == 0 and many["leaked_bytes"] == 0
    assert many["stats"]["hits_gpu"] + many["stats"]["hits_cpu"] > 0


async def test_bench_serving_counts_wrong_features_for_every_design(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An encoder that makes another image's feature shows as wrong values everywhere."""
    serving = _serving()
    Features = serving.Features

    def encode_wrong(self: Any, image: int) -> torch.Tensor:
        return torch.add(self.pattern, image + 1).view(torch.bfloat16)

    monkeypatch.setattr(Features, "encode", encode_wrong)
    results = await serving.run(_small_serving_config())
    assert results["wrong_values"] > 0
    for name, figures in results["sizes"]["64KB"]["strategies"].items():
        if "skipped" not in figures:
            assert figures["wrong_values"] > 0, name


def test_the_bus_ceiling_is_the_req_s_at_which_host_hits_fill_the_h2d_bus() -> None:
    serving = _serving()
    # 40 % of lookups from the host, 2.5 features a request of 8 MB: 8 MB a request over
    # the bus, 50 GB/s of it: 6,250 requests a second at most.
    row = {"lookups": 100, "requests": 100, "features": 250, "stats": {"hits_cpu": 40}}
    assert serving.bus_ceiling(row, 8_000_000, 50.0) == pytest.approx(6250.0)
    assert serving.bus_ceiling({**row, "stats": {"hits_cpu": 0}}, 8_000_000, 50.0) is None
    assert serving.bus_ceiling({**row, "requests": 0}, 8_000_000, 50.0) is None


def test_bench_serving_check_catches_poison_zeros_and_misses() -> None:
    serving = _serving()
    features = serving.Features(4, _small_serving_config(), None)
    good = features.encode(7)
    features.consume(7, good)
    assert features.take_wrong() == 0
    features.consume(8, good)  # another image's bytes
    features.consume(7, torch.full_like(good.view(torch.int16), -1).view(torch.bfloat16))
    features.consume(7, torch.zeros_like(good))
    features.consume(7, None)
    features.consume(7, good[:2])
    assert features.take_wrong() == 5
    assert features.take_wrong() == 0


def test_mmcache_bench_runs_the_serving_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    from mmcache.cli import main

    extra = ["--device", "sim", "--sizes", "64KB", "--seconds", "0.2", "--op-calls", "30"]
    assert main(["bench", "serving", "--quick", "--", *extra]) == 0
    out = capsys.readouterr().out
    assert "=== bench_serving.py" in out
    assert "bench_serving on sim (simulated" in out
    assert "wrong values: 0; mmcache leaked bytes: 0" in out

"""The `mmcache` command line: demo (verification, leaks, metrics), bench, settings, version."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from redis_server import free_port

import mmcache
import mmcache.cli
import mmcache.demo
from mmcache import FeatureCache
from mmcache.cli import main
from mmcache.demo import DEMO_CPU_MB, DEMO_GPU_MB, DemoConfig, demo_settings
from mmcache.demo import run_demo as run_demo_itself
from mmcache.settings import SETTINGS_TABLE

# Small enough to run in about a second, large enough to offload, read back and re-encode.
SMALL_DEMO = [
    "demo",
    "--device",
    "sim",
    "--requests",
    "12",
    "--seed",
    "1",
    "--gpu-mb",
    "64",
    "--cpu-mb",
    "128",
    "--images",
    "40",
    "--quiet",
]
TABLE_ROWS = ("hit ratio gpu", "hit ratio cpu", "offloaded d2h", "uploaded h2d", "leaked bytes")


def _table_value(output: str, metric: str) -> str:
    match = re.search(rf"^{re.escape(metric)}\s+(.+)$", output, re.MULTILINE)
    assert match is not None, f"no {metric!r} row in:\n{output}"
    return match.group(1).strip()


def test_demo_verifies_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL_DEMO) == 0
    out = capsys.readouterr().out
    for row in TABLE_ROWS:
        assert row in out
    assert _table_value(out, "requests").startswith("12, ")
    assert _table_value(out, "mismatches") == "0"
    assert _table_value(out, "leaked bytes") == "0"
    # The workload must exercise both tiers, or the verification proves little.
    assert _table_value(out, "offloaded d2h") != "0.00 GB"
    assert not _table_value(out, "hit ratio cpu").startswith("0.0%")


def test_demo_fails_on_a_corrupted_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_get = FeatureCache.get
    corrupted = 0

    async def flipping_get(self: FeatureCache, key: Hashable, **kwargs: Any) -> torch.Tensor | None:
        nonlocal corrupted
        got = await real_get(self, key, **kwargs)
        if got is None or corrupted >= 3:
            return got
        corrupted += 1
        got = got.clone()  # never write to what the cache handed out
        got.view(torch.int16).view(-1)[got.numel() // 2] ^= 1  # one bit of one value
        return got

    monkeypatch.setattr(FeatureCache, "get", flipping_get)
    assert main(SMALL_DEMO) == 1
    captured = capsys.readouterr()
    assert corrupted == 3
    assert _table_value(captured.out, "mismatches") == "3"
    reads = int(_table_value(captured.out, "verified").split()[0])
    assert _last_line(captured.out) == (
        f"FAIL: {reads - 3} of {reads} reads exact, 3 differ from what was encoded, 0 bytes leaked"
    )
    assert "1 of " in captured.err  # the report names how many values differ


def test_demo_fails_when_bytes_leak(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_stats = FeatureCache.stats
    monkeypatch.setattr(
        FeatureCache,
        "stats",
        lambda self: dataclasses.replace(real_stats(self), leaked_bytes=4096),
    )
    assert main(SMALL_DEMO) == 1
    assert _last_line(capsys.readouterr().out).endswith(
        ", 0 differ from what was encoded, 4096 bytes leaked"
    )


def test_demo_refuses_a_gpu_tier_smaller_than_a_feature(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL_DEMO, "--gpu-mb", "4"]) == 2
    assert "--gpu-mb 4 is smaller than the largest feature" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "variable", "tier", "memory"),
    [
        ("--gpu-mb", "MMCACHE_GPU_CACHE_MB", "GPU", "the memory of sim"),
        ("--cpu-mb", "MMCACHE_CPU_CACHE_MB", "host", "this machine's memory"),
    ],
)
def test_demo_refuses_a_budget_beyond_the_machine_naming_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    variable: str,
    tier: str,
    memory: str,
) -> None:
    assert main([*SMALL_DEMO, flag, "1e12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: a {tier} tier of 1e+12 MB exceeds {memory} (")
    assert err.rstrip().endswith(f"; lower {flag}")
    monkeypatch.setenv(variable, "1e12")
    assert main(NO_BUDGET_FLAGS) == 2
    assert capsys.readouterr().err.rstrip().endswith(f"; lower {variable}")


def _last_line(output: str) -> str:
    return output.rstrip("\n").rsplit("\n", 1)[-1]


def test_demo_ends_with_a_verdict_and_marks_simulated_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(SMALL_DEMO) == 0
    out = capsys.readouterr().out
    reads = int(_table_value(out, "verified").split()[0])
    assert _last_line(out) == (
        f"PASS: {reads} of {reads} reads exact, 0 differ from what was encoded, 0 bytes leaked"
    )
    for row in ("run time", "copy rate", "get p50 / p99 device", "event loop max lag"):
        assert re.search(rf"^{re.escape(row)} \*\s", out, re.MULTILINE), row
    assert "* simulated: on `sim`" in out
    assert not re.search(r"^(hit ratio gpu|mismatches|leaked bytes) \*", out, re.MULTILINE)


# SMALL_DEMO without its budget flags: the budgets come from the environment.
NO_BUDGET_FLAGS = [
    a
    for i, a in enumerate(SMALL_DEMO)
    if a not in ("--gpu-mb", "--cpu-mb") and SMALL_DEMO[i - 1] not in ("--gpu-mb", "--cpu-mb")
]


def test_demo_takes_its_budgets_from_the_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "64")
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "96")
    assert main(NO_BUDGET_FLAGS) == 0
    assert _table_value(capsys.readouterr().out, "GPU / CPU tier") == "64 MiB / 96 MiB"
    assert main([*NO_BUDGET_FLAGS, "--cpu-mb", "128"]) == 0  # a flag wins
    assert _table_value(capsys.readouterr().out, "GPU / CPU tier") == "64 MiB / 128 MiB"
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "4")
    assert main(NO_BUDGET_FLAGS) == 2
    assert "MMCACHE_GPU_CACHE_MB 4 is smaller than the largest feature" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MMCACHE_GPU_CACHE_MB", "-5"),
        ("MMCACHE_CPU_CACHE_MB", "lots"),
        ("MMCACHE_COPY_TIMEOUT_SEC", "-1"),
    ],
)
def test_demo_refuses_invalid_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(NO_BUDGET_FLAGS) == 2
    err = capsys.readouterr().err
    assert variable in err and "invalid" in err


def test_demo_help_shows_defaults_and_bad_numbers_say_what_was_expected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "requests to serve (default: 500)",
        "requests served at once (default: 8)",
        "(default: 0)",
        "MMCACHE_GPU_CACHE_MB or SGLANG_VLM_CACHE_SIZE_MB if set, else 256",
        "MMCACHE_CPU_CACHE_MB if set, else 512",
    ):
        assert text in out
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--requests", "abc"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--requests: must be a whole number >= 1, got 'abc'" in err
    assert "_positive_int" not in err


def test_demo_as_a_module_subprocess() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mmcache", *SMALL_DEMO[:-1]],  # with progress lines
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _table_value(done.stdout, "mismatches") == "0"


def _scrape_the_lingering_demo(env: dict[str, str] | None = None) -> tuple[str, str]:
    """Run the demo serving metrics on any free port and lingering; the URL it printed and
    what that URL served while it lingered."""
    command = [sys.executable, "-m", "mmcache", *SMALL_DEMO, "--metrics-port", "0"]
    with subprocess.Popen(
        [*command, "--linger", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    ) as proc:
        try:
            assert proc.stdout is not None
            url = None
            for line in proc.stdout:
                if line.startswith("metrics: http://"):
                    url = line.split()[1]
                if line.startswith("metrics: serving final values"):
                    break
            else:
                pytest.fail(f"the demo ended without lingering: {proc.wait()}")
            assert url is not None
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read().decode()
        finally:
            proc.kill()  # it would linger for a minute otherwise
            proc.communicate()
    return url, body


def test_metrics_are_served_while_the_demo_lingers() -> None:
    url, body = _scrape_the_lingering_demo()
    assert url.startswith("http://127.0.0.1:")  # bound to every interface, as the library does
    hits = re.search(r'^mmcache_lookups_total\{cache="demo",result="hit_gpu"\} (\S+)$', body, re.M)
    assert hits is not None, body
    assert float(hits.group(1)) > 0


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is a loopback address on Linux")
def test_the_demo_serves_metrics_on_the_librarys_address() -> None:
    url, body = _scrape_the_lingering_demo({"MMCACHE_METRICS_ADDR": "127.0.0.2"})
    assert url.startswith("http://127.0.0.2:")
    assert 'mmcache_lookups_total{cache="demo"' in body


def test_the_demo_serves_metrics_once_on_the_port_of_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    monkeypatch.setenv("MMCACHE_METRICS_PORT", str(port))
    monkeypatch.setenv("MMCACHE_METRICS_ADDR", "127.0.0.1")
    assert main(SMALL_DEMO) == 0  # the cache starts no second server on that port
    assert f"metrics: http://127.0.0.1:{port}/metrics" in capsys.readouterr().out


def test_settings_lists_every_environment_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "321")
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for row in SETTINGS_TABLE:
        assert row.field in out
        for name in row.env_names:
            assert name in out
    assert "321.0 (from SGLANG_VLM_CACHE_SIZE_MB)" in out
    assert max(len(line) for line in out.splitlines()) <= 100, "fits a terminal"


def test_settings_names_an_invalid_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "lots")
    assert main(["settings"]) == 1
    assert "MMCACHE_CPU_CACHE_MB" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"mmcache {mmcache.__version__}"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    """Two stand-in benchmark scripts (no torch import: they start fast), one failing."""
    (tmp_path / "bench_good.py").write_text("import sys\nprint('good ran with', sys.argv[1:])\n")
    (tmp_path / "bench_bad.py").write_text("import sys\nprint('bad ran')\nsys.exit(3)\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark: never run')\n")
    return tmp_path


def test_bench_runs_every_script_and_fails_if_one_fails(
    bench_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--dir", str(bench_dir), "--quick"]) == 1
    captured = capsys.readouterr()
    assert "good ran with ['--quick']" in captured.out
    assert "bad ran" in captured.out
    assert "bench_bad.py failed with exit status 3" in captured.out
    assert "never run" not in captured.out + captured.err


def test_bench_runs_named_scripts_with_extra_arguments(
    bench_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--dir", str(bench_dir), "good", "--", "--device", "sim"]) == 0
    out = capsys.readouterr().out
    assert "good ran with ['--device', 'sim']" in out
    assert "bad ran" not in out


def test_bench_refuses_an_unknown_name(bench_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--dir", str(bench_dir), "nosuch"]) == 2
    assert "available: bad, good" in capsys.readouterr().err


def test_bench_finds_the_checkout_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmcache.cli import find_benchmarks

    monkeypatch.chdir(os.path.dirname(os.path.dirname(mmcache.__file__)))
    scripts = find_benchmarks()
    assert scripts, "no benchmarks/bench_*.py in the checkout"
    assert all(s.name.startswith("bench_") and s.suffix == ".py" for s in scripts)


def test_scripts_run_answers_an_unknown_job_before_any_set_up(tmp_path: Path) -> None:
    # Its usage line comes at once: no virtual environment made, nothing installed.
    venv = tmp_path / "venv"
    script = Path(__file__).resolve().parents[2] / "scripts" / "run"
    done = subprocess.run(
        ["bash", str(script), "frobnicate"],
        env={**os.environ, "MMCACHE_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "usage: bash scripts/run demo|test|bench" in done.stderr
    assert not venv.exists()


def test_scripts_run_sets_up_only_when_the_requirements_change(tmp_path: Path) -> None:
    # A venv whose stamp matches pyproject.toml is used as it is: no pip, no import checks.
    root = Path(__file__).resolve().parents[2]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    mmcache_cli = venv / "bin" / "mmcache"
    mmcache_cli.write_text('#!/usr/bin/env bash\necho "mmcache $*"\n')
    mmcache_cli.chmod(0o755)
    with (root / "pyproject.toml").open("rb") as requirements:
        checksum = subprocess.run(["cksum"], stdin=requirements, capture_output=True, check=True)
    stamp = checksum.stdout.decode().rstrip("\n")
    (venv / ".mmcache-installed").write_text(f"{stamp} {root}\n")
    done = subprocess.run(
        ["bash", str(root / "scripts" / "run"), "demo", "--requests", "3"],
        env={**os.environ, "MMCACHE_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "mmcache demo --requests 3\n"
    assert "installing" not in done.stderr


def test_an_unknown_demo_flag_is_named_with_the_demos_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--bogus", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mmcache demo ")
    assert "mmcache demo: error: unrecognized arguments: --bogus 1" in err


def test_the_demo_takes_the_eviction_policy_as_a_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen: list[str] = []
    real = run_demo_itself

    def run_demo(config: Any) -> int:
        chosen.append(demo_settings(config).eviction_policy)
        return real(config)

    monkeypatch.setattr(mmcache.cli, "run_demo", run_demo)
    assert main([*SMALL_DEMO, "--policy", "cost"]) == 0
    assert chosen == ["cost"]
    with pytest.raises(SystemExit):
        main([*SMALL_DEMO, "--policy", "mru"])
    assert "invalid choice: 'mru'" in capsys.readouterr().err


def test_settings_into_a_pipe_that_closes_early_ends_quietly() -> None:
    # `true` reads nothing and exits at once: every write of the listing meets a closed pipe.
    done = subprocess.run(
        ["bash", "-c", f"'{sys.executable}' -m mmcache settings | true; echo ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == "141\n"
    assert done.stderr == ""


def test_ctrl_c_stops_the_demo_with_one_line_and_status_130() -> None:
    command = [sys.executable, "-m", "mmcache", *SMALL_DEMO[:-1]]
    command[command.index("--requests") + 1] = "100000"
    # A shell's background job (CI's, a tool's) starts with SIGINT ignored, and children
    # inherit that: the demo gets the default disposition back, as in a terminal.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as demo:
        try:
            assert demo.stderr is not None
            demo.stderr.readline()  # the first progress line: it is serving
            demo.send_signal(signal.SIGINT)
            _, err = demo.communicate(timeout=60)
        finally:
            demo.kill()
    assert demo.returncode == 130
    assert err.strip() == "mmcache: interrupted", err


def test_bench_without_its_scripts_says_where_they_come_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "source checkout" in err and "--dir" in err


def test_an_empty_budget_variable_is_unset_for_the_demo_as_for_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "")
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "  ")
    settings = demo_settings(DemoConfig())
    assert (settings.gpu_cache_mb, settings.cpu_cache_mb) == (DEMO_GPU_MB, DEMO_CPU_MB)
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "96")
    assert demo_settings(DemoConfig()).gpu_cache_mb == 96


def test_a_feature_wider_than_the_tiers_is_refused_before_the_catalogue_is_made(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the catalogue's features were made")

    monkeypatch.setattr(mmcache.demo.Catalogue, "__init__", refuse)
    assert main(["demo", "--device", "sim", "--hidden", "100000", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-mb 256 is smaller than the largest feature" in err

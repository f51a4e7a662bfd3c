"""The README's Python blocks run as written on the simulator, and its quickstart is cheap there.

Each block is taken from README.md and run in a fresh interpreter with CUDA hidden, so
`DEVICE` is "sim" on any machine: what a newcomer without a GPU pastes into a file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

#: What the README's quickstart may cost on the simulator with its production budgets.
QUICKSTART_MAX_SECONDS = 5.0
QUICKSTART_MAX_RSS_GROWTH = 1 << 30

# Runs a block after the imports a newcomer's file would make anyway, and reports how
# long the block took and how much the process's peak RSS grew over it. The peak is
# VmHWM, this process's own: ru_maxrss would carry over pytest's RSS from the fork.
HARNESS = """
import json, sys, time
import torch, mmcache
def status_bytes(field):
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024
before = status_bytes("VmRSS")
started = time.perf_counter()
exec(compile(sys.stdin.read(), "README.md", "exec"), {"__name__": "__main__"})
seconds = time.perf_counter() - started
print("HARNESS " + json.dumps({"seconds": seconds, "rss_growth": status_bytes("VmHWM") - before}))
"""


def python_blocks() -> dict[str, str]:
    """Every ```python block of the README, named by its section and position."""
    blocks: dict[str, str] = {}
    section = "top"
    for part in re.split(r"^(## .+)$", README, flags=re.MULTILINE):
        if part.startswith("## "):
            section = part[3:].strip()
            continue
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", part, re.M | re.S)):
            blocks[f"{section} #{i + 1}"] = code
    return blocks


def run_block(code: str) -> tuple[subprocess.CompletedProcess[str], dict[str, float]]:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    for name in list(env):
        if name.startswith(("MMCACHE_", "SGLANG_")):
            del env[name]  # the README's settings, not the caller's
    done = subprocess.run(
        [sys.executable, "-c", HARNESS],
        input=code,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    report = next(line for line in done.stdout.splitlines() if line.startswith("HARNESS "))
    return done, json.loads(report.removeprefix("HARNESS "))


def test_the_readme_has_the_blocks_it_should() -> None:
    names = list(python_blocks())
    assert {"Quickstart #1", "API tour #1"} <= set(names), names
    assert any(name.startswith("Using it with") for name in names), names


@pytest.mark.parametrize("name", sorted(python_blocks()))
def test_a_readme_block_runs_as_written(name: str) -> None:
    run_block(python_blocks()[name])


def test_the_quickstart_opens_production_budgets_on_sim_cheaply() -> None:
    code = python_blocks()["Quickstart #1"]
    assert "gpu_cache_mb=2048, cpu_cache_mb=8192" in code  # the budgets this test is about
    done, report = run_block(code)
    assert "torch.Size([1024, 3584])" in done.stdout
    assert report["seconds"] < QUICKSTART_MAX_SECONDS, report
    assert report["rss_growth"] < QUICKSTART_MAX_RSS_GROWTH, report

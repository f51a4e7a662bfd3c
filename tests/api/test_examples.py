"""Every script in examples/ runs on the simulator and exits 0."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from child_runs import ChildRuns, selected_tests
from conftest import without_a_gpu

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: Small arguments per example; a new example runs with just `--device sim`.
ARGUMENTS: dict[str, list[str]] = {
    "async_scheduler.py": ["--device", "sim", "--requests", "8"],
    "encoder_to_scheduler_ipc.py": ["--device", "sim"],
    "two_nodes.py": ["--device", "sim", "--images", "6"],
    "sglang_embedding_cache.py": ["--device", "sim", "--requests", "10"],
}
#: Examples that start a server of their own, and the program they need for it.
NEEDS: dict[str, str] = {"two_nodes.py": "redis-server", "vllm_ec_connector.py": "redis-server"}
#: Examples that run inside a serving engine: the module each needs (skipped where absent).
ENGINE_MODULES = {
    "vllm_ec_connector.py": "vllm.distributed.ec_transfer.ec_connector.factory",
    "sglang_embedding_cache.py": "sglang.srt.mem_cache.multimodal_cache",
}


def _scripts() -> list[str]:
    return sorted({p.name for p in EXAMPLES.glob("*.py")} | set(ARGUMENTS))


def _not_runnable(name: str) -> str | None:
    """Why examples/name cannot run here, or None."""
    if not (EXAMPLES / name).exists():
        return f"examples/{name} is not written yet"
    if name in NEEDS and shutil.which(NEEDS[name]) is None:
        return f"examples/{name} starts a {NEEDS[name]}, which is not installed"
    return None


@pytest.fixture(scope="module")
def examples(request: pytest.FixtureRequest) -> Iterator[ChildRuns]:
    """Each example on the simulator, every GPU hidden; the selected ones started side by
    side from the first test (where the host has cores to spare)."""
    runs = ChildRuns(
        {
            name: [str(EXAMPLES / name), *ARGUMENTS.get(name, ["--device", "sim"])]
            for name in _scripts()
        },
        cwd=EXAMPLES.parent,
        timeout=60,
        env=without_a_gpu(),
    )
    runs.start(
        [
            str(item.callspec.params["name"])
            for item in selected_tests(request)
            if item.originalname == "test_example_runs_on_the_simulator"
            and _not_runnable(str(item.callspec.params["name"])) is None
            and item.callspec.params["name"] not in ENGINE_MODULES  # its test may skip
        ]
    )
    yield runs
    runs.close()


@pytest.mark.parametrize("name", _scripts())
def test_example_runs_on_the_simulator(name: str, examples: ChildRuns) -> None:
    reason = _not_runnable(name)
    if reason is not None:
        pytest.skip(reason)
    if name in ENGINE_MODULES:
        pytest.importorskip(ENGINE_MODULES[name], reason="its engine is not installed")
    done = examples.result(name)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_without_a_gpu_says_so_in_one_line(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=EXAMPLES.parent,
    )
    assert done.returncode != 0
    assert done.stderr.startswith("error: ") and "CUDA is not available" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr

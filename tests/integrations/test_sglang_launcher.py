"""`python -m mmcache.integrations.sglang`: SGLang's launcher, mmcache in every SGLang process.

SGLang spawns its scheduler processes (multiprocessing's spawn), so an install() in the
launching process does not reach them; mmcache's SGLang plugin does, as SGLang loads its
plugins in each process. These tests use SGLang's real plugin loader and seam module (its
GPU-only imports stood in for: sglang_seam.py) and run without a model or a GPU, on the
simulator (MMCACHE_SGLANG_INSTALL=sim). Two run processes: the launcher handing over to a
stand-in for sglang.launch_server that does what it does (loads the plugins, spawns a
scheduler that loads them again and builds its embedding cache through the seam), and
`-m` handing over to SGLang's own launch_server (its --help: no model). Those processes find
the plugin through a distribution on their path registering the entry point pyproject.toml
declares: the environment's own install of mmcache may predate it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip(
    "sglang.srt.mem_cache.multimodal_cache",
    reason="sglang 0.5.23 is not installed (bash scripts/install_integrations.sh installs it)",
)

from sglang_seam import SEAM, load_seam  # noqa: E402

from mmcache.integrations import (  # noqa: E402
    SGLANG_INSTALL_VARIABLE,
    SGLANG_PLUGIN,
    SGLANG_PLUGIN_GROUP,
    SGLANG_PLUGIN_NAME,
    IntegrationError,
    sglang_plugin,
)
from mmcache.integrations.sglang import (  # noqa: E402
    Installation,
    MMCacheMultimodalCache,
    launch,
    main,
)

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
KiB = 1024

# The stand-in for sglang.launch_server: what its __main__ block does before it serves
# (load SGLang's plugins), then what SGLang's engine does to start a scheduler (spawn).
STANDIN_SERVER = """
import json
import multiprocessing as mp
import os
import sys

from sglang.srt.plugins import load_plugins

import sglang_seam
import standin_scheduler

if __name__ == "__main__":
    seam = sglang_seam.load_seam()  # SGLang's modules import it before serving
    load_plugins()
    report = {
        "argv": sys.argv[1:],
        "installed": standin_scheduler.installed(seam),
        "variable": os.environ.get("MMCACHE_SGLANG_INSTALL"),
        "sglang_plugins": os.environ.get("SGLANG_PLUGINS"),
    }
    mp.set_start_method("spawn", force=True)  # as SGLang's engine does
    reader, writer = mp.Pipe(duplex=False)
    scheduler = mp.Process(target=standin_scheduler.run, args=(writer,))
    scheduler.start()
    writer.close()
    report["scheduler"] = reader.recv()
    scheduler.join(60)
    report["scheduler_exit"] = scheduler.exitcode
    print("REPORT " + json.dumps(report))
"""

# The stand-in scheduler process: what run_scheduler_process does first (load the plugins),
# then what SGLang's KV cache builder does (init_mm_embedding_cache), then SGLang's calls.
STANDIN_SCHEDULER = """
import os

def installed(seam):
    from mmcache.integrations.sglang import Installation
    return isinstance(getattr(seam.init_mm_embedding_cache, "__self__", None), Installation)

def run(writer):
    import torch
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult
    from sglang.srt.plugins import load_plugins

    import sglang_seam

    seam = sglang_seam.load_seam()
    load_plugins()
    seam.init_mm_embedding_cache(64 * 1024)
    cache = seam.embedding_cache
    value = torch.arange(256, dtype=torch.float32).reshape(4, 64)
    report = {"pid": os.getpid(), "installed": installed(seam), "cache": type(cache).__name__}
    report["set"] = cache.set(7, EmbeddingResult(embedding=value))
    got = cache.get_single(7)
    report["hit"] = got is not None and bool(torch.equal(got.embedding, value))
    report["device"] = type(cache.feature_cache.device).__name__
    cache.close()
    writer.send(report)
"""


def declared_plugin() -> str:
    """The entry point pyproject.toml declares for mmcache in SGLang's plugin group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    value: str = project["entry-points"][SGLANG_PLUGIN_GROUP][SGLANG_PLUGIN_NAME]
    return value


def plugin_distribution(directory: Path) -> Path:
    """A distribution registering the declared entry point, on a path of its own."""
    info = directory / "mmcache_plugin_under_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mmcache-plugin-under-test\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[{SGLANG_PLUGIN_GROUP}]\n{SGLANG_PLUGIN_NAME} = {declared_plugin()}\n"
    )
    return directory


def run_python(code: str, args: list[str], path: list[Path], **env: str) -> Any:
    """Run code in a fresh interpreter with path first on sys.path; return its REPORT."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MMCACHE_", "SGLANG_")) and k != "CUDA_VISIBLE_DEVICES"
    }
    environ.update(env)
    environ["CUDA_VISIBLE_DEVICES"] = ""
    environ["PYTHONPATH"] = os.pathsep.join(
        [*map(str, path), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=environ,
        cwd=ROOT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.mark.timeout(240)
def test_the_launcher_hands_over_and_each_spawned_scheduler_builds_mmcaches_cache(
    tmp_path: Path,
) -> None:
    standins = tmp_path / "standins"
    standins.mkdir()
    (standins / "standin_server.py").write_text(STANDIN_SERVER)
    (standins / "standin_scheduler.py").write_text(STANDIN_SCHEDULER)
    argv = ["--model-path", "example/vlm-7b", "--tp-size", "2", "--port", "30000"]
    report = run_python(
        "import sys\n"
        "from mmcache.integrations.sglang import launch\n"
        "launch(sys.argv[1:], server='standin_server')\n",
        argv,
        [ROOT, TESTS, standins, plugin_distribution(tmp_path / "plugin")],
        MMCACHE_SGLANG_INSTALL="sim",
        SGLANG_PLUGINS="someone-elses",  # a whitelist: the launcher adds mmcache's plugin
    )
    assert report["argv"] == argv  # the server sees its arguments, as from the command line
    assert report["variable"] == "sim"  # kept: the processes SGLang starts inherit it
    assert report["sglang_plugins"] == f"someone-elses,{SGLANG_PLUGIN_NAME}"
    assert report["installed"], "install() did not run in the launching process"
    scheduler = report["scheduler"]
    assert report["scheduler_exit"] == 0
    assert scheduler["installed"] and scheduler["cache"] == MMCacheMultimodalCache.__name__
    assert scheduler["set"] and scheduler["hit"] and scheduler["device"] == "SimDevice"


@pytest.mark.timeout(240)
def test_python_m_runs_sglangs_own_launcher_after_installing(tmp_path: Path) -> None:
    """`python -m mmcache.integrations.sglang --help`: SGLang's launch_server prints its
    usage (no model needed) after its plugin loading ran install() in this process."""
    code = textwrap.dedent(
        """
        import atexit, json, runpy, sys
        import sglang_seam

        seam = sglang_seam.load_seam()

        def report():
            from mmcache.integrations.sglang import Installation
            done = getattr(seam.init_mm_embedding_cache, "__self__", None)
            print("REPORT " + json.dumps({"installed": isinstance(done, Installation)}))

        atexit.register(report)
        # What `python -m mmcache.integrations.sglang` does, after the seam is loaded.
        runpy.run_module("mmcache.integrations.sglang", run_name="__main__", alter_sys=True)
        """
    )
    # SGLang's launch_server warns that `sglang serve` is its recommended entry point.
    report = run_python(
        code,
        ["--help"],
        [ROOT, TESTS, plugin_distribution(tmp_path / "plugin")],
        MMCACHE_SGLANG_INSTALL="sim",
    )
    assert report["installed"]


# --- in this process --------------------------------------------------------------------


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """SGLang's seam module, removed again after the test; any installation undone."""
    monkeypatch.setitem(sys.modules, SEAM, ModuleType(SEAM))  # restored at the end
    del sys.modules[SEAM]
    module = load_seam()
    original = module.init_mm_embedding_cache
    yield module
    done = getattr(module.init_mm_embedding_cache, "__self__", None)
    if isinstance(done, Installation):
        done.uninstall()
    assert module.init_mm_embedding_cache is original


def test_the_entry_point_is_the_plugin() -> None:
    assert declared_plugin() == SGLANG_PLUGIN
    module, _, name = SGLANG_PLUGIN.partition(":")
    assert getattr(importlib.import_module(module), name) is sglang_plugin


@pytest.mark.parametrize("value", [None, "", "0", " 0 "])
def test_the_plugin_does_nothing_unless_asked(
    value: str | None, seam: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv(SGLANG_INSTALL_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(SGLANG_INSTALL_VARIABLE, value)
    before = seam.init_mm_embedding_cache
    sglang_plugin()
    assert seam.init_mm_embedding_cache is before


def test_the_plugin_installs_where_asked(seam: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SGLANG_INSTALL_VARIABLE, "sim")
    sglang_plugin()
    seam.init_mm_embedding_cache(64 * KiB)  # as SGLang's KV cache builder calls it
    assert isinstance(seam.embedding_cache, MMCacheMultimodalCache)
    assert seam.embedding_cache.max_size == 64 * KiB


def test_the_plugin_refuses_a_value_it_does_not_know(
    seam: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SGLANG_INSTALL_VARIABLE, "yes please")
    before = seam.init_mm_embedding_cache
    with pytest.raises(SystemExit, match=SGLANG_INSTALL_VARIABLE):
        sglang_plugin()
    assert seam.init_mm_embedding_cache is before


def test_a_failed_install_ends_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang catches a plugin's exceptions and would carry on with its own cache."""
    monkeypatch.setitem(sys.modules, SEAM, ModuleType(SEAM))  # a seam that is not 0.5.23's
    monkeypatch.setenv(SGLANG_INSTALL_VARIABLE, "1")
    with pytest.raises(SystemExit, match=rf"{SGLANG_INSTALL_VARIABLE}=1: .*0\.5\.23"):
        sglang_plugin()


class Handover:
    """Records what launch() hands SGLang's launcher instead of running it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, name: str, *, run_name: str, alter_sys: bool) -> dict[str, Any]:
        self.calls.append(
            {
                "name": name,
                "run_name": run_name,
                "alter_sys": alter_sys,
                "argv": list(sys.argv),
                "variable": os.environ.get(SGLANG_INSTALL_VARIABLE),
                "sglang_plugins": os.environ.get("SGLANG_PLUGINS"),
            }
        )
        return {}


@pytest.fixture
def handover(monkeypatch: pytest.MonkeyPatch) -> Handover:
    recorder = Handover()
    monkeypatch.setattr("runpy.run_module", recorder)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # restored after launch() sets it
    monkeypatch.delenv(SGLANG_INSTALL_VARIABLE, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    return recorder


@pytest.mark.parametrize(
    ("given", "kept"), [(None, "1"), ("0", "1"), ("sim", "sim"), ("cuda", "cuda")]
)
def test_launch_asks_every_sglang_process_to_install(
    given: str | None, kept: str, handover: Handover, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mmcache.integrations.sglang._plugin_registered", lambda: True)
    if given is not None:
        monkeypatch.setenv(SGLANG_INSTALL_VARIABLE, given)
    launch(["--model-path", "m", "--tp-size", "2"])
    assert handover.calls == [
        {
            "name": "sglang.launch_server",
            "run_name": "__main__",
            "alter_sys": True,
            "argv": ["sglang.launch_server", "--model-path", "m", "--tp-size", "2"],
            "variable": kept,
            "sglang_plugins": None,  # no whitelist: every plugin loads
        }
    ]


def test_launch_refuses_where_sglang_would_not_find_the_plugin(
    handover: Handover, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    with pytest.raises(IntegrationError, match="not registered"):
        launch(["--model-path", "m"])
    with pytest.raises(SystemExit, match=r"^error: mmcache's SGLang plugin"):
        main(["--model-path", "m"])
    assert handover.calls == []
    assert SGLANG_INSTALL_VARIABLE not in os.environ

"""A real Prometheus scrapes `mmcache demo`; every dashboard query parses and finds data."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dashboard_queries import DASHBOARD_PATH, PanelQuery, panel_queries, variable_queries

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

pytestmark = [
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="needs the `prometheus` and `promtool` binaries on PATH; "
        "install them with `bash scripts/install_prometheus.sh` (Debian, as root)",
    ),
    pytest.mark.timeout(120),
]

EXAMPLE_CONFIG = DASHBOARD_PATH.parents[1] / "examples" / "prometheus" / "prometheus.yml"
EXAMPLE_TARGET = "127.0.0.1:9464"
SCRAPE_S = 1  # what EXAMPLE_CONFIG sets; checked when the config is written
# Small features and tiers, so that evictions, offloads and uploads start within the first
# second; ~35-80 s of traffic on a 2-core machine, so that the rate panels' last 20 s still
# hold traffic when the queries run (1,500 requests took 8.6 s in one run, and ended before
# the window). The test never waits for the run to end: the demo is stopped at teardown.
DEMO_ARGS = (
    *("demo", "--device", "sim", "--requests", "6000", "--hidden", "1024"),
    *("--gpu-mb", "32", "--cpu-mb", "128", "--metrics-port", "0", "--linger", "30", "--quiet"),
)
MIN_SCRAPES = 8  # enough for several 4 s rate() windows
RANGE_S = 20
STEP_S = 1
# Grafana's $__interval for a 20 s range is the data source's scrape interval (the floor),
# and $__rate_interval is max($__interval + scrape interval, 4 * scrape interval).
INTERVAL = f"{SCRAPE_S}s"
RATE_INTERVAL = f"{max(SCRAPE_S + SCRAPE_S, 4 * SCRAPE_S)}s"

# Core panels: what anyone running a cache looks at first, and what the demo's workload
# (puts, lookups, offloads, uploads) necessarily produces. Each of their queries must return
# series, as an instant and as a range query, under "All" and under a concrete selection.
# Not core, so only required to parse: get waits (a get waits only when it races a copy),
# IPC pool and fallbacks (the demo has no peer process), faults and drops (a healthy run has
# none): a panel of events that need not happen is not wrong when it shows nothing.
CORE_PANELS = frozenset(
    {
        "Tier bytes vs capacity",
        "Tier fill",
        "Tier entries",
        "Lookups/s by result",
        "Hit ratio per tier",
        "Evictions/s by tier",
        "Copy throughput",
        "Pending copies",
        "Copy duration p50 / p99",
        "Leaked bytes",
    }
)
# Targets that must show the workload moving, not merely series at 0, somewhere in the range.
ACTIVE_TARGETS = frozenset(
    {
        ("Tier bytes vs capacity", "A"),  # bytes held
        ("Tier bytes vs capacity", "B"),  # capacity
        ("Tier entries", "A"),
        ("Lookups/s by result", "A"),
        ("Copy throughput", "A"),  # d2h: offloads
        ("Copy throughput", "B"),  # h2d: uploads
    }
)
# The demo leaks nothing (it fails if it does), so this panel must read 0 throughout.
ZERO_TARGETS = frozenset({("Leaked bytes", "A")})


@dataclass(frozen=True, slots=True)
class Stack:
    """A running demo and the Prometheus server that scrapes it."""

    target: str  # host:port of the demo's metrics, also its `instance` label
    prometheus: str  # base URL of the Prometheus HTTP API
    logs: tuple[Path, ...]

    def tails(self) -> str:
        """The last lines of each process's log, for a failure message."""
        return "\n".join(f"--- {log.name}:\n{_tail(log)}" for log in self.logs)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _process(
    args: Sequence[str], log: Path, cwd: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run args with output to log; terminate (then kill) it on the way out."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_for(
    what: str,
    check: Callable[[], bool],
    procs: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[Path],
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        exited = [p for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            why = f"it exited with {exited[0].returncode}" if exited else f"{timeout} s passed"
            tails = "\n".join(f"--- {log.name}:\n{_tail(log)}" for log in logs)
            pytest.fail(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.25)


def _get(base: str, path: str, params: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """GET a Prometheus API path; its JSON reply, also for 4xx errors (they carry `error`)."""
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            reply: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as e:
        with e:
            reply = json.load(e)
    return reply


def _scalar(reply: dict[str, Any]) -> float:
    """The value of an instant query that returns one series, or -1 when it returns none."""
    if reply.get("status") != "success" or not reply["data"]["result"]:
        return -1.0
    return float(reply["data"]["result"][0]["value"][1])


def _config(target: str) -> str:
    """The example Prometheus config, pointed at target."""
    text = EXAMPLE_CONFIG.read_text(encoding="utf-8")
    assert f"scrape_interval: {SCRAPE_S}s" in text, "SCRAPE_S no longer matches the example"
    assert f'"{EXAMPLE_TARGET}"' in text, f"the example no longer scrapes {EXAMPLE_TARGET}"
    return text.replace(f'"{EXAMPLE_TARGET}"', f'"{target}"')


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    demo_log, prometheus_log = tmp / "demo.log", tmp / "prometheus.log"
    logs = (demo_log, prometheus_log)
    # The demo's settings are its arguments, not whatever the caller's environment says.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MMCACHE_", "SGLANG_")) and k.lower() != "prometheus_multiproc_dir"
    }
    with contextlib.ExitStack() as processes:
        demo = processes.enter_context(
            _process([sys.executable, "-m", "mmcache", *DEMO_ARGS], demo_log, tmp, env)
        )
        announced = re.compile(r"metrics: http://(127\.0\.0\.1:\d+)/metrics")
        _wait_for(
            "the demo's metrics server",
            lambda: announced.search(_read(demo_log)) is not None,
            [demo],
            logs,
            timeout=30,  # mostly importing torch
        )
        match = announced.search(_read(demo_log))
        assert match is not None
        target = match[1]

        config = tmp / "prometheus.yml"
        config.write_text(_config(target), encoding="utf-8")
        api = f"http://127.0.0.1:{_free_port()}"
        prometheus = processes.enter_context(
            _process(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address={api.removeprefix('http://')}",
                ],
                prometheus_log,
                tmp,
            )
        )
        procs = [demo, prometheus]

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{api}/-/ready", timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        _wait_for("Prometheus to be ready", ready, procs, logs, timeout=20)

        def scraped() -> bool:
            # Scrapes that saw the cache (the metrics server starts before the cache does).
            count = f'count_over_time(mmcache_tier_capacity_bytes{{tier="gpu"}}[{RANGE_S}s])'
            return _scalar(_get(api, "/api/v1/query", [("query", count)])) >= MIN_SCRAPES

        _wait_for(f"{MIN_SCRAPES} scrapes of the demo", scraped, procs, logs, timeout=30)
        yield Stack(target, api, logs)


def test_exposition_passes_promtool(stack: Stack) -> None:
    assert PROMTOOL is not None
    with urllib.request.urlopen(f"http://{stack.target}/metrics", timeout=10) as response:
        exposition = response.read()
    assert b"\nmmcache_tier_bytes{" in exposition, stack.tails()
    lint = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=30
    )
    problems = (lint.stdout + lint.stderr).decode(errors="replace")
    assert lint.returncode == 0 and not problems.strip(), problems


def _values(stack: Stack, name: str, selector: str) -> list[str]:
    end = time.time()
    reply = _get(
        stack.prometheus,
        f"/api/v1/label/{name}/values",
        [("match[]", selector), ("start", f"{end - RANGE_S:.3f}"), ("end", f"{end:.3f}")],
    )
    assert reply["status"] == "success", (name, selector, reply)
    values: list[str] = reply["data"]
    return values


def _grafana_regex(values: Sequence[str]) -> str:
    """Selected values of a multi-value variable as Grafana's Prometheus data source writes them."""
    escaped = [
        re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m[0], v.replace("\\", "\\\\\\\\"))
        for v in values
    ]
    return escaped[0] if len(escaped) == 1 else f"({'|'.join(escaped)})"


def test_variable_queries_find_the_demo(stack: Stack) -> None:
    queries = {q.name: q for q in variable_queries(instance=".*")}
    assert set(queries) == {"instance", "cache"}
    instances = _values(stack, queries["instance"].label, queries["instance"].selector)
    assert instances == [stack.target]
    caches = _values(stack, queries["cache"].label, queries["cache"].selector)
    assert caches == ["demo"]
    # The cache variable as it refreshes once an instance is picked.
    picked = {q.name: q for q in variable_queries(instance=_grafana_regex(instances))}["cache"]
    assert _values(stack, picked.label, picked.selector) == ["demo"]


def _problems(stack: Stack, query: PanelQuery, start: float, end: float) -> list[str]:
    """What is wrong with one target's instant and range results, if anything."""
    where = f"{query.panel!r} {query.ref_id}: {query.expr}"
    instant = _get(stack.prometheus, "/api/v1/query", [("query", query.expr), ("time", f"{end}")])
    ranged = _get(
        stack.prometheus,
        "/api/v1/query_range",
        [
            ("query", query.expr),
            ("start", f"{start}"),
            ("end", f"{end}"),
            ("step", f"{STEP_S}s"),
        ],
    )
    problems = []
    for kind, reply in (("instant", instant), ("range", ranged)):
        if reply.get("status") != "success":
            problems.append(f"{where}\n    {kind} query failed: {reply.get('error', reply)}")
        elif query.panel in CORE_PANELS and not reply["data"]["result"]:
            problems.append(f"{where}\n    {kind} query returned no series")
    if problems:
        return problems
    values = [float(v) for series in ranged["data"]["result"] for _, v in series["values"]]
    key = (query.panel, query.ref_id)
    if key in ACTIVE_TARGETS and not any(v > 0 for v in values):
        problems.append(f"{where}\n    never above 0 over the last {RANGE_S} s: {values}")
    if key in ZERO_TARGETS and any(v != 0 for v in values):
        problems.append(f"{where}\n    not 0 throughout: {values}")
    return problems


@pytest.mark.parametrize("selection", ["all", "picked"])
def test_dashboard_queries_parse_and_core_panels_have_data(stack: Stack, selection: str) -> None:
    if selection == "all":
        instance = cache = ".*"  # the variables' allValue
    else:
        instance, cache = _grafana_regex([stack.target]), _grafana_regex(["demo"])
    queries = panel_queries(
        rate_interval=RATE_INTERVAL, interval=INTERVAL, instance=instance, cache=cache
    )
    panels = {q.panel for q in queries}
    assert CORE_PANELS <= panels, f"core panels missing from the dashboard: {CORE_PANELS - panels}"
    # Grafana aligns a range query's ends to its step.
    end = float(math.floor(time.time() / STEP_S) * STEP_S)
    start = end - RANGE_S
    problems = [p for q in queries for p in _problems(stack, q, start, end)]
    assert not problems, "\n".join(problems) + "\n" + stack.tails()

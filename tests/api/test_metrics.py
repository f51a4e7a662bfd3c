"""CacheMetrics moves the right series, keeps caches apart, and the dashboard queries it."""

from __future__ import annotations

import gc
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from dashboard_queries import iter_panels, load_dashboard, panel_queries, variable_queries
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmcache.errors import SettingsError
from mmcache.metrics import (
    DIRECTIONS,
    FAULT_KINDS,
    IPC_FALLBACK_REASONS,
    LOOKUP_RESULTS,
    METRICS_TABLE,
    CacheMetrics,
    CacheNameInUseError,
    asgi_app,
    hot_inc,
    make_multiprocess_registry,
    mark_process_dead,
    start_metrics_server,
)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Iterator[CacheMetrics]:
    m = CacheMetrics("vision", registry)
    yield m
    m.close()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"cache": "vision", **labels})


def series_of(registry: CollectorRegistry, cache: str) -> set[tuple[str, tuple[Any, ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("cache") == cache
    }


def test_every_series_exists_at_zero_from_the_start(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    # rate() needs a 0 sample before the first event to see that event at all.
    for result in LOOKUP_RESULTS:
        assert value(registry, "mmcache_lookups_total", result=result) == 0
    for reason in IPC_FALLBACK_REASONS:
        assert value(registry, "mmcache_ipc_fallbacks_total", reason=reason) == 0
    for kind in FAULT_KINDS:
        assert value(registry, "mmcache_faults_total", kind=kind) == 0
    assert value(registry, "mmcache_dropped_total") == 0
    assert value(registry, "mmcache_get_wait_seconds_count") == 0
    assert value(registry, "mmcache_leaked_bytes", tier="ipc") == 0


def test_lookup_counts_each_result(registry: CollectorRegistry, metrics: CacheMetrics) -> None:
    metrics.lookup("hit_gpu")
    metrics.lookup("hit_gpu")
    metrics.lookup("hit_cpu")
    metrics.lookup("miss")
    metrics.lookup("miss")
    metrics.lookup("miss")
    assert value(registry, "mmcache_lookups_total", result="hit_gpu") == 2
    assert value(registry, "mmcache_lookups_total", result="hit_cpu") == 1
    assert value(registry, "mmcache_lookups_total", result="miss") == 3


def test_hot_inc_counts_into_the_same_series(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    """The hot path's inc (the series' value's own) moves the sample a scrape reads, as
    the series' inc does; a series without such a value falls back to its inc."""
    hit = hot_inc(metrics.lookup_counter("hit_gpu"))
    hit(1)
    hit(3)
    metrics.lookup("hit_gpu")
    assert value(registry, "mmcache_lookups_total", result="hit_gpu") == 5
    pending = hot_inc(metrics.copy_series("d2h")[0])
    pending(2)
    assert value(registry, "mmcache_pending_copies", direction="d2h") == 2

    class Plain:
        def __init__(self) -> None:
            self.total = 0.0

        def inc(self, amount: float = 1) -> None:
            self.total += amount

    plain = Plain()
    hot_inc(plain)(4)  # type: ignore[arg-type]
    assert plain.total == 4


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        ("lookup", "hit"),
        ("eviction", "ipc"),
        ("copy_started", "d2d"),
        ("set_capacity", "disk"),
    ],
)
def test_unknown_closed_label_value_is_refused(metrics: CacheMetrics, call: str, arg: str) -> None:
    method = getattr(metrics, call)
    with pytest.raises(ValueError, match=f"unknown .*{arg!r}; expected one of"):
        method(arg) if call != "set_capacity" else method(arg, 1)


def test_set_tier_and_capacity(registry: CollectorRegistry, metrics: CacheMetrics) -> None:
    metrics.set_tier("gpu", 3 << 20, 3)
    metrics.set_tier("cpu", 5 << 20, 7)
    metrics.set_capacity("gpu", 64 << 20)
    metrics.set_capacity("cpu", 1 << 30)
    metrics.set_tier("gpu", 1 << 20, 1)  # gauges follow the latest report
    assert value(registry, "mmcache_tier_bytes", tier="gpu") == 1 << 20
    assert value(registry, "mmcache_tier_entries", tier="gpu") == 1
    assert value(registry, "mmcache_tier_bytes", tier="cpu") == 5 << 20
    assert value(registry, "mmcache_tier_entries", tier="cpu") == 7
    assert value(registry, "mmcache_tier_capacity_bytes", tier="gpu") == 64 << 20
    assert value(registry, "mmcache_tier_capacity_bytes", tier="cpu") == 1 << 30


def test_evictions_and_drops(registry: CollectorRegistry, metrics: CacheMetrics) -> None:
    metrics.eviction("gpu")
    metrics.eviction("gpu")
    metrics.eviction("cpu")
    metrics.dropped()
    assert value(registry, "mmcache_evictions_total", tier="gpu") == 2
    assert value(registry, "mmcache_evictions_total", tier="cpu") == 1
    assert value(registry, "mmcache_dropped_total") == 1


def test_copies_pending_bytes_and_duration(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    metrics.copy_started("d2h")
    metrics.copy_started("d2h")
    metrics.copy_started("h2d")
    assert value(registry, "mmcache_pending_copies", direction="d2h") == 2
    assert value(registry, "mmcache_pending_copies", direction="h2d") == 1

    metrics.copy_finished("d2h", 4096, 0.003)
    assert value(registry, "mmcache_pending_copies", direction="d2h") == 1
    assert value(registry, "mmcache_pending_copies", direction="h2d") == 1
    assert value(registry, "mmcache_copy_bytes_total", direction="d2h") == 4096
    assert value(registry, "mmcache_copy_bytes_total", direction="h2d") == 0
    assert value(registry, "mmcache_copy_duration_seconds_count", direction="d2h") == 1
    assert value(registry, "mmcache_copy_duration_seconds_sum", direction="d2h") == 0.003
    bucket = "mmcache_copy_duration_seconds_bucket"
    assert value(registry, bucket, direction="d2h", le="0.0025") == 0
    assert value(registry, bucket, direction="d2h", le="0.005") == 1

    metrics.copy_finished("h2d", 1 << 20, 20e-6)
    assert value(registry, "mmcache_pending_copies", direction="h2d") == 0
    assert value(registry, bucket, direction="h2d", le="1e-05") == 0
    assert value(registry, bucket, direction="h2d", le="2.5e-05") == 1


def test_histogram_buckets_span_10us_to_1s(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    for name, labels in [
        ("mmcache_copy_duration_seconds_bucket", {"direction": "d2h"}),
        ("mmcache_get_wait_seconds_bucket", {}),
    ]:
        for le in ("1e-05", "0.0001", "0.001", "0.01", "0.1", "1.0", "+Inf"):
            assert value(registry, name, le=le, **labels) == 0, (name, le)


def test_get_wait(registry: CollectorRegistry, metrics: CacheMetrics) -> None:
    metrics.get_wait(0.0004)
    metrics.get_wait(2.0)
    assert value(registry, "mmcache_get_wait_seconds_count") == 2
    assert value(registry, "mmcache_get_wait_seconds_sum") == pytest.approx(2.0004)
    assert value(registry, "mmcache_get_wait_seconds_bucket", le="0.0005") == 1
    assert value(registry, "mmcache_get_wait_seconds_bucket", le="1.0") == 1
    assert value(registry, "mmcache_get_wait_seconds_bucket", le="+Inf") == 2


def test_leaks_ipc_pool_fallbacks_and_faults(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    metrics.set_leaked("gpu", 8192)
    metrics.set_leaked("ipc", 512)
    metrics.set_ipc_pool("used", 3 << 20)
    metrics.set_ipc_pool("free", 5 << 20)
    metrics.set_ipc_pool("leased", 1 << 20)
    metrics.ipc_fallback("pool_full")
    metrics.ipc_fallback("pool_full")
    metrics.ipc_fallback("receiver_gone")  # an open set: new reasons get their own series
    metrics.fault("copy_failed")
    metrics.fault("fence_timeout")
    assert value(registry, "mmcache_leaked_bytes", tier="gpu") == 8192
    assert value(registry, "mmcache_leaked_bytes", tier="cpu") == 0
    assert value(registry, "mmcache_leaked_bytes", tier="ipc") == 512
    assert value(registry, "mmcache_ipc_pool_bytes", state="used") == 3 << 20
    assert value(registry, "mmcache_ipc_pool_bytes", state="free") == 5 << 20
    assert value(registry, "mmcache_ipc_pool_bytes", state="leased") == 1 << 20
    assert value(registry, "mmcache_ipc_fallbacks_total", reason="pool_full") == 2
    assert value(registry, "mmcache_ipc_fallbacks_total", reason="receiver_gone") == 1
    assert value(registry, "mmcache_ipc_fallbacks_total", reason="no_peer") == 0
    assert value(registry, "mmcache_faults_total", kind="copy_failed") == 1
    assert value(registry, "mmcache_faults_total", kind="fence_timeout") == 1
    assert value(registry, "mmcache_faults_total", kind="oom") == 0


def test_two_caches_are_distinct_series(registry: CollectorRegistry) -> None:
    a = CacheMetrics("a", registry)
    b = CacheMetrics("b", registry)
    a.lookup("miss")
    a.set_tier("gpu", 100, 1)
    b.set_tier("gpu", 200, 2)
    get = registry.get_sample_value
    assert get("mmcache_lookups_total", {"cache": "a", "result": "miss"}) == 1
    assert get("mmcache_lookups_total", {"cache": "b", "result": "miss"}) == 0
    assert get("mmcache_tier_bytes", {"cache": "a", "tier": "gpu"}) == 100
    assert get("mmcache_tier_bytes", {"cache": "b", "tier": "gpu"}) == 200


def test_close_removes_its_series_and_leaves_the_others(registry: CollectorRegistry) -> None:
    a = CacheMetrics("a", registry)
    b = CacheMetrics("b", registry)
    a.ipc_fallback("made_up_reason")
    a.fault("made_up_kind")
    a.copy_finished("d2h", 10, 0.001)
    b.lookup("hit_cpu")
    b_series = series_of(registry, "b")
    assert series_of(registry, "a")

    a.close()
    assert series_of(registry, "a") == set()
    assert series_of(registry, "b") == b_series
    assert registry.get_sample_value("mmcache_lookups_total", {"cache": "b", "result": "hit_cpu"})

    a.close()  # idempotent
    a.lookup("miss")  # a closed cache's late report must not bring its series back
    assert series_of(registry, "a") == set()
    b.close()
    assert series_of(registry, "b") == set()


def test_a_name_is_taken_until_close(registry: CollectorRegistry) -> None:
    first = CacheMetrics("shared", registry)
    with pytest.raises(CacheNameInUseError, match="'shared' already reports"):
        CacheMetrics("shared", registry)
    CacheMetrics("shared", CollectorRegistry()).close()  # other registries are independent
    first.close()
    CacheMetrics("shared", registry).close()


def test_a_collected_cache_frees_its_name_and_its_gauges(registry: CollectorRegistry) -> None:
    lost = CacheMetrics("lost", registry)
    lost.copy_started("h2d")
    lost.set_tier("gpu", 999, 9)
    del lost
    gc.collect()
    again = CacheMetrics("lost", registry)
    get = registry.get_sample_value
    assert get("mmcache_pending_copies", {"cache": "lost", "direction": "h2d"}) == 0
    assert get("mmcache_tier_bytes", {"cache": "lost", "tier": "gpu"}) == 0
    again.close()


def test_empty_name_is_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        CacheMetrics("", registry)


def test_default_registry_is_shared_by_caches() -> None:
    a = CacheMetrics("test-default-registry-a")
    b = CacheMetrics("test-default-registry-b")  # the families must not be registered twice
    try:
        a.lookup("miss")
        labels = {"cache": "test-default-registry-a", "result": "miss"}
        assert REGISTRY.get_sample_value("mmcache_lookups_total", labels) == 1
    finally:
        a.close()
        b.close()
    assert REGISTRY.get_sample_value("mmcache_lookups_total", labels) is None


def test_metrics_table_describes_the_registry(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    metrics.remote()  # bound by caches with a remote tier only
    metrics.group()  # bound by caches with a process group only
    exposed = {
        family.name: (
            family.type,
            family.documentation,
            {k for s in family.samples for k in s.labels if k != "le"},
        )
        for family in registry.collect()
    }
    table = {
        info.name.removesuffix("_total") if info.type == "counter" else info.name: (
            info.type,
            info.meaning,
            set(info.labels),
        )
        for info in METRICS_TABLE
    }
    assert exposed == table


def test_exposition_names_follow_prometheus_conventions(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    text = generate_latest(registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.MULTILINE))
    counters = [name for name, kind in types.items() if kind == "counter"]
    assert len(counters) == sum(info.type == "counter" for info in METRICS_TABLE)
    for name, kind in types.items():
        assert name in helps, name
        if name.endswith("_created"):  # prometheus-client's creation timestamps
            continue
        assert re.fullmatch(r"mmcache_[a-z]+(_[a-z]+)*", name), name
        # promtool's lint: counters end in _total, nothing else does, base units only.
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        assert not re.search(r"_(milli|micro|kilo|mega|giga)", name), name
        if "bytes" in name:
            assert re.search(r"_bytes(_total)?$", name), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
    parsed = {f.name: f.type for f in text_string_to_metric_families(text)}
    for info in METRICS_TABLE:
        assert parsed[info.name.removesuffix("_total")] == info.type


def test_metrics_server_serves_the_registry(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    metrics.lookup("hit_gpu")
    server, thread = start_metrics_server(0, registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert 'mmcache_lookups_total{cache="vision",result="hit_gpu"} 1.0' in body


async def test_asgi_app_serves_the_registry(
    registry: CollectorRegistry, metrics: CacheMetrics
) -> None:
    metrics.set_tier("cpu", 1234, 1)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}
    await asgi_app(registry)(scope, receive, send)
    assert sent[0]["status"] == 200
    assert b'mmcache_tier_bytes{cache="vision",tier="cpu"} 1234.0' in sent[1]["body"]


def test_multiprocess_helpers_need_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    with pytest.raises(SettingsError, match="PROMETHEUS_MULTIPROC_DIR"):
        make_multiprocess_registry()
    with pytest.raises(SettingsError, match="PROMETHEUS_MULTIPROC_DIR"):
        mark_process_dead(12345)


# The dashboard.

DASHBOARD = load_dashboard()
PANELS = list(iter_panels(DASHBOARD))
UNITS = {"bytes", "Bps", "reqps", "ops", "s", "percentunit", "short"}


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, child in node.items():
            yield key, child
            yield from _walk(child)
    elif isinstance(node, list):
        for child in node:
            yield from _walk(child)


def _defined_sample_names() -> set[str]:
    registry = CollectorRegistry()
    m = CacheMetrics("any", registry)
    m.remote()
    m.group()
    names = {s.name for family in registry.collect() for s in family.samples}
    m.close()
    return names


def test_dashboard_rows() -> None:
    rows = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert rows == [
        "Capacity",
        "Traffic",
        "Copies",
        "Waiting",
        "IPC",
        "Health",
        "Remote tier",
        "Tensor-parallel group",
    ]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in PANELS:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_asks_for_its_data_source_on_import() -> None:
    # Grafana's import form asks for each __inputs entry and substitutes ${NAME} with it.
    assert DASHBOARD["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": "The Prometheus that scrapes the mmcache processes",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    required = {(r["type"], r["id"]) for r in DASHBOARD["__requires"]}
    panel_types = {("panel", p["type"]) for p in PANELS}
    assert {("grafana", "grafana"), ("datasource", "prometheus"), *panel_types} <= required
    datasources = [value for key, value in _walk(DASHBOARD) if key == "datasource"]
    assert len(datasources) >= len(PANELS)
    for datasource in datasources:
        assert datasource == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for panel in PANELS:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]


def test_dashboard_instance_and_cache_variables() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for name in ("instance", "cache"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["multi"] and variable["includeAll"]
        assert variable["allValue"] == ".*"
    queries = {q.name: q for q in variable_queries(instance="host:9464")}
    assert queries["instance"].selector == "mmcache_tier_bytes"
    assert queries["instance"].label == "instance"
    assert queries["cache"].selector == 'mmcache_tier_bytes{instance=~"host:9464"}'
    assert queries["cache"].label == "cache"


def test_every_panel_has_a_unit() -> None:
    for panel in PANELS:
        assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, panel["title"]
        if panel["type"] == "heatmap":
            assert panel["options"]["yAxis"]["unit"] == "s"


def test_dashboard_queries_use_only_defined_metrics() -> None:
    defined = _defined_sample_names()
    queries = panel_queries()
    assert len(queries) >= len(PANELS)
    for query in queries:
        used = set(re.findall(r"\bmmcache_\w+", query.expr))
        assert used, query
        assert used <= defined, (query.panel, used - defined)
    used_families = {
        name for query in queries for name in re.findall(r"\bmmcache_[a-z_]+", query.expr)
    }
    for info in METRICS_TABLE:
        assert any(name.startswith(info.name) for name in used_families), info.name


def test_every_selector_filters_instance_and_cache() -> None:
    for panel in PANELS:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, matchers in re.findall(r"\b(mmcache_\w+)(\{[^}]*\})?", expr):
                assert 'instance=~"$instance"' in matchers, (panel["title"], name)
                assert 'cache=~"$cache"' in matchers, (panel["title"], name)


def test_label_matchers_match_values_the_cache_emits() -> None:
    known = {"result": LOOKUP_RESULTS, "direction": DIRECTIONS}
    for query in panel_queries():
        for label, op, pattern in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', query.expr):
            if label in ("instance", "cache"):
                continue
            assert label in known, (query.panel, label)
            regex = pattern if op == "=~" else re.escape(pattern)
            assert any(re.fullmatch(regex, v) for v in known[label]), (query.panel, pattern)


def test_queries_expand_like_grafana() -> None:
    queries = panel_queries(rate_interval="4s", instance="localhost:9464", cache="(a|b)")
    for query in queries:
        assert "$" not in query.expr and "[[" not in query.expr, query
        assert 'instance=~"localhost:9464"' in query.expr
        assert 'cache=~"(a|b)"' in query.expr
        for opening, closing in ("()", "{}", "[]"):
            assert query.expr.count(opening) == query.expr.count(closing), query
        assert query.expr.count('"') % 2 == 0, query
    assert any("[4s]" in q.expr for q in queries)
    assert any(q.expr.startswith("histogram_quantile(0.99,") for q in queries)

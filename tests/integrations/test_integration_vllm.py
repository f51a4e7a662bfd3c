"""MMCacheECConnector against vLLM 0.33.0: built by vLLM's ECConnectorFactory, sharing encoder
outputs between a producer and a consumer through a real redis-server, bit-exact."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

# vLLM picks its platform once, on first use: its CPU platform here (no GPU, no CUDA build).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip(
    "redis", reason="the redis package is not installed: pip install 'mmcache[remote]'"
)
pytest.importorskip(
    "vllm.distributed.ec_transfer.ec_connector.factory",
    reason="vllm 0.33.0 is not importable here: bash scripts/install_vllm.sh installs it",
)

from redis_server import free_port
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, ensure_ec_transfer_shutdown
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

from mmcache import CopyFailedError
from mmcache.integrations import IntegrationError
from mmcache.integrations.vllm import (
    MAX_PENDING_SAVES,
    LoadItem,
    MMCacheECConnector,
    MMCacheECConnectorMetadata,
    MMCacheECConnectorStats,
    MMCacheECWorkerMetadata,
)

pytestmark = pytest.mark.vllm

Make = Callable[..., MMCacheECConnector]


def vllm_config(role: str, **extra: Any) -> VllmConfig:
    """A VllmConfig as `vllm serve --ec-transfer-config` builds it (no model loaded: the
    model's name comes in the connector's extra config)."""
    extra = {"device": "sim", "gpu_cache_mb": 4, "cpu_cache_mb": 4, "model": "org/vlm-7b", **extra}
    transfer = ECTransferConfig(
        ec_connector="MMCacheECConnector",
        ec_connector_module_path="mmcache.integrations.vllm",
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config=extra,
    )
    if role != "ec_producer":
        return VllmConfig(ec_transfer_config=transfer)
    # vLLM refuses a producer-only config without a multimodal model loaded, which a CPU
    # machine cannot do: the config is validated as ec_both, then given the producer's.
    config = VllmConfig(ec_transfer_config=dataclasses.replace(transfer, ec_role="ec_both"))
    config.ec_transfer_config = transfer
    return config


@pytest.fixture
def make() -> Iterator[Make]:
    """Connectors made through vLLM's factory, shut down after the test."""
    made: list[ECConnectorBase] = []

    def build(role: str, side: ECConnectorRole, **extra: Any) -> MMCacheECConnector:
        connector = ECConnectorFactory.create_connector(vllm_config(role, **extra), side)
        made.append(connector)
        assert isinstance(connector, MMCacheECConnector)
        return connector

    yield build
    for connector in made:
        connector.shutdown()


def request(request_id: str, *hashes: str) -> Any:
    """A request as the scheduler passes it: its id and its items' MultiModalFeatureSpecs."""
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=h,
            mm_position=PlaceholderRange(offset=4 + 100 * i, length=16),
        )
        for i, h in enumerate(hashes)
    ]
    return types.SimpleNamespace(request_id=request_id, mm_features=features)


def schedule(scheduler: MMCacheECConnector, req: Any) -> SchedulerOutput:
    """One scheduler step for req as vLLM's Scheduler drives the connector: its metadata."""
    assert scheduler.ensure_cache_available(req, 0)
    for index, feature in enumerate(req.mm_features):
        if scheduler.has_cache_item(feature.identifier):
            scheduler.update_state_after_alloc(req, index)
    output = SchedulerOutput.make_empty()
    output.ec_connector_metadata = scheduler.build_connector_meta(output)
    return output


def run_worker_step(output: SchedulerOutput, encoder_cache: dict[str, torch.Tensor]) -> Any:
    """The model runner's EC step (vLLM's own mixin) on the process's worker connector."""
    with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
        output, encoder_cache
    ) as connector_output:
        pass
    return connector_output


def test_the_connector_implements_every_abstract_method() -> None:
    assert not MMCacheECConnector.__abstractmethods__
    assert issubclass(MMCacheECConnector, ECConnectorBase)


def test_a_consumer_loads_what_a_producer_saved_bit_exact(make: Make, redis_url: str) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    outputs = {
        "img-a": torch.randn(16, 64, dtype=torch.bfloat16),
        "img-b": torch.randn(8, 32, 2)[:, :, 0],  # a view, as a split batch output is
    }
    expected = {h: t.clone() for h, t in outputs.items()}
    for mm_hash in outputs:
        producer.save_caches(outputs, mm_hash)
    producer.flush(10)
    req = request("req-1", "img-a", "img-b", "img-missing")

    output = schedule(scheduler, req)
    meta = output.ec_connector_metadata
    assert isinstance(meta, MMCacheECConnectorMetadata)
    assert [item.mm_hash for item in meta.loads] == ["img-a", "img-b"]

    config = vllm_config("ec_consumer", remote_url=redis_url)
    ensure_ec_transfer_initialized(config)  # vLLM's worker-side construction, by the factory
    try:
        encoder_cache: dict[str, torch.Tensor] = {}
        connector_output = run_worker_step(output, encoder_cache)
    finally:
        ensure_ec_transfer_shutdown()
    assert sorted(encoder_cache) == ["img-a", "img-b"]
    for mm_hash, tensor in encoder_cache.items():
        assert tensor.dtype == expected[mm_hash].dtype
        assert torch.equal(tensor, expected[mm_hash])
    assert connector_output.finished_recving == {"req-1"}
    assert connector_output.ec_connector_worker_meta is None
    stats = scheduler.get_ec_connector_stats()
    assert isinstance(stats, MMCacheECConnectorStats)
    assert stats.reduce()["lookups"] == 3 and stats.reduce()["lookup_hits"] == 2


def test_the_namespace_is_the_model(make: Make, redis_url: str) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    other_model = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url, model="x")
    same_model = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    producer.save_caches({"h": torch.ones(4, 4)}, "h")
    producer.flush(10)
    assert same_model.has_cache_item("h")
    assert not other_model.has_cache_item("h")


def test_an_output_gone_before_the_load_fails_only_its_request(make: Make, redis_url: str) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    consumer = make("ec_consumer", ECConnectorRole.WORKER, remote_url=redis_url)
    producer.save_caches({"kept": torch.ones(4, 4), "gone": torch.zeros(4, 4)}, "kept")
    producer.save_caches({"kept": torch.ones(4, 4), "gone": torch.zeros(4, 4)}, "gone")
    producer.flush(10)
    a, b = request("req-a", "kept"), request("req-b", "gone")
    scheduler.ensure_cache_available(a, 0)
    scheduler.ensure_cache_available(b, 0)
    scheduler.update_state_after_alloc(a, 0)
    scheduler.update_state_after_alloc(b, 0)
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    import redis

    client = redis.Redis.from_url(redis_url)
    client.delete(producer.cache.remote_key(producer.cache_key("gone")))  # type: ignore[union-attr]
    client.close()

    encoder_cache: dict[str, torch.Tensor] = {}
    consumer.bind_connector_metadata(meta)
    consumer.start_load_caches(encoder_cache)
    assert consumer.get_finished(set()) == (None, {"req-a"})
    worker_meta = consumer.build_connector_worker_meta()
    consumer.clear_connector_metadata()
    assert list(encoder_cache) == ["kept"]
    scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker_meta))
    assert scheduler.take_unavailable_requests() == {"req-b"}
    assert scheduler.take_unavailable_requests() == set()


def test_a_down_server_answers_false_quickly_and_never_raises(make: Make) -> None:
    url = f"redis://127.0.0.1:{free_port()}"  # nobody listens there
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=url)
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=url)
    producer.save_caches({"h": torch.ones(4, 4)}, "h")  # kept locally, not shared
    producer.flush(10)
    started = time.monotonic()
    for i in range(50):
        req = request(f"r{i}", f"h{i}", "h")
        output = schedule(scheduler, req)
        meta = output.ec_connector_metadata
        assert isinstance(meta, MMCacheECConnectorMetadata) and meta.loads == []
    assert time.monotonic() - started < 2 * scheduler._settings.remote_timeout_sec + 1
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None and stats.reduce()["lookup_hits"] == 0
    # Backed off: far fewer attempts than lookups.
    assert 1 <= stats.reduce()["lookup_errors"] < 50


def test_a_slow_server_answers_within_the_timeout(make: Make) -> None:
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}"
        scheduler = make(
            "ec_consumer", ECConnectorRole.SCHEDULER, remote_url=url, remote_timeout_sec=0.2
        )
        started = time.monotonic()
        assert not scheduler.has_cache_item("h")
        assert time.monotonic() - started < 1.5


def test_without_a_remote_server_nothing_is_shared(make: Make) -> None:
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER)
    assert not scheduler.has_cache_item("h")


def test_a_consumer_only_instance_saves_nothing(make: Make, redis_url: str) -> None:
    consumer = make("ec_consumer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    consumer.save_caches({"h": torch.ones(4, 4)}, "h")
    consumer.flush(10)
    assert not scheduler.has_cache_item("h")


def test_bad_extra_config_is_a_clear_error() -> None:
    from mmcache import SettingsError

    with pytest.raises(SettingsError, match="gpu_cache_mbb"):
        ECConnectorFactory.create_connector(
            vllm_config("ec_both", gpu_cache_mbb=1), ECConnectorRole.WORKER
        )


@pytest.mark.parametrize("side", [ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER])
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://h:notaport", "port 'notaport' is not a port number"),
        ("redis://h:99999", "port '99999' is not a port number"),
        ("redis+cluster://a:7000,b", "cluster node 'b' is not host:port"),
    ],
)
def test_a_bad_remote_url_in_extra_config_is_an_error_naming_the_key(
    side: ECConnectorRole, url: str, reason: str
) -> None:
    from mmcache import SettingsError

    with pytest.raises(SettingsError, match=re.escape(f"remote_url={url!r} is invalid: {reason}")):
        ECConnectorFactory.create_connector(vllm_config("ec_both", remote_url=url), side)


def test_stats_aggregate_and_reach_prometheus(make: Make) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    class _Counter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)  # vLLM's own registry: not in this test
            super().__init__(*args, **kwargs)

    a = MMCacheECConnector.build_ec_connector_stats({"loads": 2, "load_bytes": 10})
    b = MMCacheECConnector.build_ec_connector_stats({"loads": 1})
    assert a is not None and b is not None
    total = a.aggregate(b)
    assert total.reduce()["loads"] == 3 and not total.is_empty()
    prom = MMCacheECConnector.build_prom_metrics(
        vllm_config("ec_both"),
        {Gauge: Gauge, Counter: _Counter, Histogram: Histogram},
        ["engine"],
        {0: ["0"]},
    )
    assert prom is not None
    prom.observe(total.data, 0)
    assert registry.get_sample_value("vllm:mmcache_ec_loads_total", {"engine": "0"}) == 3


def test_save_caches_returns_while_the_cache_loop_is_busy(make: Make, redis_url: str) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    release = threading.Event()
    producer._loop.loop.call_soon_threadsafe(release.wait, 10)  # the loop is held up
    try:
        started = time.monotonic()
        outputs = {f"h{i}": torch.full((4, 4), float(i)) for i in range(MAX_PENDING_SAVES + 3)}
        for mm_hash in outputs:
            producer.save_caches(outputs, mm_hash)
        assert time.monotonic() - started < 1
    finally:
        release.set()
    producer.flush(10)
    stats = producer.get_ec_connector_stats()
    assert stats is not None
    # Past MAX_PENDING_SAVES waiting on the loop, saves are dropped, not queued without bound.
    assert stats.reduce()["saves"] == MAX_PENDING_SAVES
    assert stats.reduce()["save_failures"] == 3


def test_a_requests_items_are_asked_in_one_batch_per_step(
    make: Make, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    batches: list[list[str]] = []
    ask = scheduler._ask

    def counted(ids: list[str]) -> list[bool]:
        batches.append(ids)
        return ask(ids)

    monkeypatch.setattr(scheduler, "_ask", counted)
    schedule(scheduler, request("r", "a", "b", "c"))
    assert batches == [["a", "b", "c"]]
    schedule(scheduler, request("r", "a", "b", "c"))  # a new step asks again
    assert len(batches) == 2


NOT_MM_HASHES = [
    pytest.param(None, id="None"),
    pytest.param(["h"], id="list"),
    pytest.param(5, id="int"),
    pytest.param(b"h", id="bytes"),
    pytest.param(("h",), id="tuple"),
    pytest.param("x" * (2 * 1024 * 1024), id="str-over-1MiB"),
]


@pytest.mark.parametrize("identifier", NOT_MM_HASHES)
@pytest.mark.parametrize("remote", [True, False], ids=["remote", "no-remote"])
def test_an_identifier_that_is_not_an_mm_hash_is_not_cached(
    make: Make, redis_url: str, identifier: Any, remote: bool
) -> None:
    extra = {"remote_url": redis_url} if remote else {}
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, **extra)
    producer.save_caches({"h": torch.ones(4, 4)}, "h")
    producer.flush(10)
    assert scheduler.has_cache_item(identifier) is False
    req = request("r", "h", identifier)
    output = schedule(scheduler, req)  # ensure_cache_available, has_cache_item, alloc
    meta = output.ec_connector_metadata
    assert isinstance(meta, MMCacheECConnectorMetadata)
    assert [(i.mm_hash, i.request_id) for i in meta.loads] == ([("h", "r")] if remote else [])
    stats = scheduler.get_ec_connector_stats()
    if remote:  # the good item was asked; the bad one never was
        assert stats is not None and stats.reduce()["lookups"] == 1
        assert stats.reduce()["lookup_hits"] == 1 and stats.reduce()["lookup_errors"] == 0


def load_step(consumer: MMCacheECConnector, loads: list[Any]) -> tuple[Any, set[str], list[str]]:
    """One worker step that loads loads: (its finished loads, its unavailable requests, the
    outputs it put into the encoder cache)."""
    encoder_cache: dict[str, torch.Tensor] = {}
    consumer.bind_connector_metadata(MMCacheECConnectorMetadata(loads))
    try:
        consumer.start_load_caches(encoder_cache)
        finished = consumer.get_finished(set())[1]
        worker_meta = consumer.build_connector_worker_meta()
    finally:
        consumer.clear_connector_metadata()
    unavailable = (
        worker_meta.unavailable if isinstance(worker_meta, MMCacheECWorkerMetadata) else set()
    )
    return finished, unavailable, sorted(encoder_cache)


def test_a_malformed_load_item_fails_only_its_own_request(make: Make, redis_url: str) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    consumer = make("ec_consumer", ECConnectorRole.WORKER, remote_url=redis_url)
    for mm_hash in ("a", "b"):
        producer.save_caches({mm_hash: torch.full((4, 4), float(ord(mm_hash)))}, mm_hash)
    producer.flush(10)
    bad: list[Any] = [
        LoadItem(["a"], "r-list"),  # type: ignore[arg-type]
        LoadItem(None, "r-none"),  # type: ignore[arg-type]
        LoadItem(5, "r-int"),  # type: ignore[arg-type]
        LoadItem("x" * (2 * 1024 * 1024), "r-long"),
        ("a", "r-tuple"),  # not a LoadItem: no request to report
        LoadItem("a", None),  # type: ignore[arg-type]
    ]
    loads = [LoadItem("a", "r1"), *bad, LoadItem("b", "r2")]
    finished, unavailable, loaded = load_step(consumer, loads)
    assert loaded == ["a", "b"]
    assert finished == {"r1", "r2"}
    assert unavailable == {"r-list", "r-none", "r-int", "r-long"}
    stats = consumer.get_ec_connector_stats()
    assert stats is not None
    assert stats.reduce()["loads"] == 2 and stats.reduce()["load_misses"] == 6


def test_a_failed_batch_load_misses_only_the_outputs_that_fail(
    make: Make, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    consumer = make("ec_consumer", ECConnectorRole.WORKER, remote_url=redis_url)
    for mm_hash in ("a", "b", "c"):
        producer.save_caches({mm_hash: torch.full((4, 4), float(ord(mm_hash)))}, mm_hash)
    producer.flush(10)
    cache = consumer.cache
    assert cache is not None
    poison = consumer.cache_key("b")
    get, get_many = cache.get, cache.get_many

    async def failing_get(key: Any, **kwargs: Any) -> torch.Tensor | None:
        if key == poison:
            raise CopyFailedError("the copy of b failed")
        return await get(key, **kwargs)

    async def failing_get_many(keys: Any, **kwargs: Any) -> list[torch.Tensor | None]:
        keys = list(keys)
        if poison in keys:
            raise CopyFailedError("the copy of b failed")
        return await get_many(keys, **kwargs)

    monkeypatch.setattr(cache, "get", failing_get)
    monkeypatch.setattr(cache, "get_many", failing_get_many)
    loads = [LoadItem("a", "r1"), LoadItem("b", "r2"), LoadItem("c", "r3")]
    finished, unavailable, loaded = load_step(consumer, loads)
    assert loaded == ["a", "c"] and finished == {"r1", "r3"} and unavailable == {"r2"}


def test_metadata_of_another_connector_is_a_clear_error(make: Make, redis_url: str) -> None:
    consumer = make("ec_consumer", ECConnectorRole.WORKER, remote_url=redis_url)

    class Other(ECConnectorMetadata):
        pass

    consumer.bind_connector_metadata(Other())
    with pytest.raises(IntegrationError, match="MMCacheECConnectorMetadata"):
        consumer.start_load_caches({})
    consumer.clear_connector_metadata()


def test_a_bad_save_is_counted_and_loses_no_other_save(
    make: Make, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_consumer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    encoder_cache: dict[Any, Any] = {
        "a": torch.ones(4, 4),
        "b": torch.zeros(4, 4),
        "none": None,
        "list": [1.0, 2.0],
        5: torch.ones(2, 2),
        ("a",): torch.ones(2, 2),
    }
    bad: list[Any] = ["missing", ["a"], None, 5, ("a",), "none", "list"]
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        producer.save_caches(encoder_cache, "a")
        for mm_hash in bad:
            producer.save_caches(encoder_cache, mm_hash)  # raises nothing
        producer.save_caches(encoder_cache, "b")
    producer.flush(10)
    assert caplog.text.count("MMCacheECConnector: not saving") == len(bad)
    stats = producer.get_ec_connector_stats()
    assert stats is not None
    assert stats.reduce()["saves"] == 2 and stats.reduce()["save_failures"] == len(bad)
    assert scheduler.has_cache_item("a") and scheduler.has_cache_item("b")


def test_a_producer_only_scheduler_never_answers_cached(make: Make, redis_url: str) -> None:
    """vLLM neither encodes an item that has_cache_item answers True for nor, on a
    producer-only instance, loads it: the answer must be False, as the server is not asked."""
    producer = make("ec_producer", ECConnectorRole.WORKER, remote_url=redis_url)
    scheduler = make("ec_producer", ECConnectorRole.SCHEDULER, remote_url=redis_url)
    producer.save_caches({"h": torch.ones(4, 4)}, "h")
    producer.flush(10)
    assert not scheduler.is_consumer
    assert scheduler.has_cache_item("h") is False
    output = schedule(scheduler, request("r", "h"))
    meta = output.ec_connector_metadata
    assert isinstance(meta, MMCacheECConnectorMetadata) and meta.loads == []
    assert scheduler.get_ec_connector_stats() is None  # nothing asked of the server


def test_a_scheduler_logs_an_outage_when_it_starts_and_when_it_ends(
    make: Make, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from redis_server import RedisServer, require_server

    require_server()
    server = RedisServer(tmp_path)  # not started yet: the server is down
    scheduler = make(
        "ec_consumer", ECConnectorRole.SCHEDULER, remote_url=server.url, remote_timeout_sec=0.2
    )
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        for i in range(10):  # several back-offs, each ended by a failed retry
            schedule(scheduler, request(f"r{i}", f"h{i}"))
            time.sleep(0.06)
        down = [r.getMessage() for r in caplog.records if r.name == "mmcache"]
        assert len(down) == 1 and "ConnectionError" in down[0], down
        server.start()
        try:
            deadline = time.monotonic() + 15
            while len([r for r in caplog.records if r.name == "mmcache"]) < 2:
                assert time.monotonic() < deadline, "the scheduler never logged the recovery"
                schedule(scheduler, request("r", "h"))
                time.sleep(0.05)
        finally:
            server.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "mmcache"]
    assert len(logged) == 2 and "back after" in logged[1], logged

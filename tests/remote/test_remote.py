"""The remote tier: caches as nodes share features through a real redis-server, bit-exact."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "redis", reason="the redis package is not installed: pip install 'mmcache[remote]'"
)

import redis.asyncio
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, put_feature
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache

pytestmark = pytest.mark.usefixtures("redis_url")

Node = Callable[..., FeatureCache]


@pytest.fixture
def node(make_cache: CacheFactory, redis_url: str) -> Node:
    """A cache standing for one serving node on the test's server."""

    def make(gpu_mb: float = 1, cpu_mb: float = 4, **settings: Any) -> FeatureCache:
        settings.setdefault("remote_url", redis_url)
        return make_cache(gpu_mb, cpu_mb, **settings)

    return make


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client of the test's server, to look at and tamper with what is stored."""
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
@pytest.mark.parametrize("shape", [(4096,), (64, 128), (8, 16, 32), ()])
async def test_two_nodes_share_a_feature_bit_exact(
    rig: Rig, node: Node, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    a, b = node(), node()
    value = (torch.randn(shape) * 100).to(dtype)
    want = value.clone()
    assert await a.put("image", value if rig.kind == "sim" else value.to(rig.device.name))
    del value
    await a.drain()
    assert "image" not in b
    assert_exact(await b.get("image", device="cpu"), want)
    assert "image" in b  # landed locally: the next get is a local hit
    assert_exact(await b.get("image"), want)
    s = b.stats()
    assert (s.remote_hits, s.remote_read_bytes, s.misses) == (1, want.nbytes, 0)
    assert s.hits_cpu + s.hits_gpu == 2
    assert a.stats().remote_written_bytes == want.nbytes
    await b.drain()
    assert b.stats().leaked_bytes == 0


async def test_a_remote_hit_is_uploaded_and_promoted_as_a_host_hit(rig: Rig, node: Node) -> None:
    a, b = node(), node()
    want = await put_feature(a, rig, "k", 64)
    await a.drain()
    got = await b.get("k")
    assert got is not None and rig.device.is_device_tensor(got)
    assert_exact(got, want)
    s = b.stats()
    # Promoted, it keeps its host copy: counted in both tiers (inclusive).
    assert (s.hits_cpu, s.promotions, s.gpu_entries, s.cpu_entries) == (1, 1, 1, 1)


async def test_members_of_put_many_and_put_split_are_shared_per_key(rig: Rig, node: Node) -> None:
    a, b = node(), node()
    parts = [feature(rig, 4, seed=i) for i in range(3)]
    wants = [p.cpu().clone() for p in parts]
    assert await a.put_many([(("many", i), p) for i, p in enumerate(parts)])
    del parts
    batch = feature(rig, 12, seed=9)
    split_want = batch.cpu().clone()
    assert await a.put_split([("split", i) for i in range(3)], batch, [2, 4, 6])
    del batch
    await a.drain()
    for i, want in enumerate(wants):
        assert_exact(await b.get(("many", i), device="cpu"), want)
    assert_exact(await b.get(("split", 1)), split_want[2:6])
    assert b.stats().remote_hits == 4


async def test_a_cache_with_its_gpu_tier_off_shares_through_the_host_tier(
    rig: Rig, node: Node
) -> None:
    a = node(gpu_mb=0)
    want = await put_feature(a, rig, "k", 16)
    await a.drain()
    b = node(gpu_mb=0)
    assert_exact(await b.get("k", device="cpu"), want)
    assert_exact(await b.get("k"), want)


async def test_a_miss_everywhere_is_a_miss(node: Node) -> None:
    b = node()
    assert await b.get("nowhere") is None
    s = b.stats()
    assert (s.misses, s.remote_misses, s.remote_hits) == (1, 1, 0)


async def test_get_many_asks_the_remote_tier_for_what_both_local_tiers_miss(
    rig: Rig, node: Node
) -> None:
    a, b = node(), node()
    want = {key: await put_feature(a, rig, key, 16, seed=i) for i, key in enumerate("xyz")}
    await a.drain()
    local = await put_feature(b, rig, "local", 16, seed=9)
    got = await b.get_many(["x", "local", "nowhere", "z", "x"])
    assert_exact(got[0], want["x"])
    assert_exact(got[1], local)
    assert got[2] is None
    assert_exact(got[3], want["z"])
    assert_exact(got[4], want["x"])
    s = b.stats()
    assert (s.remote_hits, s.remote_misses, s.misses) == (2, 1, 1)
    del got
    await b.drain()
    assert b.stats().leaked_bytes == 0


async def test_concurrent_gets_of_one_key_share_one_fetch(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a, b = node(), node()
    want = await put_feature(a, rig, "popular", 256)
    await a.drain()
    await raw.config_resetstat()
    got = await asyncio.gather(*(b.get("popular", device="cpu") for _ in range(8)))
    for g in got:
        assert_exact(g, want)
    s = b.stats()
    assert s.remote_hits == 1 and s.remote_read_bytes == want.nbytes
    assert (await raw.info("commandstats"))["cmdstat_get"]["calls"] == 1  # one GET reached it


async def test_get_or_compute_takes_the_remote_value_instead_of_computing(
    rig: Rig, node: Node
) -> None:
    a, b = node(), node()
    want = await put_feature(a, rig, "enc", 16)
    await a.drain()
    calls = 0

    def encode() -> torch.Tensor:
        nonlocal calls
        calls += 1
        return feature(rig, 16, seed=5)

    assert_exact(await b.get_or_compute("enc", encode), want)
    assert calls == 0
    await b.get_or_compute("other", encode)
    await b.drain()
    assert calls == 1
    c = node()
    assert_exact(await c.get("other", device="cpu"), feature(rig, 16, seed=5).cpu())


async def test_namespaces_keep_tenants_apart(rig: Rig, node: Node) -> None:
    a = node(remote_namespace="model-a")
    other = node(remote_namespace="model-b")
    same = node(remote_namespace="model-a")
    want = await put_feature(a, rig, "k", 8)
    await a.drain()
    assert await other.get("k") is None
    assert_exact(await same.get("k", device="cpu"), want)
    assert a.remote_key("k") != other.remote_key("k")


async def test_values_expire_after_remote_ttl_sec(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a = node(remote_ttl_sec=0.3)
    await put_feature(a, rig, "short-lived", 8)
    await a.drain()
    ttl_ms = await raw.pttl(a.remote_key("short-lived"))
    assert 0 < ttl_ms <= 300
    await asyncio.sleep(0.5)
    assert await node().get("short-lived") is None


async def test_values_expire_after_an_hour_by_default_and_never_with_no_ttl(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a = node()
    await put_feature(a, rig, "default", 8)
    await a.drain()
    assert 3_500_000 < await raw.pttl(a.remote_key("default")) <= 3_600_000
    b = node(remote_ttl_sec=None)
    await put_feature(b, rig, "kept", 8)
    await b.drain()
    assert await raw.pttl(b.remote_key("kept")) == -1


async def test_the_longest_ttl_settings_take_is_one_the_server_takes(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a = node(remote_ttl_sec=9e15)  # the bound CacheSettings checks
    await put_feature(a, rig, "long-lived", 8)
    await a.drain()
    assert a.stats().remote_errors == 0
    assert await raw.pttl(a.remote_key("long-lived")) > 8.9e18


async def test_remote_write_evict_writes_only_what_leaves_the_host_tier(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a = node(gpu_mb=0.25, cpu_mb=0.25, remote_write="evict")
    wants = [await put_feature(a, rig, ("f", i), 64, seed=i) for i in range(10)]
    await a.drain()
    stored = [i for i in range(10) if await raw.exists(a.remote_key(("f", i)))]
    resident = [i for i in range(10) if ("f", i) in a]
    assert stored and set(stored).isdisjoint(resident)
    assert a.stats().evictions_cpu == len(stored)
    b = node()
    for i in stored:
        assert_exact(await b.get(("f", i), device="cpu"), wants[i])


async def test_remote_write_off_reads_but_never_writes(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    writer = node()
    want = await put_feature(writer, rig, "shared", 8)
    await writer.drain()
    reader = node(remote_write="off")
    await put_feature(reader, rig, "local-only", 8)
    await reader.drain()
    assert not await raw.exists(reader.remote_key("local-only"))
    assert_exact(await reader.get("shared", device="cpu"), want)


async def test_remote_key_is_namespace_and_a_stable_encoding(make_cache: CacheFactory) -> None:
    cache = make_cache(remote_namespace="ns")
    keys: list[Any] = [1, "1", b"1", (1,), ("1",), (1, 2), ((1,), 2), (1, (2,)), True, ""]
    encoded = [cache.remote_key(k) for k in keys]
    assert all(e.startswith(b"2:ns:") for e in encoded)
    # Equal keys (True == 1 in a dict) meet; distinct ones never do.
    assert encoded[0] == encoded[8]
    assert len(set(encoded)) == len(keys) - 1
    assert cache.remote_key(("img", 3)) == b"2:ns:t2(s3:imgi3;)"  # the same in every process
    long = cache.remote_key("x" * 10_000)
    assert len(long) < 100 and long == cache.remote_key("x" * 10_000)


async def test_remote_metrics_count_hits_misses_and_bytes(rig: Rig, redis_url: str) -> None:
    registry = CollectorRegistry()
    settings = CacheSettings(gpu_cache_mb=1, cpu_cache_mb=4, remote_url=redis_url)
    async with (
        FeatureCache(settings, device=rig.device, name="a", registry=registry) as a,
        FeatureCache(settings, device=rig.device, name="b", registry=registry) as b,
    ):
        want = await put_feature(a, rig, "k", 16)
        await a.drain()
        await b.get("k")
        await b.get("absent")

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert value("mmcache_remote_lookups_total", cache="b", result="hit") == 1
        assert value("mmcache_remote_lookups_total", cache="b", result="miss") == 1
        assert value("mmcache_remote_bytes_total", cache="b", direction="read") == want.nbytes
        assert value("mmcache_remote_bytes_total", cache="a", direction="written") == want.nbytes
        assert value("mmcache_remote_queued_bytes", cache="a") == 0
        assert value("mmcache_remote_seconds_count", cache="b", op="get") == 2
        assert value("mmcache_remote_errors_total", cache="b", kind="timeout") == 0
    assert value("mmcache_remote_lookups_total", cache="b", result="hit") is None  # closed


SMALL_DEMO = ["demo", "--device", "sim", "--requests", "12", "--seed", "1", "--hidden", "256"]
SMALL_DEMO += ["--gpu-mb", "64", "--cpu-mb", "128", "--images", "40", "--quiet"]


def test_demo_with_a_remote_url_shows_remote_hits(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmcache.cli import main

    assert main([*SMALL_DEMO, "--remote-url", redis_url]) == 0
    first = capsys.readouterr().out
    assert "remote hits / misses" in first and first.rstrip().endswith("0 bytes leaked")
    faults = first.split("remote errors / rejected / dropped writes", 1)[1].split("\n")[0]
    assert faults.split() == ["0", "/", "0", "/", "0"]
    assert main([*SMALL_DEMO, "--remote-url", redis_url]) == 0  # a second node, as it were
    second = capsys.readouterr().out
    hits = second.split("remote hits / misses", 1)[1].split()[0]
    encodes = second.split("encodes (re-encodes)", 1)[1].split()[0]
    assert int(hits) > 0 and encodes == "0"  # every feature came from the first run's writes
    assert "PASS" in second


async def test_a_unix_socket_url_and_a_password_in_the_url_work(
    rig: Rig, make_cache: CacheFactory, tmp_path: Path
) -> None:
    from redis_server import redis_server

    socket_path = tmp_path / "redis.sock"
    with redis_server("--unixsocket", str(socket_path), "--requirepass", "s3cret") as server:
        tcp = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        unix = f"unix://:s3cret@{socket_path}?db=0"
        a, b = make_cache(remote_url=tcp), make_cache(remote_url=unix)
        want = await put_feature(a, rig, "k", 16)
        await a.drain()
        assert_exact(await b.get("k", device="cpu"), want)
        wrong = make_cache(remote_url=f"redis://:wrong@127.0.0.1:{server.port}/0")
        assert await wrong.get("k") is None  # refused: an error counted, a miss
        assert wrong.stats().remote_errors == 1


def test_passwords_in_the_url_are_never_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmcache.cli import main

    monkeypatch.setenv("MMCACHE_REMOTE_URL", "redis://user:s3cret@db.example:6379/0")
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "redis://user:***@db.example:6379/0" in out and "s3cret" not in out
    monkeypatch.setenv("MMCACHE_REMOTE_URL", "http://:s3cret@db.example:6379/0")
    assert main(["settings"]) == 1
    assert "s3cret" not in capsys.readouterr().err


async def test_features_larger_than_remote_max_value_mb_stay_local(
    rig: Rig, node: Node, raw: redis.asyncio.Redis
) -> None:
    a = node(remote_max_value_mb=0.1)
    await put_feature(a, rig, "small", 64)  # 64 KiB: written
    await put_feature(a, rig, "large", 128)  # 128 KiB: past 0.1 MiB, dropped
    await a.drain()
    assert await raw.exists(a.remote_key("small")) and not await raw.exists(a.remote_key("large"))
    assert a.stats().remote_dropped_writes == 1


def _certificates(directory: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 made with openssl; the CA's path."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificates for the TLS test")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=mmcache test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")  # fmt: skip
    return directory / "ca.crt"


async def test_a_rediss_url_shares_features_over_tls(
    rig: Rig, make_cache: CacheFactory, tmp_path: Path
) -> None:
    from redis_server import free_port, redis_server

    ca = _certificates(tmp_path)
    port = free_port()
    tls = ["--tls-port", str(port), "--tls-auth-clients", "no", "--tls-ca-cert-file", str(ca)]
    tls += ["--tls-cert-file", str(tmp_path / "server.crt")]
    tls += ["--tls-key-file", str(tmp_path / "server.key")]
    with redis_server(*tls):
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        a, b = make_cache(remote_url=url), make_cache(remote_url=url)
        want = await put_feature(a, rig, "k", 16)
        await a.drain()
        assert_exact(await b.get("k", device="cpu"), want)
        plain = make_cache(remote_url=f"redis://127.0.0.1:{port}/0", remote_timeout_sec=0.5)
        assert await plain.get("k") is None  # TLS port, no TLS: a fault, a miss
        assert plain.stats().remote_errors == 1


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ((), "the server has no memory limit (maxmemory 0)"),
        (("--maxmemory", "64mb", "--maxmemory-policy", "noeviction"), "evicts nothing"),
        (("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"), None),
    ],
)
async def test_a_server_that_can_fill_up_is_warned_of_at_start(
    make_cache: CacheFactory,
    redis_session: Any,
    caplog: pytest.LogCaptureFixture,
    options: tuple[str, ...],
    warned: str | None,
) -> None:
    from redis_server import redis_server

    with redis_server(*options, kind=redis_session.kind) as server:
        cache = make_cache(remote_url=server.url)
        await cache.start()
        assert cache._remote is not None and cache._remote._check is not None
        await asyncio.wait_for(cache._remote._check, 5)
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if warned is None:
            assert not logged
        else:
            assert len(logged) == 1 and warned in logged[0]
        await cache.close()

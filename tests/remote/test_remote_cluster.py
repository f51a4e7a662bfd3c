"""The remote tier on a cluster of three nodes (redis+cluster://), keys spread by slot."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import CacheFactory, Rig, assert_exact, put_feature
from redis_server import SERVER_KINDS, RedisServer, redis_cluster, require_server


@pytest.fixture(scope="module", params=SERVER_KINDS)
def cluster(request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    """A 3-node cluster of Redis, then of Valkey."""
    require_server(request.param)
    with redis_cluster(3, kind=request.param) as servers:
        yield servers


def _url(servers: list[RedisServer]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


async def test_two_nodes_share_features_through_a_cluster(
    rig: Rig, make_cache: CacheFactory, cluster: list[RedisServer]
) -> None:
    for server in cluster:
        server.cli("FLUSHALL")
    a = make_cache(gpu_mb=4, remote_url=_url(cluster))
    b = make_cache(gpu_mb=4, remote_url=_url(cluster[1:]))  # any seed node will do
    wants = [await put_feature(a, rig, ("img", i), 16, seed=i) for i in range(30)]
    await a.drain()
    assert a.stats().remote_dropped_writes == 0
    for i, want in enumerate(wants):
        assert_exact(await b.get(("img", i), device="cpu"), want)
    assert b.stats().remote_hits == 30
    per_node = [int(server.cli("DBSIZE")) for server in cluster]
    assert sum(per_node) == 30 and min(per_node) > 0  # spread over every node by slot


async def test_a_cluster_node_down_makes_its_keys_miss_not_fail(
    rig: Rig, make_cache: CacheFactory, cluster: list[RedisServer]
) -> None:
    for server in cluster:
        server.cli("FLUSHALL")
    a = make_cache(gpu_mb=4, remote_url=_url(cluster), remote_timeout_sec=0.3)
    await put_feature(a, rig, "k", 16)
    await a.drain()
    victim = next(s for s in cluster if int(s.cli("DBSIZE")) == 1)
    victim.stop()
    try:
        b = make_cache(gpu_mb=4, remote_url=_url(cluster), remote_timeout_sec=0.3)
        assert await b.get("k") is None
        assert b.stats().remote_hits == 0
    finally:
        victim.start()

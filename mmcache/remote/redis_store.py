"""RedisStore: the RemoteStore on Redis or Valkey, one server or a cluster, through redis-py."""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Final, cast, final

from mmcache.errors import SettingsError
from mmcache.remote.store import WrongTypeError
from mmcache.settings import redact_url, split_cluster_url

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

__all__ = ["CLUSTER_SCHEMES", "SCHEMES", "RedisStore", "check_url"]

#: one server: TCP, TLS, or a Unix socket (redis-py's own URL forms)
SINGLE_SCHEMES: Final = ("redis", "rediss", "unix")
#: a cluster: comma-separated seed nodes, through redis-py's cluster client
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SCHEMES: Final = SINGLE_SCHEMES + CLUSTER_SCHEMES

# Deletes KEYS[1] only if it holds a string whose SHA-1 is ARGV[1]; one key, so it runs on
# a cluster too.
_DELETE_IF_SHA1: Final = """
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then
  return 0
end
local value = redis.call('GET', KEYS[1])
if value and redis.sha1hex(value) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def check_url(url: str) -> str:
    """url if its scheme is one the remote tier speaks; else ValueError saying which are."""
    scheme = url.partition("://")[0].lower()
    if "://" not in url or scheme not in SCHEMES:
        raise ValueError(
            f"must start with one of {', '.join(s + '://' for s in SCHEMES)} "
            "(e.g. redis://localhost:6379/0)"
        )
    if scheme in CLUSTER_SCHEMES:
        _seeds(split_cluster_url(url).nodes)
    return url


def _seeds(nodes: list[str]) -> list[tuple[str, int]]:
    """The (host, port) seed nodes of a cluster URL's host:port nodes."""
    seeds = []
    for item in nodes:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r} is not host:port")
        seeds.append((host.strip("[]"), int(port)))
    return seeds


def _import_redis() -> Any:
    try:
        import redis.asyncio
        import redis.asyncio.cluster
    except ImportError:
        raise SettingsError(
            "remote_url (MMCACHE_REMOTE_URL) is set but the redis package is not installed; "
            "pip install 'mmcache[remote]' (or redis>=5), or unset it"
        ) from None
    return redis


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _wrong_type(error: Exception) -> bool:
    """Whether a reply error says the key holds a value of another type."""
    return str(error).startswith("WRONGTYPE")


@final
class RedisStore:
    """Values under server keys in Redis/Valkey: STRLEN, GET, SET with PX, EXISTS, DEL.

    Connecting is bounded by timeout_s; a command by its caller (the remote tier gives
    one that moves a large value more time), not by the client, whose own socket timeout
    would bound every command alike. The client retries nothing itself, so a fault
    reaches the remote tier at once, which backs off.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        check_url(url)
        redis = _import_redis()
        self.url = redact_url(url)
        scheme = url.partition("://")[0].lower()
        self._response_error: type[Exception] = redis.exceptions.ResponseError
        options: dict[str, Any] = {
            "socket_timeout": None,
            "socket_connect_timeout": timeout_s,
            "retry": redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0),
        }
        self.client: Redis | RedisCluster
        if scheme in CLUSTER_SCHEMES:
            parts = split_cluster_url(url)
            query = dict(urllib.parse.parse_qsl(parts.query))
            self.client = redis.asyncio.cluster.RedisCluster(
                startup_nodes=[
                    redis.asyncio.cluster.ClusterNode(host, port)
                    for host, port in _seeds(parts.nodes)
                ],
                username=parts.username,
                password=parts.password,
                ssl=scheme == "rediss+cluster",
                ssl_cert_reqs=query.get("ssl_cert_reqs", "required"),
                ssl_ca_certs=query.get("ssl_ca_certs"),
                **options,
            )
        else:
            self.client = redis.asyncio.Redis.from_url(url, **options)

    async def size(self, key: bytes) -> int:
        """STRLEN key (0: none); WrongTypeError if key holds another type."""
        try:
            return int(await self.client.strlen(key))
        except self._response_error as e:
            if _wrong_type(e):
                raise WrongTypeError(f"the key holds another type ({e})") from None
            raise

    async def get(self, key: bytes) -> bytes | None:
        """The value stored under key, or None; WrongTypeError if key holds another type."""
        try:
            value = await self.client.get(key)
        except self._response_error as e:
            if _wrong_type(e):
                raise WrongTypeError(f"the key holds another type ({e})") from None
            raise
        return None if value is None else bytes(value)

    async def put(self, key: bytes, value: bytes | memoryview, ttl_s: float | None) -> None:
        """SET key value [PX ttl]."""
        px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        await self.client.set(key, value, px=px)

    async def memory_policy(self) -> tuple[int, str] | None:
        """The server's maxmemory (bytes; 0: no limit) and maxmemory-policy, or None where
        it does not say (CONFIG refused or renamed, as managed services do)."""
        try:
            config = await self.client.config_get("maxmemory*")
        except self._response_error:
            return None
        if config and all(isinstance(v, dict) for v in config.values()):
            config = next(iter(config.values()))  # answers per node: take one
        found = {_text(k): _text(v) for k, v in config.items()}
        limit, policy = found.get("maxmemory", ""), found.get("maxmemory-policy")
        if not limit.isdigit() or policy is None:
            return None
        return int(limit), policy

    async def exists(self, key: bytes) -> bool:
        """EXISTS key."""
        return bool(await self.client.exists(key))

    async def delete(self, key: bytes, only_if: bytes | None = None) -> None:
        """DEL key; with only_if, in one script that first compares the value's SHA-1 (so
        the rejected value is never sent back)."""
        if only_if is None:
            await self.client.delete(key)
            return
        digest = hashlib.sha1(only_if, usedforsecurity=False).hexdigest()
        # redis-py types eval for its sync and async clients alike, and keys as str.
        await cast(Awaitable[Any], self.client.eval(_DELETE_IF_SHA1, 1, key, digest))  # type: ignore[arg-type]

    async def close(self) -> None:
        """Close every connection of the client."""
        await self.client.aclose()

"""Remote values carry a header (magic, version, dtype, shape, length, the key's digest, and
a CRC-32 of the header and the payload); a value that fails any check is never served:
counted, deleted on the server, a miss. A value of another format version is a miss."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable

import pytest

pytest.importorskip(
    "redis", reason="the redis package is not installed: pip install 'mmcache[remote]'"
)

import redis.asyncio
import torch
from conftest import CacheFactory, Rig, assert_exact, put_feature

from mmcache.remote.codec import (
    MAGIC,
    OtherVersionError,
    RemoteValueError,
    encode_value,
    parse,
    server_key,
)

Corrupt = Callable[[bytearray], bytes]

KEY = server_key("ns", "k")
#: where the header's fields start (format 2)
DTYPE_AT, LENGTH_AT, DIGEST_AT, DIMS_AT = 6, 8, 16, 32


def _flip_payload(v: bytearray) -> bytes:
    v[-1] ^= 0x01
    return bytes(v)


def _set_u8(offset: int, value: int) -> Corrupt:
    def corrupt(v: bytearray) -> bytes:
        v[offset] = value
        return bytes(v)

    return corrupt


def _set_length(v: bytearray) -> bytes:
    struct.pack_into("<Q", v, LENGTH_AT, struct.unpack_from("<Q", v, LENGTH_AT)[0] - 4)
    return bytes(v)


def _set_dim(v: bytearray) -> bytes:
    struct.pack_into("<Q", v, DIMS_AT, 3)  # first dimension: 64 rows -> 3
    return bytes(v)


def _as_int32(v: bytearray) -> bytes:
    """float32 -> int32: the same byte count, another tensor."""
    v[DTYPE_AT] = 7
    return bytes(v)


def _transposed(v: bytearray) -> bytes:
    """(64, 16) -> (16, 64): the same byte count, another tensor."""
    rows, cols = struct.unpack_from("<QQ", v, DIMS_AT)
    struct.pack_into("<QQ", v, DIMS_AT, cols, rows)
    return bytes(v)


CORRUPTIONS: dict[str, Corrupt] = {
    "payload_bit": _flip_payload,
    "magic": _set_u8(0, ord("X")),
    "dtype": _set_u8(DTYPE_AT, 200),
    "dtype_same_size": _as_int32,
    "ndim": _set_u8(7, 40),
    "length": _set_length,
    "shape": _set_dim,
    "shape_same_size": _transposed,
    "key_digest": _set_u8(DIGEST_AT, 0),
    "checksum": _set_u8(DIMS_AT + 16, 0),
    "truncated": lambda v: bytes(v[:-10]),
    "extended": lambda v: bytes(v) + b"\0",
    "short": lambda v: bytes(v[:5]),
    "foreign": lambda v: b"not an mmcache value at all, but long enough to hold a header",
}


def test_encoded_values_parse_back_exactly() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn):
        t = (torch.randn(3, 5, 7) * 10).to(dtype)
        header, payload = parse(bytes(encode_value(t, KEY)), KEY)
        assert (header.dtype, header.shape, header.length) == (dtype, (3, 5, 7), t.nbytes)
        assert bytes(payload) == bytes(encode_value(t, KEY)[header.size :])
    assert bytes(encode_value(torch.arange(4, dtype=torch.int32), KEY))[:4] == MAGIC


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_every_check_refuses_a_corrupted_value(how: str) -> None:
    value = encode_value(torch.randn(64, 16), KEY)
    with pytest.raises(RemoteValueError):
        parse(CORRUPTIONS[how](value), KEY)


def test_a_header_that_keeps_the_byte_count_is_refused() -> None:
    """Damage to the dtype or the shape that keeps the length would serve another tensor."""
    value = encode_value(torch.randn(64, 16), KEY)
    for corrupt in (_as_int32, _transposed):
        with pytest.raises(RemoteValueError, match="checksum"):
            parse(corrupt(bytearray(value)), KEY)


def test_a_value_is_bound_to_the_key_it_was_written_under() -> None:
    value = bytes(encode_value(torch.randn(8, 4), KEY))
    parse(value, KEY)
    for other in (server_key("ns", "k2"), server_key("other", "k"), server_key("ns", ("k",))):
        with pytest.raises(RemoteValueError, match="another key"):
            parse(value, other)


def test_namespaces_and_keys_map_to_server_keys_one_to_one() -> None:
    assert server_key("n:s5", "ab") != server_key("n", "s2:ab")
    pairs = [
        (ns, key)
        for ns in ("", "n", "n:", ":n", "n:s5", "n:s2", "2:n", "mmcache", "mmcache:demo")
        for key in ("ab", "s2:ab", ":ab", "", 5, b"ab", ("ab",), ("n", "ab"))
    ]
    encoded = {server_key(ns, key): (ns, key) for ns, key in pairs}
    assert len(encoded) == len(pairs)


def test_a_value_of_another_format_version_is_an_other_version_error() -> None:
    value = bytearray(encode_value(torch.randn(8, 4), KEY))
    struct.pack_into("<H", value, 4, 1)  # the format before the key's digest
    with pytest.raises(OtherVersionError):
        parse(bytes(value), KEY)


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def stored_value(
    make_cache: CacheFactory, rig: Rig, url: str, raw: redis.asyncio.Redis
) -> tuple[bytes, bytes]:
    """Put a feature "k" through one cache; its server key and the value stored there."""
    writer = make_cache(remote_url=url)
    await put_feature(writer, rig, "k", 64)
    await writer.drain()
    rkey = writer.remote_key("k")
    stored = await raw.get(rkey)
    assert stored is not None
    return rkey, stored


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
async def test_a_corrupted_remote_value_is_rejected_deleted_and_missed(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis, how: str
) -> None:
    rkey, stored = await stored_value(make_cache, rig, redis_url, raw)
    await raw.set(rkey, CORRUPTIONS[how](bytearray(stored)))
    b = make_cache(remote_url=redis_url)
    assert await b.get("k") is None
    assert "k" not in b
    s = b.stats()
    assert (s.remote_rejected, s.remote_hits, s.misses, s.leaked_bytes) == (1, 0, 1, 0)
    await b.close()  # waits for the delete
    assert not await raw.exists(rkey)


async def test_a_good_value_after_a_rejected_one_is_served(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis
) -> None:
    rkey, good = await stored_value(make_cache, rig, redis_url, raw)
    await raw.set(rkey, _flip_payload(bytearray(good)))
    b = make_cache(remote_url=redis_url)
    assert await b.get("k") is None
    await raw.set(rkey, good)
    got = await b.get("k", device="cpu")
    header, payload = parse(good, rkey)
    assert_exact(got, torch.frombuffer(bytearray(payload), dtype=header.dtype).view(header.shape))


async def test_a_value_copied_under_another_key_is_rejected_there(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis
) -> None:
    rkey, stored = await stored_value(make_cache, rig, redis_url, raw)
    b = make_cache(remote_url=redis_url)
    await raw.set(b.remote_key("other"), stored)  # a bad migration, a buggy client
    assert await b.get("other") is None
    assert b.stats().remote_rejected == 1
    await b.close()  # waits for the delete
    assert not await raw.exists(b.remote_key("other"))
    assert await raw.get(rkey) == stored  # the original is untouched


async def test_namespaces_that_looked_alike_do_not_share_values(
    rig: Rig, make_cache: CacheFactory, redis_url: str
) -> None:
    a = make_cache(remote_url=redis_url, remote_namespace="n:s5")
    await put_feature(a, rig, "ab", 8)
    await a.drain()
    b = make_cache(remote_url=redis_url, remote_namespace="n")
    assert a.remote_key("ab") != b.remote_key("s2:ab")
    assert await b.get("s2:ab") is None
    assert b.stats().remote_hits == 0


async def test_a_key_of_another_type_is_one_keys_miss_not_a_server_fault(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis
) -> None:
    a = make_cache(remote_url=redis_url)
    want = await put_feature(a, rig, "good", 16)
    await a.drain()
    b = make_cache(remote_url=redis_url)
    # A hash: STRLEN and GET answer WRONGTYPE (redis-py types hset's key as str).
    await raw.hset(b.remote_key("hash").decode(), "field", "value")  # type: ignore[misc]
    assert await b.get("hash") is None
    assert_exact(await b.get("good", device="cpu"), want)  # not backed off: served at once
    s = b.stats()
    assert (s.remote_errors, s.remote_rejected, s.remote_hits) == (0, 1, 1)
    await b.close()  # waits for the delete
    assert not await raw.exists(b.remote_key("hash"))


async def test_a_value_of_another_format_version_is_a_counted_miss(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis
) -> None:
    rkey, stored = await stored_value(make_cache, rig, redis_url, raw)
    old = bytearray(stored)
    struct.pack_into("<H", old, 4, 1)
    await raw.set(rkey, bytes(old))
    b = make_cache(remote_url=redis_url)
    assert await b.get("k") is None
    s = b.stats()
    assert (s.remote_misses, s.remote_rejected, s.remote_errors, s.misses) == (1, 0, 0, 1)
    await b.close()
    assert await raw.get(rkey) == bytes(old)  # another version's: left for it

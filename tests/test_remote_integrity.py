"""Remote values carry a header (magic, version, dtype, shape, length, checksum); a value
that fails any check is never served: counted, deleted on the server, a miss."""

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

from mmcache.remote.codec import MAGIC, RemoteValueError, encode_value, parse

Corrupt = Callable[[bytearray], bytes]


def _flip_payload(v: bytearray) -> bytes:
    v[-1] ^= 0x01
    return bytes(v)


def _set_u8(offset: int, value: int) -> Corrupt:
    def corrupt(v: bytearray) -> bytes:
        v[offset] = value
        return bytes(v)

    return corrupt


def _set_length(v: bytearray) -> bytes:
    struct.pack_into("<Q", v, 8, struct.unpack_from("<Q", v, 8)[0] - 4)
    return bytes(v)


def _set_dim(v: bytearray) -> bytes:
    struct.pack_into("<Q", v, 20, 3)  # first dimension: 64 rows -> 3
    return bytes(v)


CORRUPTIONS: dict[str, Corrupt] = {
    "payload_bit": _flip_payload,
    "magic": _set_u8(0, ord("X")),
    "version": _set_u8(4, 99),
    "dtype": _set_u8(6, 200),
    "ndim": _set_u8(7, 40),
    "length": _set_length,
    "shape": _set_dim,
    "truncated": lambda v: bytes(v[:-10]),
    "extended": lambda v: bytes(v) + b"\0",
    "short": lambda v: bytes(v[:5]),
    "foreign": lambda v: b"not an mmcache value at all, but long enough to hold a header",
}


def test_encoded_values_parse_back_exactly() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn):
        t = (torch.randn(3, 5, 7) * 10).to(dtype)
        header, payload = parse(bytes(encode_value(t)))
        assert (header.dtype, header.shape, header.length) == (dtype, (3, 5, 7), t.nbytes)
        assert bytes(payload) == bytes(encode_value(t)[header.size :])
    assert bytes(encode_value(torch.arange(4, dtype=torch.int32)))[:4] == MAGIC


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_every_check_refuses_a_corrupted_value(how: str) -> None:
    value = encode_value(torch.randn(64, 16))
    with pytest.raises(RemoteValueError):
        parse(CORRUPTIONS[how](value))


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
    header, payload = parse(good)
    assert_exact(got, torch.frombuffer(bytearray(payload), dtype=header.dtype).view(header.shape))

"""A fuzzer over remote values: seeded mutations of the header and the body of real values.

Each mutation is decoded directly (FUZZ_MUTATIONS of them), and a share of them goes through
a real server and a cache (ROUND_TRIPS): a value is served as exactly the tensor that was
put under its key, or not at all. The same seed gives the same mutations on every run.
"""

from __future__ import annotations

import random
import struct
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

if TYPE_CHECKING:
    import redis.asyncio

from mmcache.remote.codec import RemoteValueError, encode_value, parse, server_key

SEED = 20261204
FUZZ_MUTATIONS = 3000
ROUND_TRIPS = 300
#: where the fields of a format-2 header start; the dimensions follow, then the CRC-32
DTYPE_AT, NDIM_AT, LENGTH_AT, DIGEST_AT, DIMS_AT = 6, 7, 8, 16, 32

SHAPES = [(64, 16), (16, 64), (1024,), (4, 4, 4), (), (2, 3, 5, 7), (0, 8)]
DTYPES = [torch.float32, torch.int32, torch.bfloat16, torch.float16, torch.uint8, torch.int64]


@dataclass(frozen=True)
class Original:
    """A value as the writer made it, under its server key, and the tensor it holds."""

    key: bytes
    tensor: torch.Tensor
    value: bytes

    @property
    def header_size(self) -> int:
        return len(self.value) - self.tensor.nbytes


def originals(rng: random.Random, namespace: str = "fuzz") -> list[Original]:
    made = []
    for i, shape in enumerate(SHAPES):
        dtype = rng.choice(DTYPES)
        g = torch.Generator().manual_seed(i)
        tensor = (torch.randn(shape, generator=g) * 100).to(dtype)
        key = server_key(namespace, ("img", i))
        made.append(Original(key, tensor, bytes(encode_value(tensor, key))))
    return made


def _flip_bit(v: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    if hi > lo:
        at = rng.randrange(lo, hi)
        v[at] ^= 1 << rng.randrange(8)


def mutate(item: Original, others: list[Original], rng: random.Random) -> bytes:
    """One seeded mutation of item's value: of its header, its payload, or the whole."""
    v = bytearray(item.value)
    head = item.header_size
    ndim = item.tensor.dim()
    how = rng.randrange(16)
    if how == 0:  # a bit of the header
        _flip_bit(v, 0, head, rng)
    elif how == 1:  # a bit anywhere
        _flip_bit(v, 0, len(v), rng)
    elif how == 2:  # a header byte set at random
        v[rng.randrange(head)] = rng.randrange(256)
    elif how == 3:  # another dtype code, of the same item size or not
        v[DTYPE_AT] = rng.randrange(20)
    elif how == 4:  # another number of dimensions
        v[NDIM_AT] = rng.randrange(40)
    elif how == 5:  # another length
        length = struct.unpack_from("<Q", v, LENGTH_AT)[0]
        struct.pack_into("<Q", v, LENGTH_AT, max(0, length + rng.choice([-4, -1, 1, 4, 1 << 40])))
    elif how == 6 and ndim:  # the dimensions permuted, or one scaled (its product kept or not)
        dims = list(struct.unpack_from(f"<{ndim}Q", v, DIMS_AT))
        if rng.random() < 0.5:
            rng.shuffle(dims)
        else:
            i = rng.randrange(ndim)
            j = rng.randrange(ndim)
            factor = rng.choice([2, 4])
            if dims[i] % factor == 0:
                dims[i] //= factor
                dims[j] *= factor
            else:
                dims[i] += 1
        struct.pack_into(f"<{ndim}Q", v, DIMS_AT, *dims)
    elif how == 7:  # the key's digest
        v[DIGEST_AT + rng.randrange(16)] ^= 1 + rng.randrange(255)
    elif how == 8:  # several bytes anywhere
        for _ in range(rng.randrange(1, 9)):
            v[rng.randrange(len(v))] = rng.randrange(256)
    elif how == 9:  # cut short
        del v[rng.randrange(len(v)) :]
    elif how == 10:  # bytes added
        v += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 17)))
    elif how == 11:  # another value's header on this payload
        other = rng.choice(others)
        return other.value[: other.header_size] + item.value[head:]
    elif how == 12:  # this header on another value's payload
        other = rng.choice(others)
        return item.value[:head] + other.value[other.header_size :]
    elif how == 13:  # another key's value, whole
        return rng.choice([o for o in others if o.key != item.key]).value
    elif how == 14:  # a byte taken out, or put in
        at = rng.randrange(len(v) + 1)
        if v and rng.random() < 0.5:
            del v[min(at, len(v) - 1)]
        else:
            v.insert(at, rng.randrange(256))
    else:  # the dtype and the dimensions together: another tensor of as many bytes
        v[DTYPE_AT] = rng.randrange(20)
        _flip_bit(v, DIMS_AT, head - 4, rng)
    return bytes(v)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def served_exactly(item: Original, value: bytes) -> bool | None:
    """Whether parse serves value (read under item's key) as exactly item's tensor; None
    where it refuses it. Any other exception fails the test."""
    try:
        header, payload = parse(value, item.key)
    except RemoteValueError:
        return None
    want = item.tensor
    return (
        header.dtype == want.dtype
        and header.shape == tuple(want.shape)
        and bytes(payload) == _bytes(want)
    )


def test_the_fuzzer_is_deterministic() -> None:
    def run() -> list[bytes]:
        rng = random.Random(SEED)
        items = originals(rng)
        return [mutate(rng.choice(items), items, rng) for _ in range(200)]

    assert run() == run()


def test_mutated_values_are_refused_or_served_exactly() -> None:
    rng = random.Random(SEED)
    items = originals(rng)
    for item in items:
        assert served_exactly(item, item.value) is True
    refused = served = wrong = 0
    for n in range(FUZZ_MUTATIONS):
        item = rng.choice(items)
        mutated = mutate(item, items, rng)
        verdict = served_exactly(item, mutated)
        if verdict is None:
            refused += 1
        elif verdict:
            served += 1
        else:
            wrong += 1
            pytest.fail(f"mutation {n} was served as another tensor: {mutated[:64]!r}")
    assert wrong == 0
    assert served + refused == FUZZ_MUTATIONS
    assert refused >= FUZZ_MUTATIONS * 0.9  # nearly every mutation changes something


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_mutated_values_on_a_real_server_are_missed_or_served_exactly(
    rig: Rig, make_cache: CacheFactory, redis_url: str, raw: redis.asyncio.Redis
) -> None:
    rng = random.Random(SEED + 1)
    writer = make_cache(gpu_mb=4, remote_url=redis_url)
    reader = make_cache(gpu_mb=4, remote_url=redis_url)
    keys: dict[bytes, Hashable] = {}
    items: list[Original] = []
    for i, shape in enumerate(SHAPES[:6]):  # a feature of 0 bytes is never written
        g = torch.Generator().manual_seed(i)
        want = (torch.randn(shape, generator=g) * 100).to(rng.choice(DTYPES))
        tensor = want.clone() if rig.kind == "sim" else want.to(rig.device.name)
        assert await writer.put(("img", i), tensor)
        await writer.drain()
        rkey = writer.remote_key(("img", i))
        stored = await raw.get(rkey)
        assert stored is not None
        keys[rkey] = ("img", i)
        items.append(Original(rkey, want, bytes(stored)))
    hits = 0
    for _ in range(ROUND_TRIPS):
        item = rng.choice(items)
        await raw.set(item.key, mutate(item, items, rng))
        got = await reader.get(keys[item.key], device="cpu")
        if got is not None:  # only a mutation that changed nothing may be served
            assert_exact(got, item.tensor)
            hits += 1
            del got
            assert reader.discard(keys[item.key])
    s = reader.stats()
    assert s.remote_hits == hits and hits < ROUND_TRIPS * 0.1
    assert s.remote_errors == 0 and s.leaked_bytes == 0
    for item in items:  # the genuine values are still served exactly
        await raw.set(item.key, item.value)
        assert_exact(await reader.get(keys[item.key], device="cpu"), item.tensor)

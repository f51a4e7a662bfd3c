"""Content keys: every input that changes a feature changes its key; nothing else does."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig
from hypothesis import given
from hypothesis import strategies as st

from mmcache import InvalidKeyError, InvalidValueError, MMCacheError
from mmcache.core.entry import MAX_KEY_DEPTH, MAX_KEY_SIZE, check_key, check_keys
from mmcache.keys import (
    MAX_PREPROCESS_DEPTH,
    FeatureKey,
    FeatureMismatchError,
    PreprocessValue,
    check_feature,
    feature_key,
)

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
REV = "cc594898137f460bfe9f0759e9844b3ce807cfb5"
PIXELS = bytes(range(256)) * 12  # 3 KiB of "decoded pixels"


def key(data: Any = PIXELS, **kw: Any) -> FeatureKey:
    kw.setdefault("model", MODEL)
    kw.setdefault("revision", REV)
    return feature_key(data, **kw)


# --- the encoding -------------------------------------------------------------------


def test_the_key_is_a_128_bit_digest_the_cache_takes_as_is() -> None:
    k = key(kind="image")
    assert isinstance(k, tuple) and k == ("image", k.digest)
    assert len(bytes.fromhex(k.digest)) == 16
    assert len(bytes.fromhex(key(digest_bytes=32).digest)) == 32
    assert hash(k) == hash(("image", k.digest))


def test_golden_keys_pin_the_encoding() -> None:
    """Keys are shared between processes and restarts: the encoding must never drift."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert key(t, model="m", revision="r").digest == "7f4167d2b2df1c239f45353d62ad9ae3"
    assert key(b"", model="m", revision="r").digest == "b58eac20c64474464bc40035e9023b27"
    assert key(
        torch.tensor(1.5, dtype=torch.bfloat16), model="m", revision="r", digest_bytes=32
    ) == ("image", "4195fc8afdffe21680c9a9bc73880d383411e088416b2f0d2a3c989ab447cdaa")


def test_the_encoding_is_the_documented_one() -> None:
    """Rebuilt by hand: tagged, length-prefixed fields under a versioned personalisation."""

    def field(tag: bytes, data: bytes) -> bytes:
        return tag + struct.pack("<Q", len(data)) + data

    h = hashlib.blake2b(digest_size=16, person=b"mmcache.key.v1")
    h.update(field(b"k", b"audio"))
    h.update(field(b"m", b"whisper"))
    h.update(field(b"r", b"v3"))
    h.update(b"p" + b"M" + struct.pack("<Q", 2))
    h.update(field(b"S", b"rate") + field(b"I", b"16000"))
    h.update(field(b"S", b"trim") + b"B1")
    h.update(field(b"t", b"int16"))
    h.update(field(b"s", struct.pack("<q", 4)))
    h.update(field(b"d", b"\x01\x00\x02\x00\x03\x00\x04\x00"))
    got = feature_key(
        b"\x01\x00\x02\x00\x03\x00\x04\x00",
        shape=(4,),
        dtype=torch.int16,
        model="whisper",
        revision="v3",
        preprocess={"trim": True, "rate": 16000},
        kind="audio",
    )
    assert got == ("audio", h.hexdigest())


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param({}, {"data": PIXELS[:-1] + b"\x00"}, id="one-byte-of-data"),
        pytest.param({}, {"data": PIXELS + b"\x00"}, id="one-more-byte"),
        pytest.param({"model": "a/b"}, {"model": "a/c"}, id="model"),
        pytest.param({"revision": "main"}, {"revision": "v2"}, id="revision"),
        pytest.param({"kind": "image"}, {"kind": "video"}, id="kind"),
        pytest.param({"preprocess": {"size": 448}}, {"preprocess": {"size": 336}}, id="setting"),
        pytest.param({"preprocess": {}}, {"preprocess": {"size": 448}}, id="extra-setting"),
        pytest.param({"preprocess": {"x": 1}}, {"preprocess": {"y": 1}}, id="setting-name"),
        pytest.param({"preprocess": {"x": True}}, {"preprocess": {"x": 1}}, id="bool-vs-int"),
        pytest.param({"preprocess": {"x": 1}}, {"preprocess": {"x": 1.0}}, id="int-vs-float"),
        pytest.param({"preprocess": {"x": 1}}, {"preprocess": {"x": "1"}}, id="int-vs-str"),
        pytest.param({"preprocess": {"x": "a"}}, {"preprocess": {"x": b"a"}}, id="str-vs-bytes"),
        pytest.param({"preprocess": {"x": None}}, {"preprocess": {"x": 0}}, id="none-vs-zero"),
        pytest.param({"preprocess": {"x": 0.0}}, {"preprocess": {"x": -0.0}}, id="signed-zero"),
        pytest.param({"preprocess": {"x": 0.1}}, {"preprocess": {"x": 0.1 + 2**-56}}, id="ulp"),
        pytest.param({"preprocess": {"x": [1, 2]}}, {"preprocess": {"x": [[1], 2]}}, id="nesting"),
        pytest.param({"preprocess": {"x": [1, 2]}}, {"preprocess": {"x": [2, 1]}}, id="list-order"),
        pytest.param(
            {"preprocess": {"mean": torch.float16}},
            {"preprocess": {"mean": torch.bfloat16}},
            id="dtype-setting",
        ),
        pytest.param({"shape": (16, 192)}, {"shape": (192, 16)}, id="shape"),
        pytest.param({"shape": (3072,)}, {}, id="shape-vs-none"),
        pytest.param(
            {"shape": (3072,), "dtype": torch.uint8},
            {"shape": (3072,), "dtype": torch.int8},
            id="dtype",
        ),
        pytest.param({"digest_bytes": 16}, {"digest_bytes": 32}, id="digest-size"),
    ],
)
def test_each_input_that_changes_the_feature_changes_the_key(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    assert key(**a) != key(**b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param({"model": "ab", "revision": "c"}, {"model": "a", "revision": "bc"}),
        pytest.param({"model": "a", "kind": "bc"}, {"model": "ab", "kind": "c"}),
        pytest.param({"preprocess": {"a": "b=c"}}, {"preprocess": {"a=b": "c"}}),
        pytest.param({"preprocess": {"a": ["b", "c"]}}, {"preprocess": {"a": ["bc"]}}),
        pytest.param({"preprocess": {"a": "", "b": ""}}, {"preprocess": {"a": "\x00b"}}),
        pytest.param({"preprocess": {"a": {"b": 1}}}, {"preprocess": {"a.b": 1}}),
    ],
)
def test_fields_cannot_bleed_into_each_other(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key(**a) != key(**b)


def test_settings_order_does_not_matter() -> None:
    one = {"size": 448, "crop": "center", "norm": {"mean": [0.5, 0.5], "std": [0.2, 0.3]}}
    two = {"norm": {"std": [0.2, 0.3], "mean": [0.5, 0.5]}, "crop": "center", "size": 448}
    assert key(preprocess=one) == key(preprocess=two)
    assert key(preprocess=None) == key(preprocess={})
    assert key(preprocess={"x": (1, 2)}) == key(preprocess={"x": [1, 2]})


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool]
)
def test_a_tensor_hashes_like_its_bytes_with_shape_and_dtype(dtype: torch.dtype) -> None:
    t = (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 50).to(dtype)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert key(t) == key(raw, shape=(4, 6), dtype=dtype)
    assert key(t) == key(bytearray(raw), shape=(4, 6), dtype=dtype)
    assert key(t) == key(memoryview(raw), shape=(4, 6), dtype=dtype)
    assert key(t) != key(raw)  # without shape and dtype it is another source


def test_a_view_hashes_its_logical_content() -> None:
    base = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    transposed = base.t()
    assert not transposed.is_contiguous()
    assert key(transposed) == key(transposed.contiguous())
    rows = base[2:5]  # a view into a larger storage: only its own bytes count
    assert key(rows) == key(rows.clone())
    assert key(base[::2]) == key(base[::2].contiguous())
    assert key(transposed) != key(base)


def test_the_same_values_in_another_shape_or_dtype_are_another_feature() -> None:
    t = torch.arange(24, dtype=torch.int32)
    assert key(t) != key(t.reshape(4, 6))
    assert key(t) != key(t.view(torch.float32))
    assert key(t.reshape(4, 6)) != key(t.reshape(6, 4))


def test_scalars_empty_tensors_and_autograd_tensors() -> None:
    assert key(torch.tensor(3.0)) != key(torch.tensor([3.0]))
    assert key(torch.zeros(0, 4)) != key(torch.zeros(4, 0))
    leaf = torch.ones(3, requires_grad=True)
    assert key(leaf) == key(torch.ones(3))
    assert key(torch.ones(2, 2).neg()) == key(torch.ones(2, 2)._neg_view())


def test_the_key_is_the_same_in_another_process() -> None:
    import subprocess
    import sys

    code = (
        "import torch; from mmcache.keys import feature_key; "
        "print(feature_key(torch.arange(12.0).reshape(3, 4), model='m', revision='r').digest)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7f4167d2b2df1c239f45353d62ad9ae3"


@given(
    a=st.binary(max_size=64),
    b=st.binary(max_size=64),
    settings_a=st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4)),
    settings_b=st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4)),
)
def test_keys_are_equal_exactly_when_inputs_are(
    a: bytes,
    b: bytes,
    settings_a: dict[str, PreprocessValue],
    settings_b: dict[str, PreprocessValue],
) -> None:
    same = a == b and settings_a == settings_b
    assert (key(a, preprocess=settings_a) == key(b, preprocess=settings_b)) == same


# --- refused input ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["model", "revision", "kind"])
@pytest.mark.parametrize("bad", ["", None, 7])
def test_model_revision_and_kind_are_required_strings(field: str, bad: object) -> None:
    with pytest.raises(InvalidKeyError, match=field):
        key(**{field: bad})


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"x": object()}, id="object"),
        pytest.param({"x": {1, 2}}, id="set"),
        pytest.param({"x": {3: "a"}}, id="int-name"),
        pytest.param({"x": [1, object()]}, id="nested"),
    ],
)
def test_settings_without_a_canonical_encoding_are_refused(settings: Mapping[str, Any]) -> None:
    with pytest.raises(InvalidKeyError, match="preprocess"):
        key(preprocess=settings)


@pytest.mark.parametrize(
    ("data", "kw", "match"),
    [
        pytest.param([1, 2, 3], {}, "list", id="list"),
        pytest.param("text", {}, "str", id="str"),
        pytest.param(torch.ones(2, 3), {"shape": (3, 2)}, "disagrees", id="tensor-shape"),
        pytest.param(torch.ones(2, 3), {"dtype": torch.int8}, "disagrees", id="tensor-dtype"),
        pytest.param(
            b"\x00" * 12, {"shape": (2, 3), "dtype": torch.int32}, "cannot hold", id="size"
        ),
        pytest.param(b"\x00" * 4, {"shape": (-4,)}, "non-negative", id="negative-dim"),
        pytest.param(b"\x00" * 4, {"dtype": "float32"}, "torch.dtype", id="dtype-str"),
        pytest.param(b"", {"digest_bytes": 8}, "128-bit", id="64-bit"),
        pytest.param(torch.empty(2, device="meta"), {}, "meta", id="meta"),
        pytest.param(torch.ones(4, 4).to_sparse(), {}, "dense", id="sparse"),
    ],
)
def test_bad_sources_are_refused(data: Any, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidValueError, match=match):
        key(data, **kw)


def test_a_strided_memoryview_is_refused() -> None:
    with pytest.raises(InvalidValueError, match="contiguous"):
        key(memoryview(PIXELS)[::2])


# --- checking a hit -------------------------------------------------------------------


def test_check_feature_passes_a_matching_feature_through() -> None:
    t = torch.zeros(196, 1024, dtype=torch.bfloat16)
    assert check_feature(t, shape=(196, 1024), dtype=torch.bfloat16) is t
    assert check_feature(t, shape=(None, 1024)) is t  # any number of patches
    assert check_feature(t) is t
    assert check_feature(None, shape=(1,), dtype=torch.float32) is None  # a miss


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        pytest.param(
            {"dtype": torch.float16}, r"dtype torch\.bfloat16 \(expected torch\.float16\)"
        ),
        pytest.param({"shape": (196, 4096)}, r"shape \(196, 1024\) \(expected \(196, 4096\)\)"),
        pytest.param({"shape": (None, 4096)}, r"expected \(\*, 4096\)"),
        pytest.param({"shape": (196,)}, "shape"),
        pytest.param({"shape": (196, 1024, 1)}, "shape"),
    ],
)
def test_check_feature_names_what_differs(kw: dict[str, Any], match: str) -> None:
    t = torch.zeros(196, 1024, dtype=torch.bfloat16)
    with pytest.raises(FeatureMismatchError, match=match) as info:
        check_feature(t, key=("image", "ab12"), **kw)
    assert isinstance(info.value, MMCacheError) and isinstance(info.value, ValueError)
    assert "('image', 'ab12')" in str(info.value)
    assert "revision" in str(info.value)  # says what to do


async def test_a_content_key_round_trips_through_the_cache(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    source = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    k = feature_key(source, model=MODEL, revision=REV, preprocess={"size": 32})
    feature = rig.tensor(16, 64, seed=7)
    expected = feature.cpu().clone()
    await cache.put(k, feature)
    del feature
    assert k in cache
    assert ("image", k.digest) in cache  # a plain tuple finds it too
    same = feature_key(source.clone(), model=MODEL, revision=REV, preprocess={"size": 32})
    got = check_feature(await cache.get(same), shape=(None, 64), dtype=torch.bfloat16, key=same)
    assert got is not None and torch.equal(got.cpu(), expected)
    other_rev = feature_key(source, model=MODEL, revision="main", preprocess={"size": 32})
    assert await cache.get(other_rev) is None
    with pytest.raises(FeatureMismatchError):
        check_feature(await cache.get(k), shape=(16, 4096), key=k)


@pytest.mark.cuda
def test_a_gpu_tensor_hashes_like_its_host_copy() -> None:
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert key(t.cuda()) == key(t)
    assert key(t.cuda().t()) == key(t.t())


# --- cache keys: bounded depth and size -----------------------------------------------


def nested(depth: int, leaf: object = "leaf") -> object:
    """A key of depth tuples, one inside the other (depth 1: a flat tuple)."""
    k: object = leaf
    for _ in range(depth):
        k = (k,)
    return k


def key_calls(cache: Any, k: object, rig: Rig) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every cache call that takes a key, with k."""

    async def borrowing() -> None:
        async with cache.borrow(k):
            pass

    async def sync(fn: Callable[[], object]) -> object:
        return fn()

    return {
        "put": lambda: cache.put(k, rig.tensor(4, 64)),
        "put_many": lambda: cache.put_many([("ok", rig.tensor(4, 64)), (k, rig.tensor(4, 64))]),
        "put_split": lambda: cache.put_split(["ok", k], rig.tensor(4, 64), [2, 2]),
        "get": lambda: cache.get(k),
        "get-cpu": lambda: cache.get(k, device="cpu"),
        "get_or_compute": lambda: cache.get_or_compute(k, lambda: rig.tensor(4, 64)),
        "borrow": borrowing,
        "discard": lambda: sync(lambda: cache.discard(k)),
        "contains": lambda: sync(lambda: k in cache),
    }


TOO_LARGE: dict[str, object] = {
    "nested-33": nested(MAX_KEY_DEPTH + 1),
    "nested-5000": nested(5000),
    "nested-200000": nested(200_000),  # deeper than the C stack would take to hash it
    "nested-in-a-wide-tuple": ("a", 1, ("b", nested(MAX_KEY_DEPTH))),
    "flat-tuple": tuple(range(MAX_KEY_SIZE)),
    "bytes": b"x" * (MAX_KEY_SIZE + 1),
    "str": "x" * (MAX_KEY_SIZE + 1),
    "int": 1 << (8 * MAX_KEY_SIZE + 8),
    "tuple-of-large-parts": ("x" * (MAX_KEY_SIZE // 2), b"y" * (MAX_KEY_SIZE // 2)),
}


@pytest.mark.parametrize("name", list(TOO_LARGE))
async def test_a_key_too_deep_or_too_large_is_refused_by_every_call(
    rig: Rig, make_cache: CacheFactory, name: str
) -> None:
    cache = make_cache()
    await cache.start()
    for call, run in key_calls(cache, TOO_LARGE[name], rig).items():
        with pytest.raises(InvalidKeyError, match=r"nest tuples at most|larger than") as info:
            await run()
        assert not isinstance(info.value, RecursionError), call
        assert len(str(info.value)) < 300  # the message does not print the key
    assert len(cache) == 0
    s = cache.stats()
    assert (s.gpu_bytes, s.leaked_bytes, s.misses) == (0, 0, 0)


@pytest.mark.parametrize(
    "k",
    [
        nested(MAX_KEY_DEPTH),
        b"x" * MAX_KEY_SIZE,
        "x" * MAX_KEY_SIZE,
        tuple(range(MAX_KEY_SIZE // 16)),
        (1 << (8 * 1024), "a", (b"b", (2, nested(MAX_KEY_DEPTH - 3)))),
    ],
    ids=["deepest", "largest-bytes", "largest-str", "wide-tuple", "mixed"],
)
async def test_keys_within_the_bounds_round_trip(
    rig: Rig, make_cache: CacheFactory, k: object
) -> None:
    cache = make_cache()
    t = rig.tensor(4, 64, seed=3)
    expected = t.cpu().clone()
    assert await cache.put(k, t)
    del t
    got = await cache.get(k)
    assert got is not None and torch.equal(got.cpu(), expected)
    assert k in cache
    assert await cache.put_many([(k, rig.tensor(4, 64, seed=4))])
    assert cache.discard(k)


def test_a_bad_part_deep_inside_a_key_is_named_without_recursing() -> None:
    deep_list: object = []
    for _ in range(100_000):
        deep_list = [deep_list]
    for k in [("a", deep_list), nested(10, 1.5), nested(MAX_KEY_DEPTH, None)]:
        with pytest.raises(InvalidKeyError, match="keys must be str, bytes, int or tuples"):
            check_key(k)
        with pytest.raises(InvalidKeyError, match="keys must be str, bytes, int or tuples"):
            check_keys(["ok", k])


_leaves = st.one_of(
    st.text(max_size=4),
    st.binary(max_size=4),
    st.integers(),
    st.integers(min_value=1 << 60, max_value=1 << 200),
    st.just(None),
    st.floats(allow_nan=False),
    st.builds(lambda n: "s" * n, st.sampled_from([0, 1, MAX_KEY_SIZE // 3, MAX_KEY_SIZE + 1])),
)
_keys = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=20)


@given(st.lists(st.one_of(_keys, st.builds(nested, st.integers(0, 40))), max_size=6))
def test_a_batch_of_keys_is_refused_exactly_when_one_of_its_keys_is(keys: list[object]) -> None:
    def refused(fn: Callable[[], None]) -> bool:
        try:
            fn()
        except InvalidKeyError:
            return True
        return False

    one_by_one = any(refused(functools.partial(check_key, k)) for k in keys)
    assert refused(functools.partial(check_keys, keys)) == one_by_one


def test_preprocess_values_nested_too_deep_or_containing_themselves_are_refused() -> None:
    cyclic: list[object] = []
    cyclic.append(cyclic)
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    loop: dict[str, object] = {}
    loop["self"] = loop
    for value in (cyclic, deep, loop):
        with pytest.raises(InvalidKeyError, match="at most 32 deep"):
            key(preprocess={"crop": value})
    shallow: object = 1
    for _ in range(MAX_PREPROCESS_DEPTH - 1):
        shallow = [shallow]
    assert key(preprocess={"crop": shallow}) != key(preprocess={"crop": 1})
    with pytest.raises(InvalidKeyError, match="at most 32 deep"):
        key(preprocess={"crop": [shallow]})

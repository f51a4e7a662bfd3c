"""Bad input is refused with an MMCacheError that says what was wrong, and changes nothing."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Hashable

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

import mmcache
from mmcache import (
    FeatureCache,
    InvalidKeyError,
    InvalidValueError,
    MMCacheError,
    WrongLoopError,
)
from mmcache.core.entry import check_keys

BAD_KEYS = [
    pytest.param([1, 2], id="list"),
    pytest.param({"a": 1}, id="dict"),
    pytest.param(1.5, id="float"),
    pytest.param(object(), id="object"),
    pytest.param(frozenset({1}), id="frozenset"),
    pytest.param(("img", [1]), id="tuple-with-list"),
    pytest.param(("img", 2.0), id="tuple-with-float"),
    pytest.param(None, id="None"),
]


@pytest.mark.parametrize(
    "value",
    [
        pytest.param([1.0, 2.0], id="list"),
        pytest.param(None, id="None"),
        pytest.param(b"\x00" * 16, id="bytes"),
        pytest.param(3.0, id="float"),
    ],
)
async def test_a_value_that_is_not_a_tensor(
    rig: Rig, make_cache: CacheFactory, value: object
) -> None:
    cache = make_cache()
    with pytest.raises(InvalidValueError, match=r"torch\.Tensor"):
        await cache.put("k", value)  # type: ignore[arg-type]
    assert "k" not in cache and len(cache) == 0


async def test_a_numpy_array_is_not_a_tensor(rig: Rig, make_cache: CacheFactory) -> None:
    np = pytest.importorskip("numpy")
    cache = make_cache()
    with pytest.raises(InvalidValueError, match="ndarray"):
        await cache.put("k", np.ones((4, 4), dtype=np.float32))
    assert len(cache) == 0


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 16, 3)], ids=str)
async def test_an_empty_tensor(rig: Rig, make_cache: CacheFactory, shape: tuple[int, ...]) -> None:
    cache = make_cache()
    t = rig.tensor(*shape)
    with pytest.raises(InvalidValueError, match="empty"):
        await cache.put("k", t)
    with pytest.raises(InvalidValueError):
        await cache.put("k", t, wait=False)
    assert len(cache) == 0
    assert cache.stats().gpu_bytes == 0


async def test_a_host_tensor_into_a_cuda_cache(rig: Rig, make_cache: CacheFactory) -> None:
    if rig.kind == "sim":
        pytest.skip("on the simulator host tensors are its device tensors")
    cache = make_cache()
    with pytest.raises(InvalidValueError, match="cuda"):
        await cache.put("k", torch.randn(4, 4))
    assert len(cache) == 0


async def test_a_tensor_on_another_device(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    await cache.start()  # a started cache: the put may take the short path
    t = torch.empty(4, 4, device="meta")
    with pytest.raises(InvalidValueError, match=r"needs a tensor on .* got one on meta"):
        await cache.put("k", t)
    assert len(cache) == 0


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_bad_keys_for_put_and_get(rig: Rig, make_cache: CacheFactory, key: object) -> None:
    cache = make_cache()
    t = rig.tensor(4, 64)
    with pytest.raises(InvalidKeyError, match="keys must be"):
        await cache.put(key, t)
    with pytest.raises(InvalidKeyError):
        await cache.get(key)
    with pytest.raises(InvalidKeyError):
        await cache.get(key, device="cpu")
    with pytest.raises(InvalidKeyError):
        await cache.get_or_compute(key, lambda: t)
    assert len(cache) == 0
    s = cache.stats()
    assert (s.misses, s.gpu_bytes) == (0, 0)  # a refused key is not a lookup


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_bad_keys_for_discard(rig: Rig, make_cache: CacheFactory, key: object) -> None:
    cache = make_cache()
    await cache.start()
    with pytest.raises(InvalidKeyError):
        cache.discard(key)


@pytest.mark.parametrize(
    "key",
    ["img", "", b"\x00raw", 0, -3, 2**70, ("img", 1), ("video", (b"f", 2), ()), ()],
    ids=repr,
)
async def test_supported_keys(rig: Rig, make_cache: CacheFactory, key: Hashable) -> None:
    cache = make_cache()
    t = rig.tensor(4, 64, seed=1)
    expected = t.cpu().clone()
    assert await cache.put(key, t)
    del t
    assert key in cache
    assert_exact(await cache.get(key), expected)
    assert cache.discard(key) is True


@pytest.mark.parametrize(
    "device", ["meta", torch.device("meta"), "mps", "xpu:0", 0, "host"], ids=repr
)
async def test_get_device_must_be_none_cpu_or_the_caches_own(
    rig: Rig, make_cache: CacheFactory, device: object
) -> None:
    cache = make_cache()
    t = rig.tensor(4, 64, seed=2)
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t
    with pytest.raises(MMCacheError, match="device") as info:
        await cache.get("k", device=device)  # type: ignore[arg-type]
    if rig.kind == "sim":  # its tensors say cpu: the error must not leave that a puzzle
        assert "CPU tensors" in str(info.value)
    with pytest.raises(MMCacheError, match="device"):
        await cache.get_or_compute("k", lambda: torch.zeros(1), device=device)  # type: ignore[arg-type]
    # Accepted spellings: the cache's device (None or its name) and the host.
    own = "sim" if rig.kind == "sim" else rig.device.name
    for on_device in (None, own):
        out = await cache.get("k", device=on_device)
        assert_exact(out, expected)
        assert out is not None and rig.device.is_device_tensor(out)
    for host in ("cpu", torch.device("cpu")):
        out = await cache.get("k", device=host)
        assert_exact(out, expected)
        assert out is not None and out.device.type == "cpu"


async def test_calls_from_another_event_loop(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = rig.tensor(4, 64, seed=3)
    expected = t.cpu().clone()
    await cache.put("k", t)  # binds the cache to this loop
    del t

    async def from_elsewhere() -> list[type[BaseException] | None]:
        other = rig.tensor(4, 64, seed=4)
        calls = [
            cache.put("k", other),
            cache.put("other", other, wait=False),
            cache.get("k"),
            cache.get("k", device="cpu"),
            cache.get_or_compute("new", lambda: other),
            cache.drain(),
        ]
        raised: list[type[BaseException] | None] = []
        for call in calls:
            try:
                await call
            except BaseException as e:
                raised.append(type(e))
            else:
                raised.append(None)
        return raised

    raised = await asyncio.to_thread(asyncio.run, from_elsewhere())
    assert raised == [WrongLoopError] * 6
    assert len(cache) == 1 and "other" not in cache and "new" not in cache
    assert_exact(await cache.get("k"), expected)


def test_every_error_derives_from_mmcache_error() -> None:
    errors = [
        obj
        for name in mmcache.__all__
        if inspect.isclass(obj := getattr(mmcache, name)) and issubclass(obj, BaseException)
    ]
    assert len(errors) >= 9
    for error in errors:
        assert issubclass(error, MMCacheError), error


async def test_bad_input_leaves_the_cache_usable(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = rig.tensor(8, 64, seed=5)
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t
    before = cache.stats()
    with pytest.raises(InvalidKeyError):
        await cache.put(["k"], rig.tensor(8, 64))  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError):
        await cache.put("k", "not a tensor")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError):
        await cache.put("k", rig.tensor(0, 64))
    assert cache.stats() == before
    assert_exact(await cache.get("k"), expected)


async def test_fn_must_return_a_tensor(rig: Rig, make_cache: CacheFactory) -> None:
    cache: FeatureCache = make_cache()

    async def not_a_tensor() -> object:
        return [1, 2, 3]

    with pytest.raises(InvalidValueError, match=r"torch\.Tensor"):
        await cache.get_or_compute("k", not_a_tensor)  # type: ignore[arg-type]
    assert "k" not in cache


GOOD_KEYS: list[Hashable] = ["img", b"raw", 7, ("img", 1), ("video", (b"f", 2), ()), ()]


@pytest.mark.parametrize("bad", BAD_KEYS)
@pytest.mark.parametrize("where", [0, 3, 5])
def test_a_batch_of_keys_is_checked_as_each_key_would_be(bad: object, where: int) -> None:
    """check_keys (put_many, put_split) refuses exactly what check_key refuses."""
    check_keys(list(GOOD_KEYS))
    check_keys([("img", i) for i in range(100)])
    keys: list[object] = list(GOOD_KEYS)
    keys.insert(where, bad)
    with pytest.raises(InvalidKeyError, match="keys must be"):
        check_keys(keys)
    with pytest.raises(InvalidKeyError, match="keys must be"):
        check_keys([("img", i) for i in range(5)] + [("img", bad)])

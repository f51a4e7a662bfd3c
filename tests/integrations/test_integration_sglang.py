"""mmcache.integrations.sglang against the real sglang 0.5.23 (`integration` marker).

SGLang's own MultiModalStaticCache is the reference: the adapter must answer every call
as it does (host tier off, same byte budget), and never miss where it hits (host tier on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang_seam import seam_stand_ins

from mmcache import CacheClosedError, CacheSettings, InvalidValueError, SettingsError

pytestmark = pytest.mark.integration

pytest.importorskip(
    "sglang.srt.mem_cache.multimodal_cache",
    reason="sglang 0.5.23 is not installed (bash scripts/install_integrations.sh installs it)",
)

from sglang.srt.mem_cache.multimodal_cache import (  # noqa: E402
    EmbeddingResult,
    MultiModalStaticCache,
)

from mmcache.core.entry import Entry, State  # noqa: E402
from mmcache.device import SimDevice  # noqa: E402
from mmcache.integrations import IntegrationError  # noqa: E402
from mmcache.integrations.sglang import (  # noqa: E402
    Installation,
    MMCacheMultimodalCache,
    install,
)

KiB = 1024
HOST_OFF = CacheSettings(cpu_cache_mb=0)
HOST_ON = CacheSettings(cpu_cache_mb=1)


def adapter(max_size: int, settings: CacheSettings) -> MMCacheMultimodalCache:
    return MMCacheMultimodalCache(
        max_size, settings=settings, device="sim", registry=CollectorRegistry()
    )


def feature(key: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The embedding of key: the same bytes whenever key is computed again (as in SGLang)."""
    gen = torch.Generator().manual_seed(key & 0xFFFFFFFF)
    return torch.randn(rows, 64, generator=gen).to(dtype)


class Workload:
    """A seeded random sequence of SGLang's cache calls over a small pool of keys."""

    DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.items = list(range(1, 25))
        # The requests' item lists, whose combined hashes get() looks up.
        self.groups = [
            [self.rng.choice(self.items) for _ in range(self.rng.randint(1, 3))] for _ in range(8)
        ]
        self.shape = {
            k: (self.rng.randint(1, 48), self.rng.choice(self.DTYPES)) for k in self.items
        }

    def key(self) -> tuple[int, list[int]]:
        """A key to set: an item's hash, or a request's combined hash (and its items)."""
        if self.rng.random() < 0.3:
            group = self.rng.choice(self.groups)
            combined = MultiModalStaticCache.combine_hashes(group)
            return combined, group
        item = self.rng.choice(self.items)
        return item, [item]

    def value(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two equal embeddings for key, one per cache; sometimes views of a larger batch."""
        rows, dtype = self.shape.get(key, (len(str(key)) % 40 + 1, torch.float32))
        data = feature(key, rows, dtype)
        if self.rng.random() < 0.3:
            pad = self.rng.randint(1, 8)
            batch = torch.cat([feature(key + 1, pad, dtype), data, feature(key + 2, pad, dtype)])
            return batch[pad : pad + rows], batch.clone()[pad : pad + rows]
        return data, data.clone()


def results_equal(ours: Any, theirs: Any) -> bool:
    if theirs is None or ours is None:
        return ours is None and theirs is None
    return type(ours) is type(theirs) and (
        ours.embedding.dtype == theirs.embedding.dtype
        and torch.equal(ours.embedding, theirs.embedding)
    )


def run_calls(seed: int, calls: int, ours: MMCacheMultimodalCache, ref: Any, *, exact: bool) -> int:
    """Make the same calls on both; exact: every answer equal, else ours hits where ref hits."""
    load = Workload(seed)
    rng = load.rng
    for step in range(calls):
        roll = rng.random()
        where = f"seed {seed}, call {step}"
        if roll < 0.35:
            key, _ = load.key()
            theirs_value, ours_value = load.value(key)
            set_ours = ours.set(key, EmbeddingResult(embedding=ours_value))
            set_ref = ref.set(key, EmbeddingResult(embedding=theirs_value))
            del ours_value, theirs_value
            assert set_ours == set_ref or (not exact and set_ours), f"set at {where}"
        elif roll < 0.55:
            _, group = load.key()
            got, want = ours.get(group), ref.get(group)
            assert results_equal(got, want) or (not exact and want is None), f"get at {where}"
        elif roll < 0.75:
            item = rng.choice(load.items)
            got, want = ours.get_single(item), ref.get_single(item)
            assert results_equal(got, want) or (not exact and want is None), (
                f"get_single at {where}"
            )
        elif roll < 0.85:
            key, _ = load.key()
            got_b, want_b = ours.has(key), ref.has(key)
            assert got_b == want_b or (not exact and got_b), f"has at {where}"
        elif roll < 0.97:
            key, _ = load.key()
            got_b, want_b = ours.free(key, None), ref.free(key, None)
            assert got_b == want_b or (not exact and got_b), f"free at {where}"
        elif roll < 0.995:
            assert (len(ours), ours.available_size()) == (len(ref), ref.available_size()) or (
                not exact and len(ours) >= len(ref)
            ), f"len at {where}"
        else:
            ours.clear()
            ref.clear()
            assert len(ours) == 0
    return calls


@pytest.mark.parametrize("seed", range(5))
def test_answers_as_sglangs_static_cache_call_by_call(seed: int) -> None:
    budget = [64 * KiB, 96 * KiB, 100 * KiB + 3, 40 * KiB, 256 * KiB][seed]
    with adapter(budget, HOST_OFF) as ours:
        ref = MultiModalStaticCache(budget)
        assert run_calls(seed, 2_000, ours, ref, exact=True) == 2_000  # 10,000 over the seeds
        assert len(ours) == len(ref)
        stats = ours.feature_cache.stats()
        assert stats.gpu_bytes == ref.current_size <= budget


@pytest.mark.parametrize("seed", range(2))
def test_with_the_host_tier_every_sglang_hit_is_a_hit(seed: int) -> None:
    budget = 48 * KiB
    with adapter(budget, HOST_ON) as ours:
        ref = MultiModalStaticCache(budget)
        run_calls(100 + seed, 1_500, ours, ref, exact=False)
        stats = ours.feature_cache.stats()
        assert stats.evictions_gpu > 0 and stats.hits_cpu > 0  # the host tier did serve


def test_host_tier_brings_back_what_sglang_drops() -> None:
    with adapter(8 * KiB, HOST_ON) as ours:
        ref = MultiModalStaticCache(8 * KiB)
        for key in range(1, 5):  # 4 KiB each: two fit the GPU tier
            ours.set(key, EmbeddingResult(embedding=feature(key, 16, torch.float32)))
            ref.set(key, EmbeddingResult(embedding=feature(key, 16, torch.float32)))
        assert ref.get_single(1) is None
        back = ours.get_single(1)
        assert back is not None and torch.equal(back.embedding, feature(1, 16, torch.float32))


def test_set_keeps_an_embedding_results_own_fields() -> None:
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class WithFrames(EmbeddingResult):  # type: ignore[misc]
        frames: list[int]

    with adapter(64 * KiB, HOST_OFF) as ours:
        assert ours.set(7, WithFrames(embedding=feature(7, 4, torch.float32), frames=[1, 3]))
        got = ours.get_single(7)
        assert isinstance(got, WithFrames) and got.frames == [1, 3]
        assert torch.equal(got.embedding, feature(7, 4, torch.float32))


def test_a_value_replaced_while_its_host_hit_is_read_is_never_served_with_the_new_fields() -> None:
    """A get of a host-tier hit waits for its upload; a free and set of the key meanwhile
    gives it new fields: the get answers the value it read with that value's fields, or a
    miss, never the old tensor with the new fields."""
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class WithFrames(EmbeddingResult):  # type: ignore[misc]
        frames: list[int]

    old, new = feature(7, 4, torch.float32), feature(70, 4, torch.float32)
    with adapter(4 * KiB, HOST_ON) as ours:
        assert ours.set(7, WithFrames(embedding=old, frames=[1]))
        for key in range(8, 12):  # 1 KiB each: 7 goes to the host tier
            assert ours.set(key, EmbeddingResult(embedding=feature(key, 4, torch.float32)))
        cache = ours.feature_cache
        device = cache.device
        assert isinstance(device, SimDevice)

        async def replaced_while_read() -> Any:
            await cache.drain()
            entry = cache._core.state.index[7]
            assert isinstance(entry, Entry) and entry.state is State.HOST
            stream = device.current_stream()
            assert await ours._free(8) and await ours._free(9)  # room for the new value
            with device.hold():  # the upload waits
                got = asyncio.ensure_future(ours._get(7, stream))
                for _ in range(3):
                    await asyncio.sleep(0)  # the turn ends: the get's upload is queued
                assert await ours._free(7)
                assert await ours._set(7, new, WithFrames(embedding=new, frames=[2]), stream)
            return await got

        result = ours._loop.run(replaced_while_read())
        served = None if result is None else (result.frames, result.embedding.tolist())
        assert served in (None, ([1], old.tolist()), ([2], new.tolist())), served[0]


def test_refuses_what_sglang_refuses() -> None:
    with adapter(4 * KiB, HOST_ON) as ours:
        too_big = feature(1, 17, torch.float32)  # 4,352 bytes
        assert not ours.set(1, EmbeddingResult(embedding=too_big))
        assert not MultiModalStaticCache(4 * KiB).set(1, EmbeddingResult(embedding=too_big))
        assert not ours.has(1) and len(ours) == 0
        with pytest.raises(TypeError):
            ours.set(2, too_big)


NOT_TENSORS = [
    pytest.param(lambda: None, id="None"),
    pytest.param(lambda: [1.0, 2.0], id="list"),
    pytest.param(lambda: pytest.importorskip("numpy").ones((4, 4)), id="ndarray"),
]


@pytest.mark.parametrize("make_value", NOT_TENSORS)
def test_set_refuses_an_embedding_that_is_not_a_tensor(make_value: Any) -> None:
    with adapter(64 * KiB, HOST_ON) as ours:
        kept = feature(1, 4, torch.float32)
        assert ours.set(1, EmbeddingResult(embedding=kept))
        with pytest.raises(InvalidValueError, match=r"torch\.Tensor"):
            ours.set(2, EmbeddingResult(embedding=make_value()))
        assert not ours.has(2) and len(ours) == 1
        got = ours.get_single(1)
        assert got is not None and torch.equal(got.embedding, kept)
        assert ours.set(2, EmbeddingResult(embedding=feature(2, 4, torch.float32)))


def _quiet(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """make, without torch's warning that its layout is a prototype or in beta."""

    def made() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return make()

    return made


MKLDNN = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
NOT_DENSE = [
    pytest.param(lambda: torch.ones(4, 8).to_sparse(), id="sparse-coo"),
    pytest.param(_quiet(lambda: torch.ones(4, 8).to_sparse_csr()), id="sparse-csr"),
    pytest.param(
        _quiet(lambda: torch.nested.nested_tensor([torch.ones(2, 8), torch.ones(3, 8)])),
        id="nested",
    ),
    pytest.param(
        lambda: torch.nested.nested_tensor(
            [torch.ones(2, 8), torch.ones(3, 8)], layout=torch.jagged
        ),
        id="jagged",
    ),
    pytest.param(
        lambda: torch.ones(4, 8).to_mkldnn(),
        id="mkldnn",
        marks=pytest.mark.skipif(not MKLDNN, reason="this torch has no mkldnn"),
    ),
]


@pytest.mark.parametrize("make_value", NOT_DENSE)
def test_set_answers_false_for_a_tensor_that_is_not_dense(make_value: Any) -> None:
    with adapter(64 * KiB, HOST_ON) as ours:
        kept = feature(1, 4, torch.float32)
        assert ours.set(1, EmbeddingResult(embedding=kept))
        assert ours.set(2, EmbeddingResult(embedding=make_value())) is False
        assert not ours.has(2) and ours.get_single(2) is None and len(ours) == 1
        got = ours.get_single(1)
        assert got is not None and torch.equal(got.embedding, kept)
        assert ours.set(1, EmbeddingResult(embedding=make_value()))  # already there: refreshed


def test_an_integer_of_another_type_is_the_int_it_equals() -> None:
    np = pytest.importorskip("numpy")
    with adapter(64 * KiB, HOST_OFF) as ours:
        ref = MultiModalStaticCache(64 * KiB)
        for cache in (ours, ref):
            assert cache.set(np.int64(5), EmbeddingResult(embedding=feature(5, 4, torch.float32)))
            assert cache.set(7, EmbeddingResult(embedding=feature(7, 4, torch.float32)))
            assert cache.set(True, EmbeddingResult(embedding=feature(1, 4, torch.float32)))
        for cache in (ours, ref):
            got = cache.get_single(5)
            assert got is not None and torch.equal(got.embedding, feature(5, 4, torch.float32))
            assert cache.has(np.int64(7)) and cache.has(np.uint8(1)) and cache.has(1)
            assert cache.get_single(np.int32(7)) is not None
            assert cache.free(np.int64(7), None) and not cache.has(7)
            assert len(cache) == 2


BAD_HASHES = [
    pytest.param(None, id="None"),
    pytest.param(1.5, id="float"),
    pytest.param([1, 2], id="list"),
    pytest.param({"a": 1}, id="dict"),
    pytest.param(object(), id="object"),
    pytest.param(("img", [1]), id="tuple-with-list"),
    pytest.param("x" * (2 * 1024 * 1024), id="str-over-1MiB"),
]


@pytest.mark.parametrize("mm_hash", BAD_HASHES)
def test_an_mm_hash_the_cache_cannot_hold_is_a_miss(
    mm_hash: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with adapter(64 * KiB, HOST_ON) as ours:
        kept = feature(1, 4, torch.float32)
        assert ours.set(1, EmbeddingResult(embedding=kept))
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            assert (
                ours.set(mm_hash, EmbeddingResult(embedding=feature(2, 4, torch.float32))) is False
            )
        assert "an mm_hash is an int" in caplog.text
        assert ours.get_single(mm_hash) is None
        assert ours.has(mm_hash) is False
        assert ours.free(mm_hash, None) is False
        assert len(ours) == 1
        got = ours.get_single(1)
        assert got is not None and torch.equal(got.embedding, kept)


@pytest.mark.parametrize("mm_hashes", [[[1]], 5, [{"a": 1}, 2]], ids=["nested", "int", "dict"])
def test_get_of_hashes_that_do_not_combine_is_a_miss(mm_hashes: Any) -> None:
    with adapter(64 * KiB, HOST_ON) as ours:
        assert ours.set(
            ours.combine_hashes([1]), EmbeddingResult(embedding=feature(1, 4, torch.float32))
        )
        assert ours.get(mm_hashes) is None
        assert ours.get([1]) is not None


def test_two_threads_at_once() -> None:
    errors: list[BaseException] = []
    with adapter(256 * KiB, HOST_ON) as ours:

        def work(base: int) -> None:
            try:
                for i in range(300):
                    key = base + i % 40
                    if not ours.has(key):
                        assert ours.set(
                            key, EmbeddingResult(embedding=feature(key, 8, torch.float32))
                        )
                    got = ours.get_single(key)
                    if got is not None:
                        assert torch.equal(got.embedding, feature(key, 8, torch.float32))
                    shared = ours.get_single(5_000 + i % 7)  # keys both threads set
                    if shared is None:
                        value = feature(5_000 + i % 7, 8, torch.float32)
                        ours.set(5_000 + i % 7, EmbeddingResult(embedding=value))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(b,)) for b in (1_000, 2_000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert ours.feature_cache.stats().hits_gpu > 0


def test_close_stops_the_loop_thread() -> None:
    ours = adapter(16 * KiB, HOST_ON)
    thread_names = {t.name for t in threading.enumerate()}
    loop_threads = [name for name in thread_names if name.startswith("mmcache-sglang")]
    assert loop_threads
    ours.set(1, EmbeddingResult(embedding=feature(1, 4, torch.float32)))
    ours.close()
    ours.close()  # idempotent
    assert not set(loop_threads) & {t.name for t in threading.enumerate()}
    with pytest.raises(CacheClosedError):
        ours.get_single(1)


# --- install() on SGLang's own seam ---------------------------------------------------------

SEAM = "sglang.srt.managers.mm_schedule"


def _module(name: str, **attrs: object) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def load_mm_schedule(
    setitem: Callable[[dict[str, Any], str, Any], None],
    delitem: Callable[[dict[str, Any], str], None],
) -> ModuleType:
    """SGLang 0.5.23's own mm_schedule.py, loaded as sglang.srt.managers.mm_schedule.

    Its imports that need a GPU build of torchvision and transformers' processors (model
    configs, the scheduler's batch types) are replaced by small stand-ins: the seam itself,
    the caller code and the cache class are SGLang's. setitem and delitem change
    sys.modules (monkeypatch's, to undo them after a test).
    """
    import sglang

    path = Path(sglang.__file__).parent / "srt" / "managers" / "mm_schedule.py"

    stand_ins = seam_stand_ins()
    modules: Any = sys.modules
    for name, module in stand_ins.items():
        setitem(modules, name, module)
    spec = importlib.util.spec_from_file_location(SEAM, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    setitem(modules, SEAM, module)
    spec.loader.exec_module(module)
    for name in stand_ins:  # SGLang's own modules again for everything after the load
        delitem(modules, name)
    return module


@pytest.fixture
def mm_schedule(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """SGLang's own mm_schedule.py (load_mm_schedule), undone after the test."""
    yield load_mm_schedule(monkeypatch.setitem, monkeypatch.delitem)


class Item:
    """What mm_schedule reads of a MultimodalDataItem on the cached path."""

    def __init__(self, hash: int) -> None:
        self.hash = hash
        self.feature = None


def test_install_makes_sglang_build_and_use_the_adapter(
    mm_schedule: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = mm_schedule.init_mm_embedding_cache
    builder = _module("sglang.srt.mem_cache.kv_cache_builder", init_mm_embedding_cache=original)
    monkeypatch.setitem(sys.modules, builder.__name__, builder)  # imported it by name
    done = install(settings=HOST_ON, device="sim")
    try:
        assert isinstance(done, Installation) and builder in done.rebound
        builder.init_mm_embedding_cache(64 * KiB)  # what SGLang's KV cache builder calls
        cache = mm_schedule.embedding_cache
        assert isinstance(cache, MMCacheMultimodalCache) and cache.max_size == 64 * KiB
        calls: list[int] = []

        def encode(items: list[Item]) -> torch.Tensor:
            calls.append(len(items))
            return torch.cat([feature(i.hash, 4, torch.float32) for i in items])

        items = [Item(11), Item(12)]
        for _ in range(2):  # SGLang's own caller: a miss that encodes, then a hit
            chunk, _ids = mm_schedule._get_chunked_embedding_full(
                encode, items, [(0, 3), (4, 7)], 0, 8, torch.zeros(8), torch.device("cpu")
            )
            assert torch.equal(chunk, encode(items)[:8])
            calls.pop()
        assert calls == [2]
    finally:
        done.uninstall()
    assert mm_schedule.init_mm_embedding_cache is original
    assert builder.init_mm_embedding_cache is original
    assert isinstance(mm_schedule.embedding_cache, MultiModalStaticCache)
    assert cache.feature_cache is not None
    with pytest.raises(CacheClosedError):
        cache.get_single(11)


def test_install_takes_the_place_of_a_cache_already_built(mm_schedule: ModuleType) -> None:
    mm_schedule.init_mm_embedding_cache(32 * KiB)
    done = install(settings=HOST_OFF, device="sim", module=mm_schedule)
    try:
        assert isinstance(mm_schedule.embedding_cache, MMCacheMultimodalCache)
        assert mm_schedule.embedding_cache.max_size == 32 * KiB
        again = install(settings=HOST_OFF, device="sim", module=mm_schedule)
        assert done.cache is None and isinstance(again.cache, MMCacheMultimodalCache)
        again.uninstall()
    finally:
        done.uninstall()


def test_init_with_a_bad_max_size_keeps_the_cache_already_built(mm_schedule: ModuleType) -> None:
    done = install(settings=HOST_OFF, device="sim", module=mm_schedule)
    try:
        mm_schedule.init_mm_embedding_cache(32 * KiB)
        built: Any = mm_schedule.embedding_cache
        assert built.set(1, EmbeddingResult(embedding=feature(1, 4, torch.float32)))
        for bad in (-1, 1.5, "32"):
            with pytest.raises(InvalidValueError, match="max_size"):
                mm_schedule.init_mm_embedding_cache(bad)
        cache = done.cache
        assert cache is not None and cache is built and mm_schedule.embedding_cache is cache
        assert cache.get_single(1) is not None  # still open and serving
    finally:
        done.uninstall()


def test_settings_that_are_not_cache_settings_are_refused(mm_schedule: ModuleType) -> None:
    bad: Any = {"cpu_cache_mb": 0}
    with pytest.raises(SettingsError, match="CacheSettings"):
        MMCacheMultimodalCache(KiB, settings=bad, device="sim", registry=CollectorRegistry())
    before = dict(mm_schedule.__dict__)
    with pytest.raises(SettingsError, match="CacheSettings"):
        install(settings=bad, device="sim", module=mm_schedule)
    assert mm_schedule.__dict__ == before  # nothing changed


@pytest.mark.parametrize(
    "seam",
    [
        _module("no_init", embedding_cache=None, MultiModalStaticCache=MultiModalStaticCache),
        _module(
            "no_global",
            init_mm_embedding_cache=lambda max_size=0: None,
            MultiModalStaticCache=MultiModalStaticCache,
        ),
        _module(
            "other_signature",
            init_mm_embedding_cache=lambda max_size=0, device="cuda": None,
            embedding_cache=None,
            MultiModalStaticCache=MultiModalStaticCache,
        ),
        _module("no_class", init_mm_embedding_cache=lambda max_size=0: None, embedding_cache=None),
    ],
    ids=lambda m: m.__name__,
)
def test_install_refuses_a_seam_that_differs(seam: ModuleType) -> None:
    before = dict(seam.__dict__)
    with pytest.raises(IntegrationError, match=r"0\.5\.23"):
        install(device="sim", module=seam)
    assert seam.__dict__ == before  # nothing changed


# --- tensor parallelism ----------------------------------------------------------------------


def _encode_counting(calls: list[int]) -> Callable[[list[Item]], torch.Tensor]:
    def encode(items: list[Item]) -> torch.Tensor:
        calls.append(len(items))
        return torch.cat([feature(i.hash, 4, torch.float32) for i in items])

    return encode


@dataclasses.dataclass(kw_only=True)
class Framed(EmbeddingResult):  # type: ignore[misc]
    """An EmbeddingResult that carries more than its tensor, as EVS's does."""

    frames: list[int]


def tp_rank(rank: int, world: int, control: Any) -> dict[str, Any]:
    """One TP rank's scheduler: SGLang's own mm_schedule, the adapter installed on the group.

    Both ranks encode the request's items, then rank 1 alone frees them (as SGLang does with
    an entry whose token count is off) and both look the request up again.
    """
    import torch.distributed as dist

    def setitem(d: dict[str, Any], k: str, v: Any) -> None:
        d[k] = v

    def delitem(d: dict[str, Any], k: str) -> None:
        del d[k]

    mm = load_mm_schedule(setitem, delitem)
    done = install(settings=HOST_ON, device="sim", module=mm, tp_group=dist.group.WORLD)
    mm.init_mm_embedding_cache(64 * KiB)
    cache = mm.embedding_cache
    assert isinstance(cache, MMCacheMultimodalCache)
    assert cache.feature_cache.group is dist.group.WORLD
    calls: list[int] = []
    items = [Item(21), Item(22)]
    combined = MultiModalStaticCache.combine_hashes([21, 22])
    exact = True
    encodes = []
    for step in range(3):
        if step == 1 and rank == 1:
            assert cache.free(combined, None)  # this rank alone no longer has it
        chunk, _ids = mm._get_chunked_embedding_full(
            _encode_counting(calls),
            items,
            [(0, 3), (4, 7)],
            0,
            8,
            torch.zeros(8),
            torch.device("cpu"),
        )
        exact = exact and torch.equal(chunk, _encode_counting([])(items)[:8])
        encodes.append(len(calls))
    # A result that carries more than its tensor (EVS's frame counts) keeps it through a
    # miss that another rank caused.
    assert cache.set(9, Framed(embedding=feature(9, 4, torch.float32), frames=[1, 3]))
    if rank == 1:
        assert cache.free(9, None)
    missed = cache.get_single(9) is None
    if rank == 1:
        assert cache.set(9, Framed(embedding=feature(9, 4, torch.float32), frames=[1, 3]))
    again = cache.get_single(9)
    framed = isinstance(again, Framed) and again.frames == [1, 3]
    done.uninstall()
    return {"encodes": encodes, "exact": exact, "missed": missed, "framed": framed}


def test_with_the_tp_group_every_rank_runs_the_encoder_or_none(tmp_path: Path) -> None:
    """SGLang #40247: a rank that hit skipped the encoder while the others ran it."""
    from ranks import run_ranks

    reports = run_ranks(tmp_path, 2, tp_rank, timeout_s=30)
    # Round 1: both encode. Round 2: rank 0 still holds it, rank 1 freed it: both encode.
    # Round 3: both hold it: neither encodes.
    assert reports[0]["encodes"] == reports[1]["encodes"] == [1, 2, 2]
    assert reports[0]["exact"] and reports[1]["exact"]
    assert reports[0]["missed"] and reports[1]["missed"]
    assert reports[0]["framed"] and reports[1]["framed"]


def free_during_get_rank(rank: int, world: int, control: Any) -> dict[str, Any]:
    """Rank 0 frees an item while its get_single of it waits for rank 1 in the agreement."""
    import time

    import torch.distributed as dist

    cache = MMCacheMultimodalCache(
        64 * KiB, device="sim", registry=CollectorRegistry(), group=dist.group.WORLD
    )
    assert cache.set(7, Framed(embedding=feature(7, 4, torch.float32), frames=[2]))
    dist.barrier()
    found: list[Any] = []
    if rank == 0:
        looking = threading.Thread(target=lambda: found.append(cache.get_single(7)))
        looking.start()
        time.sleep(0.3)  # its read is done: it waits for rank 1
        freed = cache.free(7)  # SGLang's scheduler frees the item meanwhile
        looking.join(30)
    else:
        time.sleep(0.8)
        freed = False
        found.append(cache.get_single(7))
    hit = found[0]
    framed = isinstance(hit, Framed) and hit.frames == [2]
    exact = hit is not None and torch.equal(hit.embedding, feature(7, 4, torch.float32))
    cache.close()
    return {"freed": freed, "hit": hit is not None, "framed": framed, "exact": exact}


def test_with_the_tp_group_an_agreed_hit_is_served_though_freed_during_the_get(
    tmp_path: Path,
) -> None:
    from ranks import run_ranks

    reports = run_ranks(tmp_path, 2, free_during_get_rank, timeout_s=30)
    assert reports[0]["freed"]
    for report in reports.values():
        assert report["hit"] and report["framed"] and report["exact"]


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[Any]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class Coordinator:
    """What SGLang's GroupCoordinator offers the adapter: its width and its gloo group."""

    def __init__(self, cpu_group: Any, world_size: int) -> None:
        self.cpu_group = cpu_group
        self.world_size = world_size


def test_install_finds_sglangs_attention_tp_group(
    mm_schedule: ModuleType, world_of_one: Any
) -> None:
    from sglang.srt.runtime_context import get_parallel

    done = install(settings=HOST_OFF, device="sim", module=mm_schedule)
    try:
        mm_schedule.init_mm_embedding_cache(32 * KiB)  # outside SGLang's distributed set-up
        assert mm_schedule.embedding_cache.feature_cache.group is None
        with get_parallel().override(attn_tp_group=Coordinator(world_of_one, 1)):
            mm_schedule.init_mm_embedding_cache(32 * KiB)  # TP of one: nothing to agree on
            assert mm_schedule.embedding_cache.feature_cache.group is None
        with get_parallel().override(attn_tp_group=Coordinator(world_of_one, 2)):
            mm_schedule.init_mm_embedding_cache(32 * KiB)
            assert mm_schedule.embedding_cache.feature_cache.group is world_of_one
    finally:
        done.uninstall()
    explicit = install(
        settings=HOST_OFF, device="sim", module=mm_schedule, tp_group=Coordinator(world_of_one, 2)
    )
    try:
        mm_schedule.init_mm_embedding_cache(32 * KiB)
        assert mm_schedule.embedding_cache.feature_cache.group is world_of_one
    finally:
        explicit.uninstall()
    off = install(settings=HOST_OFF, device="sim", module=mm_schedule, tp_group=None)
    try:
        with get_parallel().override(attn_tp_group=Coordinator(world_of_one, 2)):
            mm_schedule.init_mm_embedding_cache(32 * KiB)
            assert mm_schedule.embedding_cache.feature_cache.group is None
    finally:
        off.uninstall()


def test_install_refuses_a_tp_group_that_is_not_a_group(mm_schedule: ModuleType) -> None:
    before = dict(mm_schedule.__dict__)
    with pytest.raises(InvalidValueError, match="ProcessGroup"):
        install(device="sim", module=mm_schedule, tp_group="nccl")
    assert mm_schedule.__dict__ == before  # nothing changed

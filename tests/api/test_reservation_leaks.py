"""Every path that reserves budget gives it back on failure; the audit sees any that does not."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import pytest
import torch
from conftest import assert_exact, leaked, with_registry
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.cache import _leak_gpu_grant_for_tests
from mmcache.device import SimDevice
from mmcache.device.base import Fence, Stream

KiB = 1024
MiB = 1024 * KiB


class _Unreadable(torch.Tensor):
    """A device tensor whose shape raises while armed: what a put met in a nested tensor,
    whose sizes torch refuses only once the budget for it is reserved."""

    armed = 0

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        if _Unreadable.armed:
            _Unreadable.armed -= 1
            del self  # the traceback must not keep the tensor alive
            raise RuntimeError("injected: this tensor's shape cannot be read")
        return torch.Tensor.shape.__get__(self)  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    device = SimDevice()
    yield device
    _Unreadable.armed = 0
    device.close()


@pytest.fixture
async def caches(sim: SimDevice) -> Any:
    made: list[FeatureCache] = []

    def make(gpu_mb: float = 1, cpu_mb: float = 4, **kw: Any) -> FeatureCache:
        kw.setdefault("evict_ahead", 0)
        settings = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb, **kw)
        registry = CollectorRegistry()
        cache = with_registry(FeatureCache(settings, sim, name="t", registry=registry), registry)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        await cache.close(timeout=5)


def unreadable_after_reserving(sim: SimDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the cache's own tensors read their shape once, after the budget is taken."""
    adopt, pack = sim.adopt, sim._pack
    packing_now: list[
        bool
    ] = []  # the device's own adopt inside pack: its copies must read the shape

    # _make_subclass, not as_subclass: an alias of no base, which would stay referenced.
    def adopting(tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        own = adopt(tensor, stream)
        return own if packing_now else torch.Tensor._make_subclass(_Unreadable, own)

    def packing(srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        packing_now.append(True)
        try:
            packed, fence = pack(srcs, stream)
        finally:
            packing_now.clear()
        return torch.Tensor._make_subclass(_Unreadable, packed), fence

    monkeypatch.setattr(sim, "adopt", adopting)
    monkeypatch.setattr(sim, "_pack", packing)


def value(kib: int, seed: int = 0) -> torch.Tensor:
    """A float32 feature of kib KiB on the simulator (rows of 1 KiB)."""
    return torch.randn(kib, 256, generator=torch.Generator().manual_seed(seed))


def failing_put(
    cache: FeatureCache, how: str, kib: int
) -> Callable[[], Coroutine[Any, Any, object]]:
    """A put of kib KiB in all through one path of the API (keys x, y, ...)."""
    if how == "put_many":  # two features large enough to stay single
        return lambda: cache.put_many([("x", value(kib // 2, 1)), ("y", value(kib // 2, 2))])
    if how == "put_many_group":  # small features packed into one group
        return lambda: cache.put_many([(f"x{i}", value(kib // 8, i)) for i in range(8)])
    if how == "put_split":
        return lambda: cache.put_split(["x", "y"], value(kib, 3), [kib // 4, kib - kib // 4])
    if how == "get_or_compute":
        return lambda: cache.get_or_compute("x", lambda: value(kib, 4))
    return lambda: cache.put("x", value(kib, 5))


async def assert_all_given_back(sim: SimDevice, cache: FeatureCache, entries_bytes: int) -> None:
    """Budgets, device memory and the audit hold only what the cache's entries own."""
    await cache.drain()
    sim.synchronize()
    s = cache.stats()
    assert s.leaked_bytes == 0
    # gpu_bytes counts granted bytes too: none is left granted, nor only out of the
    # audit's sight (test_ledger checks that a grant given back leaves both figures).
    assert s.gpu_bytes + s.cpu_bytes == entries_bytes
    assert s.gpu_entries + s.cpu_entries == len(cache)


PATHS = ["put", "put_many", "put_many_group", "put_split", "get_or_compute"]


# --- the audit ------------------------------------------------------------------------


async def test_the_audit_counts_a_grant_that_no_running_put_holds(caches: Any) -> None:
    cache = caches()
    await cache.start()
    assert _leak_gpu_grant_for_tests(cache, 64 * KiB)
    s = cache.stats()
    assert (s.gpu_bytes, s.leaked_bytes) == (64 * KiB, 64 * KiB)
    assert leaked(cache) == {"gpu": 64 * KiB, "cpu": 0}
    # A leaked grant leaves less room: a put of the whole tier cannot have it now.
    assert not await cache.put("big", value(1024), wait=False)


async def test_the_audit_does_not_count_the_grant_of_a_put_still_running(
    sim: SimDevice, caches: Any
) -> None:
    cache = caches()
    await cache.put("old", value(1024))
    with sim.hold():  # its offload, and so the room for the next put, is held back
        waiting = asyncio.create_task(cache.put("new", value(1024, 1)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert cache.stats().leaked_bytes == 0
    seen = []
    while not waiting.done():  # granted, then resumed: the audit never counts it meanwhile
        seen.append(cache.stats().leaked_bytes)
        await asyncio.sleep(0)
    assert await waiting and set(seen) <= {0}
    await assert_all_given_back(sim, cache, 2 * MiB)


# --- a failure after the budget is reserved -------------------------------------------


@pytest.mark.parametrize("how", PATHS)
async def test_a_put_failing_after_its_reservation_gives_it_all_back(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    cache = caches(gpu_mb=1)
    await cache.start()
    unreadable_after_reserving(sim, monkeypatch)
    put = failing_put(cache, how, 1024)
    for _ in range(2):  # twice: the two failed puts left the whole tier reserved
        _Unreadable.armed = 1
        with pytest.raises(RuntimeError, match="injected"):
            await put()
        assert len(cache) == 0
        await assert_all_given_back(sim, cache, 0)
    gc.collect()  # the failed put's traceback holds its frames, and they the tensor
    assert sim.allocated_bytes == 0
    # The whole tier is free again, at once.
    assert await asyncio.wait_for(cache.put("next", value(1024, 9), wait=False), 5)
    await assert_all_given_back(sim, cache, MiB)


@pytest.mark.parametrize("how", PATHS)
async def test_a_put_failing_after_it_waited_for_room_wakes_the_next_waiting_put(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    cache = caches(gpu_mb=1)
    await cache.put("old", value(1024))
    unreadable_after_reserving(sim, monkeypatch)
    with sim.hold():  # the offload that makes room is held: both puts wait in line
        failing = asyncio.create_task(failing_put(cache, how, 1024)())
        await asyncio.sleep(0.01)
        nxt = asyncio.create_task(cache.put("next", value(1024, 9)))
        await asyncio.sleep(0.01)
        assert not failing.done() and not nxt.done()
        _Unreadable.armed = 1  # the first shape read from here on: the failing put's
    with pytest.raises(RuntimeError, match="injected"):
        await asyncio.wait_for(failing, 5)
    assert await asyncio.wait_for(nxt, 5)
    got = await cache.get("next")
    assert_exact(got, value(1024, 9))
    del got
    assert "x" not in cache and "x0" not in cache
    await assert_all_given_back(sim, cache, 2 * MiB)  # "next" on the GPU, "old" on the host


@pytest.mark.parametrize("how", ["put", "put_many", "put_many_group", "put_split"])
async def test_a_host_only_put_failing_after_its_blocks_are_reserved_frees_them(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    cache = caches(gpu_mb=0, cpu_mb=1)
    assert await cache.wait_host_ready(5)
    unreadable_after_reserving(sim, monkeypatch)
    _Unreadable.armed = 1
    with pytest.raises(RuntimeError, match="injected"):
        await failing_put(cache, how, 1024)()
    assert len(cache) == 0
    await assert_all_given_back(sim, cache, 0)
    assert sim.allocated_bytes == 0
    assert await asyncio.wait_for(cache.put("next", value(1024, 9), wait=False), 5)
    assert_exact(await cache.get("next", device="cpu"), value(1024, 9))


@pytest.mark.parametrize("gpu_mb", [1, 0], ids=["gpu", "host-only"])
async def test_an_offload_refused_with_any_error_leaks_nothing(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch, gpu_mb: float
) -> None:
    cache = caches(gpu_mb=gpu_mb, cpu_mb=2)
    assert await cache.wait_host_ready(5)
    await cache.put("a", value(512, 1))

    def refused(*args: object, **kwargs: object) -> Fence:
        raise RuntimeError("injected: the driver refused the copy")

    monkeypatch.setattr(sim, "_copy_d2h_batch", refused)
    # GPU tier: the put evicts "a", whose offload is refused; host-only: its own offload is.
    assert await asyncio.wait_for(cache.put("b", value(1024, 2)), 5)
    monkeypatch.undo()
    assert cache.stats().dropped == 1
    if gpu_mb:  # "a" was the victim
        assert "a" not in cache and "b" in cache
    else:  # "b" went straight to the host tier, and was lost there
        assert "a" in cache and "b" not in cache
    await assert_all_given_back(sim, cache, MiB if gpu_mb else 512 * KiB)
    assert await asyncio.wait_for(cache.put("c", value(1024, 3)), 5)


# --- failures and cancellations while waiting -----------------------------------------


@pytest.mark.parametrize("at", ["waiting", "room-landed"])
@pytest.mark.parametrize("gpu_mb", [1, 0], ids=["gpu", "host-only"])
@pytest.mark.parametrize("how", ["put", "put_many", "put_many_group", "put_split"])
async def test_a_put_cancelled_while_it_waits_for_room_gives_back_what_it_was_granted(
    sim: SimDevice, caches: Any, how: str, gpu_mb: float, at: str
) -> None:
    cache = caches(gpu_mb=gpu_mb, cpu_mb=1)
    assert await cache.wait_host_ready(5)
    if gpu_mb:
        await cache.put("old", value(1024))
    with sim.hold():  # the offload that makes room is held (host-only: "old"'s own)
        if not gpu_mb:
            await cache.put("old", value(1024))
        waiting = asyncio.create_task(failing_put(cache, how, 1024)())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        if at == "waiting":
            waiting.cancel()
    if at == "room-landed":  # the room may be granted before the cancellation arrives
        sim.synchronize()
        await asyncio.sleep(0)
        waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(cache) <= 1
    await assert_all_given_back(sim, cache, MiB if "old" in cache else 0)
    assert await asyncio.wait_for(cache.put("next", value(1024, 9)), 5)


# --- reads that reserve device memory -------------------------------------------------


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("fault", ["copy_on", "_empty"])
async def test_a_read_whose_upload_cannot_be_queued_frees_its_device_memory(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch, promote: bool, fault: str
) -> None:
    # Into free room only: a full tier's eviction for the hit would meet the same fault.
    cache = caches(gpu_mb=1, cpu_mb=2, promote_on_hit=promote, promote_policy="room")
    await cache.put("a", value(512, 1))
    await cache.put("b", value(1024, 2))  # "a" goes to the host tier
    await cache.drain()
    sim.synchronize()
    before = sim.allocated_bytes

    def refused(*args: object, **kwargs: object) -> object:
        raise RuntimeError("injected: the upload cannot be queued")

    monkeypatch.setattr(sim, fault, refused)
    with pytest.raises(RuntimeError, match="injected"):
        await cache.get("a")
    monkeypatch.undo()
    sim.synchronize()
    assert sim.allocated_bytes == before
    await assert_all_given_back(sim, cache, MiB + 512 * KiB)
    assert_exact(await cache.get("a"), value(512, 1))
    assert_exact(await cache.get("a", device="cpu"), value(512, 1))


async def test_a_get_or_compute_whose_put_fails_leaves_the_key_computable(
    sim: SimDevice, caches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = caches(gpu_mb=1)
    await cache.start()
    unreadable_after_reserving(sim, monkeypatch)
    _Unreadable.armed = 1
    callers = [cache.get_or_compute("k", lambda: value(1024, 1)) for _ in range(4)]
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    await assert_all_given_back(sim, cache, 0)
    assert_exact(await cache.get_or_compute("k", lambda: value(1024, 1)), value(1024, 1))

"""get_or_compute: concurrent callers share one computation, which outlives its callers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

from mmcache import FeatureCache, MMCacheError, ReentrantComputeError, ValueTooLargeError

N = 8


class Encoder:
    """A stand-in for a vision encoder: counts its calls, optionally waits for a gate."""

    def __init__(self, rig: Rig, seed: int = 0, gate: asyncio.Event | None = None) -> None:
        self.rig = rig
        self.seed = seed
        self.gate = gate
        self.calls = 0
        self.finished = 0
        self.expected = rig.tensor(32, 64, seed=seed).cpu().clone()

    def sync(self) -> torch.Tensor:
        self.calls += 1
        self.finished += 1
        return self.rig.tensor(32, 64, seed=self.seed)

    async def run(self) -> torch.Tensor:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        else:
            await asyncio.sleep(0.005)
        self.finished += 1
        return self.rig.tensor(32, 64, seed=self.seed)


async def until_cached(cache: FeatureCache, key: str) -> None:
    for _ in range(200):
        if key in cache:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{key!r} was never cached")


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("gpu_mb", [1, 0], ids=["gpu-tier", "host-only"])
async def test_concurrent_callers_share_one_call(
    rig: Rig, make_cache: CacheFactory, kind: str, gpu_mb: float
) -> None:
    cache = make_cache(gpu_mb=gpu_mb, cpu_mb=1)
    enc = Encoder(rig, seed=1)
    fn: Callable[[], object] = enc.sync if kind == "sync" else enc.run
    results = await asyncio.gather(*(cache.get_or_compute("k", fn) for _ in range(N)))  # type: ignore[arg-type]
    assert enc.calls == 1
    for out in results:
        assert_exact(out, enc.expected)
    del results
    assert "k" in cache and len(cache) == 1
    await cache.drain()
    assert_exact(await cache.get("k"), enc.expected)
    assert_exact(await cache.get("k", device="cpu"), enc.expected)
    # Later callers hit the cache.
    assert_exact(await cache.get_or_compute("k", enc.run), enc.expected)
    assert enc.calls == 1


async def test_different_keys_compute_separately(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    encs = [Encoder(rig, seed=i) for i in range(3)]
    results = await asyncio.gather(
        *(cache.get_or_compute(("img", i % 3), encs[i % 3].run) for i in range(9))
    )
    assert [e.calls for e in encs] == [1, 1, 1]
    for i, out in enumerate(results):
        assert_exact(out, encs[i % 3].expected)


async def test_an_error_reaches_every_waiter_and_nothing_is_cached(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    calls = 0

    class EncoderFailed(Exception):
        pass

    async def failing() -> torch.Tensor:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.005)
        raise EncoderFailed("the encoder ran out of memory")

    results = await asyncio.gather(
        *(cache.get_or_compute("k", failing) for _ in range(N)), return_exceptions=True
    )
    assert calls == 1
    assert all(isinstance(r, EncoderFailed) for r in results)
    assert "k" not in cache and len(cache) == 0
    s = cache.stats()
    assert (s.gpu_bytes, s.gpu_entries) == (0, 0)
    # The failure is not remembered: the next caller computes again.
    enc = Encoder(rig, seed=2)
    assert_exact(await cache.get_or_compute("k", enc.sync), enc.expected)
    assert enc.calls == 1


async def test_a_value_too_large_to_cache_fails_every_waiter(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.0625, cpu_mb=1)  # 64 KiB
    calls = 0

    async def too_large() -> torch.Tensor:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.005)
        return rig.tensor(65, 256, dtype=torch.float32)  # 65 KiB

    results = await asyncio.gather(
        *(cache.get_or_compute("k", too_large) for _ in range(N)), return_exceptions=True
    )
    assert calls == 1
    assert all(isinstance(r, ValueTooLargeError) for r in results)
    assert "k" not in cache
    await cache.drain()
    assert cache.stats().gpu_bytes == 0
    if rig.kind == "sim":
        assert rig.allocated_bytes() == 0


async def test_a_cancelled_waiter_does_not_cancel_the_computation(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    enc = Encoder(rig, seed=3, gate=asyncio.Event())
    first = asyncio.create_task(cache.get_or_compute("k", enc.run))
    second = asyncio.create_task(cache.get_or_compute("k", enc.run))
    await asyncio.sleep(0.01)
    assert enc.calls == 1 and not first.done() and not second.done()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    enc.gate.set()  # type: ignore[union-attr]
    assert_exact(await asyncio.wait_for(second, 2), enc.expected)
    assert enc.calls == 1 and enc.finished == 1
    assert_exact(await cache.get("k"), enc.expected)


async def test_the_value_is_cached_even_if_every_waiter_was_cancelled(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    gate = asyncio.Event()
    enc = Encoder(rig, seed=4, gate=gate)
    waiters = [asyncio.create_task(cache.get_or_compute("k", enc.run)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert enc.calls == 1
    for w in waiters:
        w.cancel()
    for w in waiters:
        with pytest.raises(asyncio.CancelledError):
            await w
    assert "k" not in cache
    gate.set()
    await until_cached(cache, "k")
    assert enc.finished == 1
    assert_exact(await cache.get("k"), enc.expected)
    # A new caller gets the cached value, not a second computation.
    assert_exact(await cache.get_or_compute("k", enc.run), enc.expected)
    assert enc.calls == 1


async def test_a_cached_key_does_not_call_fn(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = rig.tensor(32, 64, seed=5)
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t

    def must_not_run() -> torch.Tensor:
        raise AssertionError("fn called for a cached key")

    assert_exact(await cache.get_or_compute("k", must_not_run), expected)
    assert_exact(await cache.get_or_compute("k", must_not_run, device="cpu"), expected)
    assert_exact(await cache.get_or_compute("k", must_not_run, rows=slice(3, 9)), expected[3:9])


async def test_a_host_resident_key_does_not_call_fn(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = rig.tensor(32, 64, seed=6)
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t
    await cache.drain()

    def must_not_run() -> torch.Tensor:
        raise AssertionError("fn called for a cached key")

    assert_exact(await cache.get_or_compute("k", must_not_run), expected)
    assert_exact(await cache.get_or_compute("k", must_not_run, rows=slice(-4, None)), expected[-4:])


async def test_rows_and_host_copies_from_a_shared_computation(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    enc = Encoder(rig, seed=7)
    whole, rows, host, host_rows = await asyncio.gather(
        cache.get_or_compute("k", enc.run),
        cache.get_or_compute("k", enc.run, rows=slice(2, 10)),
        cache.get_or_compute("k", enc.run, device="cpu"),
        cache.get_or_compute("k", enc.run, device="cpu", rows=slice(-5, -1)),
    )
    assert enc.calls == 1
    assert_exact(whole, enc.expected)
    assert_exact(rows, enc.expected[2:10])
    assert_exact(host, enc.expected)
    assert_exact(host_rows, enc.expected[-5:-1])
    assert host.device.type == "cpu" and host_rows.device.type == "cpu"
    host.fill_(3)  # the caller owns host copies: this must not reach the cache
    host_rows.fill_(3)
    await cache.drain()
    assert_exact(await cache.get("k"), enc.expected)
    assert_exact(await cache.get("k", device="cpu"), enc.expected)


# --- a computation that asks for its own key ------------------------------------------


async def assert_left_nothing(rig: Rig, cache: FeatureCache, *keys: str) -> None:
    """The failed computations cached nothing, hold nothing, and the keys compute again."""
    for k in keys:
        assert k not in cache
    assert not cache._life.inflight
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_bytes, s.leaked_bytes) == (0, 0)
    enc = Encoder(rig, seed=5)
    for k in keys:
        assert_exact(await asyncio.wait_for(cache.get_or_compute(k, enc.sync), 5), enc.expected)


def reentrant(cache: FeatureCache, rig: Rig, how: str) -> Callable[[], Awaitable[torch.Tensor]]:
    """An fn for key "k" that waits for "k" itself, in one of several ways."""

    async def fn() -> torch.Tensor:
        again = cache.get_or_compute("k", fn)
        if how == "direct":
            return await again
        if how == "task":
            return await asyncio.create_task(again)
        if how == "gather":
            return (await asyncio.gather(again, asyncio.sleep(0)))[0]
        if how == "task-in-task":

            async def outer() -> torch.Tensor:
                return await asyncio.create_task(again)

            return await asyncio.create_task(outer())
        raise AssertionError(how)

    return fn


@pytest.mark.parametrize("how", ["direct", "task", "gather", "task-in-task"])
async def test_a_computation_that_waits_for_its_own_key_raises_instead_of_hanging(
    rig: Rig, make_cache: CacheFactory, how: str
) -> None:
    cache = make_cache(copy_timeout_s=30)
    others = Encoder(rig, seed=2)
    with pytest.raises(ReentrantComputeError, match=r"get_or_compute\('k'\).*its own fn"):
        await asyncio.wait_for(cache.get_or_compute("k", reentrant(cache, rig, how)), 5)
    assert isinstance(ReentrantComputeError("x"), MMCacheError)
    # Unrelated work goes on meanwhile and afterwards.
    assert_exact(await cache.get_or_compute("other", others.sync), others.expected)
    assert cache.discard("other")
    await assert_left_nothing(rig, cache, "k")


async def test_callers_outside_the_computation_share_its_error(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    fn = reentrant(cache, rig, "direct")
    results = await asyncio.wait_for(
        asyncio.gather(*(cache.get_or_compute("k", fn) for _ in range(N)), return_exceptions=True),
        5,
    )
    assert all(isinstance(r, ReentrantComputeError) for r in results)
    await assert_left_nothing(rig, cache, "k")


async def test_two_computations_that_wait_for_each_other_raise(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()

    async def fn_a() -> torch.Tensor:
        return await cache.get_or_compute("b", fn_b)

    async def fn_b() -> torch.Tensor:
        return await cache.get_or_compute("a", fn_a)

    with pytest.raises(ReentrantComputeError, match=r"get_or_compute\('a'\)"):
        await asyncio.wait_for(cache.get_or_compute("a", fn_a), 5)
    await assert_left_nothing(rig, cache, "a", "b")


async def test_a_computation_may_ask_for_other_keys_and_read_its_own_miss(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache()
    inner = Encoder(rig, seed=3)
    outer = Encoder(rig, seed=4)

    async def fn() -> torch.Tensor:
        assert await cache.get("k") is None  # a plain get of its own key is a miss, not a wait
        await cache.get_or_compute("inner", inner.run)  # nested single flight of another key
        return await outer.run()

    assert_exact(await asyncio.wait_for(cache.get_or_compute("k", fn), 5), outer.expected)
    assert_exact(await cache.get("inner"), inner.expected)
    # Once computed, the same fn's key is a hit from anywhere, also from a later computation.
    assert_exact(await cache.get_or_compute("k", fn), outer.expected)


async def test_close_after_a_reentrant_computation_does_not_wait_for_the_copy_timeout(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(copy_timeout_s=30)
    task = asyncio.create_task(cache.get_or_compute("k", reentrant(cache, rig, "task")))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(cache.close(), 5)
    assert loop.time() - started < 2
    with pytest.raises(ReentrantComputeError):
        await task


async def test_a_computation_started_over_a_running_one_leaves_it_to_finish() -> None:
    """SingleFlight.start (a group's agreed miss): a new computation takes the key's place,
    later callers join it, and the one it displaced still runs and is still waited for."""
    from mmcache.single_flight import SingleFlight

    flights: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()

    async def slow() -> int:
        await gate.wait()
        return 1

    async def fast() -> int:
        return 2

    first = flights.start("k", slow)
    second = flights.start("k", fast)
    assert flights.joinable("k") is second and flights.run("k", fast) is second
    assert set(flights.running()) == {first, second} and len(flights) == 2
    assert await second == 2
    assert flights.running() == [first]  # displaced, not forgotten: close waits for it
    gate.set()
    assert await first == 1
    assert flights.running() == [] and len(flights) == 0 and flights.joinable("k") is None

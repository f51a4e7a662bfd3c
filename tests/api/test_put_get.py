"""put and get: bit-exact round trips in every tier, rows= reads, host copies the caller owns."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, needs_hold

from mmcache import FeatureCache, InvalidRowsError, InvalidValueError
from mmcache.core.entry import Entry
from mmcache.device import Fence

DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.int64]
SHAPES = [(4096,), (64, 128), (8, 16, 32)]


def make_data(
    rig: Rig, *shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> torch.Tensor:
    """Random data on the rig's device; integers spread over a wide range (few zeros)."""
    if dtype.is_floating_point:
        return rig.tensor(*shape, dtype=dtype, seed=seed)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(low, high, shape, generator=g, dtype=dtype)
    return t if rig.kind == "sim" else t.to(rig.device.name)


async def put_resident(cache: FeatureCache, key: Hashable, value: torch.Tensor, state: str) -> None:
    """Put value and settle it in state "gpu" or "host" (the cache's GPU budget decides)."""
    assert await cache.put(key, value)
    await cache.drain()
    s = cache.stats()
    if state == "gpu":
        assert s.gpu_entries == 1 and s.cpu_entries == 0
    else:
        assert s.gpu_entries == 0 and s.cpu_entries == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("state", ["gpu", "host"])
@pytest.mark.parametrize("device", [None, "cpu"])
async def test_round_trip_is_bit_exact(
    rig: Rig,
    make_cache: CacheFactory,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    state: str,
    device: str | None,
) -> None:
    cache = make_cache(gpu_mb=1 if state == "gpu" else 0, cpu_mb=1)
    t = make_data(rig, *shape, dtype=dtype, seed=3)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, state)
    del t
    out = await cache.get("k", device=device)
    assert_exact(out, expected)
    assert out is not None
    if device == "cpu":
        assert out.device.type == "cpu"
    else:
        assert rig.device.is_device_tensor(out)
    # A second read is as good as the first (nothing was consumed or recycled).
    assert_exact(await cache.get("k", device=device), expected)


ROWS = [
    slice(0, 3),
    slice(2, 7),
    slice(None, 4),
    slice(6, None),
    slice(None),
    slice(-3, None),
    slice(-5, -2),
    slice(4, 4),
    slice(0, 10, 1),
]


@pytest.mark.parametrize("state", ["gpu", "host"])
@pytest.mark.parametrize("device", [None, "cpu"])
async def test_rows_of_a_resident_entry(
    rig: Rig, make_cache: CacheFactory, state: str, device: str | None
) -> None:
    cache = make_cache(gpu_mb=1 if state == "gpu" else 0, cpu_mb=1)
    t = make_data(rig, 10, 8, 32, dtype=torch.float32, seed=5)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, state)
    del t
    for rows in ROWS:
        assert_exact(await cache.get("k", rows=rows, device=device), expected[rows])
    # The whole feature is still intact after partial reads.
    assert_exact(await cache.get("k", device=device), expected)


@pytest.mark.parametrize("device", [None, "cpu"])
async def test_rows_of_an_entry_being_offloaded(
    rig: Rig, make_cache: CacheFactory, device: str | None
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)  # every put is offloaded at once
    t = make_data(rig, 10, 8, 32, dtype=torch.float32, seed=6)
    expected = t.cpu().clone()
    with rig.hold():
        assert await cache.put("k", t)
        del t
        assert cache.stats().pending_copies == 1
        tasks = [asyncio.create_task(cache.get("k", rows=r, device=device)) for r in ROWS]
        await asyncio.sleep(0.01)
        if device == "cpu":  # host reads wait for the offload to land
            assert not any(task.done() for task in tasks)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    for rows, out in zip(ROWS, results, strict=True):
        assert_exact(out, expected[rows])
    await cache.drain()
    assert_exact(await cache.get("k", device=device), expected)


@pytest.mark.parametrize("state", ["gpu", "host"])
@pytest.mark.parametrize(
    "rows",
    [slice(0, 4, 2), slice(0, 4, -1), slice(0, 11), slice(-11, None), slice(5, 3), slice(0, 2.0)],
    ids=str,
)
async def test_bad_rows_raise(rig: Rig, make_cache: CacheFactory, state: str, rows: slice) -> None:
    cache = make_cache(gpu_mb=1 if state == "gpu" else 0, cpu_mb=1)
    t = make_data(rig, 10, 64, seed=7)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, state)
    del t
    for device in (None, "cpu"):
        with pytest.raises(InvalidRowsError):
            await cache.get("k", rows=rows, device=device)
    assert_exact(await cache.get("k"), expected)


@pytest.mark.parametrize("rows", [3, (0, 2), range(2), [0, 1], "0:2"], ids=repr)
async def test_rows_must_be_a_slice(rig: Rig, make_cache: CacheFactory, rows: object) -> None:
    cache = make_cache()
    t = make_data(rig, 10, 64, seed=8)
    await cache.put("k", t)
    del t
    with pytest.raises(InvalidRowsError, match="slice"):
        await cache.get("k", rows=rows)  # type: ignore[arg-type]


async def test_rows_need_a_dimension(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = make_data(rig, 1, dtype=torch.float32).reshape(())
    await cache.put("scalar", t)
    del t
    with pytest.raises(InvalidRowsError):
        await cache.get("scalar", rows=slice(0, 1))


@pytest.mark.parametrize("state", ["gpu", "offloading", "host"])
async def test_host_get_returns_a_copy_the_caller_owns(
    rig: Rig, make_cache: CacheFactory, state: str
) -> None:
    cache = make_cache(gpu_mb=1 if state == "gpu" else 0, cpu_mb=1)
    t = make_data(rig, 16, 64, seed=9)
    expected = t.cpu().clone()
    if state == "offloading":
        needs_hold(rig)
        with rig.hold():
            await cache.put("k", t)
            del t
            task = asyncio.create_task(cache.get("k", device="cpu"))
            rows_task = asyncio.create_task(cache.get("k", device="cpu", rows=slice(2, 5)))
            await asyncio.sleep(0.01)
            assert not task.done() and not rows_task.done()
        out = await asyncio.wait_for(task, 2)
        part = await asyncio.wait_for(rows_task, 2)
    else:
        await put_resident(cache, "k", t, state)
        del t
        out = await cache.get("k", device="cpu")
        part = await cache.get("k", device="cpu", rows=slice(2, 5))
    assert out is not None and part is not None
    assert_exact(out, expected)
    assert_exact(part, expected[2:5])
    out.fill_(7)
    part.fill_(7)
    del out, part
    await cache.drain()
    assert_exact(await cache.get("k", device="cpu"), expected)
    assert_exact(await cache.get("k"), expected)


@pytest.mark.parametrize("rows", [None, slice(2, 5)])
async def test_a_small_host_read_is_one_memcpy_not_torchs_copies(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch, rows: slice | None
) -> None:
    """A small host hit read to the CPU is one memcpy into a tensor from the device's host
    allocator (pinned on CUDA): torch's clone and copy_ would wake its intra-op threads
    for less than they save (mmcache.host_copy.PARALLEL_FROM_BYTES)."""
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = make_data(rig, 16, 64, seed=5)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, "host")
    del t

    def refused(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a host read went through torch's copies")

    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "clone", refused)
        patched.setattr(torch.Tensor, "copy_", refused)
        out = await cache.get("k", device="cpu", rows=rows)
    assert_exact(out, expected if rows is None else expected[rows])
    assert out is not None and out.is_pinned() == (rig.kind == "cuda")


async def test_borrow_lends_the_host_copy_itself(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = make_data(rig, 16, 64, seed=6)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, "host")
    del t
    async with cache.borrow("k") as borrowed:
        assert_exact(borrowed, expected)
        assert borrowed is not None
        assert borrowed.untyped_storage().nbytes() > borrowed.nbytes  # a view of the arena


async def test_borrow_copies_host_bytes_that_cross_two_pinned_chunks(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device copy of a view over two pinned registrations is refused by the driver: such
    a feature is lent as a copy of its own."""
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = make_data(rig, 16, 64, seed=7)
    expected = t.cpu().clone()
    await put_resident(cache, "k", t, "host")
    del t
    asked: list[int] = []

    def across_chunks(host: torch.Tensor) -> bool:
        asked.append(host.nbytes)
        return False

    monkeypatch.setattr(rig.device, "one_pinned_range", across_chunks)
    async with cache.borrow("k") as borrowed:
        assert_exact(borrowed, expected)
        assert borrowed is not None
        assert borrowed.untyped_storage().nbytes() == borrowed.nbytes  # its own
        assert borrowed.is_pinned() == (rig.kind == "cuda")
    assert asked == [expected.nbytes]


async def test_contains_len_and_discard(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.0625, cpu_mb=1)  # 64 KiB GPU: the first entry goes to host
    keys: list[Hashable] = ["img", b"raw", 7, ("video", 3, (b"f", 1))]
    expected = {}
    for i, key in enumerate(keys):
        t = make_data(rig, 64, 256, seed=i)  # 32 KiB each
        expected[key] = t.cpu().clone()
        assert key not in cache
        assert await cache.put(key, t)
        del t
        assert key in cache
        assert len(cache) == i + 1
    await cache.drain()
    s = cache.stats()
    assert s.gpu_entries == 2 and s.cpu_entries == 2

    for key in keys[:2]:  # host-resident ones
        assert cache.discard(key) is True
        assert key not in cache
        assert cache.discard(key) is False
    assert len(cache) == 2
    await cache.drain()
    s = cache.stats()
    assert (s.cpu_entries, s.cpu_bytes) == (0, 0)
    assert await cache.get(keys[0]) is None

    assert cache.discard(keys[2]) is True  # GPU-resident
    assert len(cache) == 1
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_entries, s.gpu_bytes) == (1, 32 * 1024)
    assert s.leaked_bytes == 0
    assert_exact(await cache.get(keys[3]), expected[keys[3]])
    assert cache.discard("never-there") is False


async def test_get_of_a_missing_key_is_a_miss(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = make_data(rig, 8, 64)
    await cache.put("present", t)
    del t
    before = cache.stats()
    assert await cache.get("absent") is None
    assert await cache.get("absent", device="cpu") is None
    assert await cache.get(("absent", 1), rows=slice(0, 1)) is None
    after = cache.stats()
    assert after.misses == before.misses + 3
    assert (after.hits_gpu, after.hits_cpu) == (before.hits_gpu, before.hits_cpu)
    assert await cache.get("present") is not None
    assert cache.stats().hits_gpu == before.hits_gpu + 1


async def test_discard_while_a_host_get_waits_on_the_offload(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = make_data(rig, 16, 64, seed=11)
    expected = t.cpu().clone()
    with rig.hold():
        await cache.put("k", t)
        del t
        task = asyncio.create_task(cache.get("k", device="cpu"))
        await asyncio.sleep(0.01)
        assert not task.done()
        assert cache.discard("k") is True
    # The read began before the discard: it returns the feature (its block is pinned).
    assert_exact(await asyncio.wait_for(task, 2), expected)
    await cache.drain()
    assert cache.stats().cpu_bytes == 0


@pytest.mark.parametrize("rows", [None, slice(3, 9)])
@pytest.mark.parametrize("how", ["discard", "re-put"])
async def test_replacing_a_computed_entry_during_its_host_read(
    rig: Rig, make_cache: CacheFactory, how: str, rows: slice | None
) -> None:
    # get_or_compute's own download of what it just cached: a discard or a newer put
    # landing before that copy runs must not hand the caller released memory.
    needs_hold(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    expected = make_data(rig, 64, 256, dtype=torch.float32, seed=14).cpu()
    with rig.hold():
        reading = asyncio.create_task(
            cache.get_or_compute(
                "k",
                lambda: make_data(rig, 64, 256, dtype=torch.float32, seed=14),
                device="cpu",
                rows=rows,
            )
        )
        for _ in range(20):
            await asyncio.sleep(0.001)
            if "k" in cache:
                break
        assert "k" in cache and not reading.done()
        if how == "discard":
            assert cache.discard("k")
        else:
            assert await cache.put("k", make_data(rig, 8, 256, dtype=torch.float32, seed=15))
        gc.collect()
    want = expected if rows is None else expected[rows]
    assert_exact(await asyncio.wait_for(reading, 2), want)
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


@pytest.mark.parametrize("how", ["discard", "re-put"])
async def test_replacing_a_gpu_entry_during_a_host_read_of_it(
    rig: Rig, make_cache: CacheFactory, how: str
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    t = make_data(rig, 64, 256, dtype=torch.float32, seed=12)  # 64 KiB
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t
    with rig.hold():
        reading = asyncio.create_task(cache.get("k", device="cpu"))
        rows = asyncio.create_task(cache.get("k", device="cpu", rows=slice(5, 9)))
        await asyncio.sleep(0.01)
        assert not reading.done() and not rows.done()
        if how == "discard":
            assert cache.discard("k")
        else:
            newer = make_data(rig, 8, 256, dtype=torch.float32, seed=13)
            newer_expected = newer.cpu().clone()
            assert await cache.put("k", newer)
            del newer
        # The old tensor is still read by the held copies: it stays alive and charged.
        assert cache.stats().gpu_bytes >= 64 * 1024
    assert_exact(await asyncio.wait_for(reading, 2), expected)
    assert_exact(await asyncio.wait_for(rows, 2), expected[5:9])
    del reading, rows
    await cache.drain()
    s = cache.stats()
    if how == "discard":
        assert (s.gpu_bytes, len(cache)) == (0, 0)
    else:
        assert s.gpu_bytes == 8 * 1024
        assert_exact(await cache.get("k"), newer_expected)
    assert s.leaked_bytes == 0


async def test_a_rows_read_keeps_no_device_memory_alive(rig: Rig, make_cache: CacheFactory) -> None:
    needs_hold(rig)  # counts SimDevice.allocated_bytes
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    t = make_data(rig, 64, 256, dtype=torch.float32, seed=14)
    expected = t.cpu().clone()
    await cache.put("k", t)
    del t
    assert_exact(await cache.get("k", device="cpu", rows=slice(5, 9)), expected[5:9])
    assert cache.discard("k")
    await cache.drain()
    assert cache.stats().gpu_bytes == 0
    assert rig.allocated_bytes() == 0


class _DoneBetweenTheChecks(Fence):
    """A producer fence whose copy completes well between a read's ok() and done()."""

    def __init__(self) -> None:
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.asked > 1  # pending when ok() asks first, done from the next call on

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done()


async def test_a_producer_copy_that_completes_during_the_read_is_served(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    t = make_data(rig, 64, 64, dtype=torch.float32, seed=15)
    expected = t.cpu().clone()
    assert await cache.put("k", t)
    await cache.drain()
    entry = cache._core.state.index["k"]
    assert isinstance(entry, Entry)
    entry.ready = _DoneBetweenTheChecks()
    assert_exact(await cache.get("k"), expected)


async def test_a_lazy_conjugate_is_cached_as_its_values(rig: Rig, make_cache: CacheFactory) -> None:
    # conj() only flips a bit: the bytes are the original's, and offloads copy bytes.
    cache = make_cache(gpu_mb=0.25, cpu_mb=2)
    assert await cache.wait_host_ready(timeout=30)
    base = make_data(rig, 64, 64, dtype=torch.float32, seed=21)
    z = torch.complex(base, base.flip(0)).conj()  # 32 KiB
    assert z.is_conj()
    expected = z.cpu().resolve_conj().clone()
    assert await cache.put("z", z)
    del z
    for i in range(12):  # push it to the host tier (gets would promote it back)
        assert await cache.put(i, make_data(rig, 128, 64, dtype=torch.float32, seed=i))
    await cache.drain()
    assert "z" in cache and cache.stats().cpu_entries >= 1
    got = await cache.get("z", device="cpu")
    assert got is not None and not got.is_conj()
    assert_exact(got, expected)
    assert cache.stats().leaked_bytes == 0


async def test_two_puts_of_one_key_that_wait_for_room_leave_the_later_one(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=2)
    assert await cache.wait_host_ready(timeout=30)
    for i in range(8):  # the GPU tier full: 8 x 32 KiB
        assert await cache.put(i, make_data(rig, 128, 64, dtype=torch.float32, seed=i))
    a = make_data(rig, 128, 64, dtype=torch.float32, seed=30)
    b = make_data(rig, 128, 64, dtype=torch.float32, seed=31)
    expected = b.cpu().clone()
    with rig.hold():  # the offloads that make room cannot land yet: both puts wait
        first = asyncio.create_task(cache.put("k", a))
        second = asyncio.create_task(cache.put("k", b))
        del a, b
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()
    assert await asyncio.wait_for(first, 5) and await asyncio.wait_for(second, 5)
    del first, second
    await cache.drain()
    assert_exact(await cache.get("k", device="cpu"), expected)
    s = cache.stats()
    assert s.leaked_bytes == 0
    assert s.gpu_entries + s.cpu_entries == len(cache) == 9


async def test_which_puts_take_the_short_path(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    await cache.start()
    general: list[object] = []
    put_batch = cache._puts.put_batch

    async def counted(items: Any, stream: Any, wait: bool, cost: float | None = None) -> bool:
        general.append(items[0][0])
        return await put_batch(items, stream, wait, cost)

    monkeypatch.setattr(cache._puts, "put_batch", counted)
    whole = make_data(rig, 16, 64, dtype=torch.float32, seed=1)
    assert await cache.put("new", whole)  # a new key, a tensor of its own storage
    assert await cache.put("new", make_data(rig, 16, 64, dtype=torch.float32, seed=2))
    wide = make_data(rig, 16, 128, dtype=torch.float32, seed=3)
    assert await cache.put("view", wide[:, :64])  # compacted first
    with pytest.raises(InvalidValueError):
        await cache.put("empty", make_data(rig, 0, 64, dtype=torch.float32))
    assert general == ["new", "view", "empty"]  # the replacing put, the view, the bad value
    assert len(cache) == 2 and cache.stats().leaked_bytes == 0

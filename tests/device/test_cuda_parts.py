"""CudaDevice's parts whose logic needs no GPU: the arena's chunks, a batch's runs, and
how the parts hold one another.

The pinned arena runs here with a stand-in driver (pinning is its only GPU call); a
batch's runs are planned from host tensors standing in for device ones. The same
scenarios on a GPU are in test_cuda_device.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import threading
import time
import weakref
from typing import Any, cast

import pytest
import torch

import mmcache.device.cuda as cuda
from mmcache.device.base import PIN_PACE, batch_order
from mmcache.device.cuda_arena import PinnedArena
from mmcache.device.cuda_batch import BatchedCopies
from mmcache.device.cuda_copies import CudaCopies
from mmcache.device.cuda_driver import CudaDriver
from mmcache.device.cuda_memory import DeviceMemory
from mmcache.errors import CacheClosedError, InvalidValueError, MMCacheError

KiB = 1 << 10
MiB = 1 << 20


class Driver:
    """Records the pinning calls an arena makes."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def host_register(self, ordinal: int, ptr: int, nbytes: int, setting: str) -> None:
        self.registered[ptr] = nbytes

    def host_unregister(self, ordinal: int, ptr: int) -> None:
        self.unregistered.append(ptr)


def an_arena(driver: Driver, chunk: int = MiB) -> PinnedArena:
    return PinnedArena(
        "cuda:0",
        0,
        lambda: cast(CudaDriver, driver),
        method="register",
        background_pinning=False,
        pin_chunk_bytes=chunk,
        huge_pages=False,
    )


def test_an_arena_is_pinned_in_chunks_and_copies_split_where_they_cross_one() -> None:
    driver = Driver()
    arena = an_arena(driver)
    host = arena.host_arena(3 * MiB + 100)
    base = host.data_ptr()
    assert sorted(driver.registered.items()) == [
        (base, MiB),
        (base + MiB, MiB),
        (base + 2 * MiB, MiB),
        (base + 3 * MiB, 4096),  # whole pages
    ]
    assert (arena.ptr, arena.nbytes) == (base, 3 * MiB + 100)
    assert arena.chunk_pieces(base + 10, MiB - 10) is None  # inside the first chunk
    assert arena.chunk_pieces(base + MiB - 10, 30) == [(0, 10), (10, 30)]
    assert arena.chunk_pieces(base + 10, 2 * MiB) == [
        (0, MiB - 10),
        (MiB - 10, 2 * MiB - 10),
        (2 * MiB - 10, 2 * MiB),
    ]
    outside = torch.empty(64, dtype=torch.uint8)
    assert arena.chunk_pieces(outside.data_ptr(), 64) is None
    assert arena.contains(host[MiB : 2 * MiB]) and not arena.contains(outside)
    with pytest.raises(MMCacheError, match="already allocated"):
        arena.host_arena(MiB)
    arena.stop_pinning()
    arena.unpin()
    assert sorted(driver.unregistered) == sorted(driver.registered)


def _resident_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(pages of [ptr, ptr + nbytes) in memory, pages in all), by mincore(2)."""
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ptr, nbytes, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(
    tuple(int(p) for p in os.uname().release.split(".")[:2]) < (5, 14),
    reason="MADV_POPULATE_WRITE needs Linux 5.14",
)
def test_an_arena_chunk_is_in_memory_before_it_is_registered() -> None:
    """The kernel's zero-fill of fresh pages happens before the registration, not inside it
    (where it would hold the driver's lock that kernel launches wait for)."""
    seen: list[tuple[int, int]] = []

    class Resident(Driver):
        def host_register(self, ordinal: int, ptr: int, nbytes: int, setting: str) -> None:
            seen.append(_resident_pages(ptr, nbytes))
            super().host_register(ordinal, ptr, nbytes, setting)

    arena = an_arena(Resident(), chunk=4 * MiB)
    arena.host_arena(16 * MiB)
    assert len(seen) == 4
    assert all(resident == pages for resident, pages in seen), seen


def test_an_arena_smaller_than_a_chunk_needs_no_split() -> None:
    arena = an_arena(Driver())
    host = arena.host_arena(MiB)
    assert arena.chunk_pieces(host.data_ptr(), MiB) is None


def test_an_arena_is_unpinned_with_its_last_reference() -> None:
    driver = Driver()
    arena = an_arena(driver)
    arena.host_arena(2 * MiB)
    gone = weakref.ref(arena)
    gc.disable()  # by its reference count, not by the collector
    try:
        del arena
        assert gone() is None
        assert len(driver.unregistered) == 2
    finally:
        gc.enable()


def test_a_stopped_arena_is_not_made() -> None:
    arena = an_arena(Driver())
    arena.stop_pinning()
    with pytest.raises(CacheClosedError, match="closed"):
        arena.host_arena(MiB)


def a_batcher(pack_max_bytes: int = 64 * KiB) -> BatchedCopies:
    """Batches of host tensors, standing in for a GPU's."""
    memory = DeviceMemory(torch.device("cpu"), "cpu", cast(Any, None))
    arena = an_arena(Driver())
    copies = CudaCopies(
        torch.device("cpu"), "cpu", memory, arena, cast(Any, None), cast(Any, None), cast(Any, None)
    )
    return BatchedCopies("cpu", memory, arena, copies, None, pack_max_bytes)


def runs_of(batcher: BatchedCopies, srcs: list[torch.Tensor], offsets: list[int]) -> list[Any]:
    host = torch.empty(4 * MiB, dtype=torch.uint8)
    runs = batcher.packed_runs(batch_order(srcs, host, offsets))
    return [([id(s) for s in run], start, nbytes) for run, start, nbytes in runs]


def test_back_to_back_small_sources_of_one_kind_form_one_run() -> None:
    batcher = a_batcher()
    a, b, c = (torch.zeros(4, 32) for _ in range(3))  # 512 bytes each
    other_dtype = torch.zeros(4, 64, dtype=torch.float16)  # 512 bytes
    large = torch.zeros(128, 256)  # 128 KiB: over pack_max_bytes, alone
    srcs = [c, a, b, other_dtype, large]
    offsets = [1024, 0, 512, 1536, 4096]
    assert runs_of(batcher, srcs, offsets) == [
        ([id(a), id(b), id(c)], 0, 1536),  # in host order, whatever the order given
        ([id(other_dtype)], 1536, 512),
        ([id(large)], 4096, 128 * KiB),
    ]
    # A gap between two ranges starts a new run.
    assert runs_of(batcher, [a, b], [0, 1024]) == [([id(a)], 0, 512), ([id(b)], 1024, 512)]


def test_a_batch_source_whose_bytes_are_not_its_values_is_refused() -> None:
    batcher = a_batcher()
    with pytest.raises(InvalidValueError, match="contiguous"):
        runs_of(batcher, [torch.zeros(8, 8).t()], [0])
    with pytest.raises(InvalidValueError, match="contiguous"):
        runs_of(batcher, [torch.zeros(8, dtype=torch.complex64).conj()], [0])


def test_without_batched_copies_no_batch_goes_to_the_driver_unchecked() -> None:
    batcher = a_batcher()
    assert batcher.copier is None
    srcs = [torch.zeros(256, 256), torch.zeros(256, 256)]
    assert batcher.owned_ranges(srcs, torch.empty(MiB, dtype=torch.uint8), [0, 256 * KiB]) is None


class BareDriver(Driver):
    """A driver without batched copies."""

    def batch_copier(self, ordinal: int, direction: str = "d2h") -> None:
        return None


def test_a_dropped_device_unpins_its_arena_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No reference cycle among a CudaDevice's parts: its registered arena is unpinned when
    the device's last reference goes, not whenever the cyclic collector next runs."""
    driver = BareDriver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_resolve_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(cuda, "new_stream", lambda device, priority: None)
    monkeypatch.setattr(cuda.CudaDevice, "_warm_up", lambda self: None)
    monkeypatch.setattr(CudaDriver, "get", classmethod(lambda cls: driver))
    device = cuda.CudaDevice(0, pin_chunk_bytes=MiB, background_pinning=False)
    arena = device.host_arena(2 * MiB).result()
    assert len(driver.registered) == 2
    gc.disable()
    try:
        del device
        assert sorted(driver.unregistered) == sorted(driver.registered)
    finally:
        gc.enable()
    assert arena.numel() == 2 * MiB  # its views stay valid (pageable) memory


class SlowDriver(Driver):
    """Pinning that takes a while per chunk, so that a test can stop it half-way."""

    def host_register(self, ordinal: int, ptr: int, nbytes: int, setting: str) -> None:
        time.sleep(0.01)
        super().host_register(ordinal, ptr, nbytes, setting)


def test_an_arena_pinned_in_the_background_serves_each_chunk_as_it_is_pinned() -> None:
    driver = Driver()
    arena = an_arena(driver)
    reports: list[tuple[int, int]] = []

    def report(whole: torch.Tensor, ready: int) -> bool:
        reports.append((whole.data_ptr(), ready))
        return True

    host = arena.host_arena_async(3 * MiB + 100, report).result(timeout=10)
    base = host.data_ptr()
    assert reports == [(base, MiB), (base, 2 * MiB), (base, 3 * MiB), (base, 3 * MiB + 100)]
    assert arena.chunk_pieces(base + MiB - 10, 30) == [(0, 10), (10, 30)]
    arena.stop_pinning()
    arena.unpin()
    assert sorted(driver.unregistered) == sorted(driver.registered)


def test_a_background_pinning_stopped_half_way_keeps_its_served_chunks_until_unpin() -> None:
    """Chunks already served may have copies in flight when close stops the pinning: they
    are unpinned by unpin() (after the device's copies finished), never by the pinning."""
    driver = SlowDriver()
    arena = an_arena(driver)
    served = threading.Event()
    ready_seen: list[int] = []
    wholes: list[torch.Tensor] = []

    def pinned(whole: torch.Tensor, ready: int) -> bool:
        ready_seen.append(ready)
        wholes.append(whole)
        if ready >= 2 * MiB:
            served.set()
        return True

    future = arena.host_arena_async(256 * MiB, pinned)
    assert served.wait(10)
    assert arena.contains(wholes[0])  # batched copies may target the arena while it pins
    arena.stop_pinning()  # joins the pinning thread: it stopped at its next chunk
    with pytest.raises(MMCacheError, match="closed while its host arena was pinned"):
        future.result(timeout=10)
    assert 2 <= len(driver.registered) < 256
    assert ready_seen[-1] == len(driver.registered) * MiB
    assert driver.unregistered == []  # still pinned: copies may be reading them
    arena.unpin()
    assert sorted(driver.unregistered) == sorted(driver.registered)


def test_a_background_pinning_stopped_before_serving_anything_unpins_at_once() -> None:
    driver = SlowDriver()
    arena = an_arena(driver)
    future = arena.host_arena_async(256 * MiB)  # nobody to serve: nothing kept
    while not driver.registered:
        time.sleep(0.001)
    arena.stop_pinning()
    with pytest.raises(MMCacheError, match="closed"):
        future.result(timeout=10)
    assert sorted(driver.unregistered) == sorted(driver.registered)
    assert (arena.ptr, arena.nbytes) == (0, 0)


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_record_use_never_records_on_a_conjugate_or_negative_view(
    bit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's record_stream of such a view corrupts the host heap (test_cuda_device.py
    # shows the abort): the block must be named through a plain alias of its storage.
    from mmcache.device.cuda_memory import record_use

    recorded: list[tuple[bool, bool, int, object]] = []

    def record_stream(self: torch.Tensor, stream: object) -> None:
        recorded.append((self.is_conj(), self.is_neg(), self.untyped_storage().data_ptr(), stream))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    values = torch.complex(torch.ones(4, 3), torch.full((4, 3), 2.0))
    view = values.conj() if bit == "conj" else values._neg_view()
    assert view.is_conj() or view.is_neg()
    stream = object()
    record_use(view, cast(Any, stream))
    record_use(values, cast(Any, stream))
    ptr = values.untyped_storage().data_ptr()
    assert recorded == [(False, False, ptr, stream), (False, False, ptr, stream)]


class TimedDriver(Driver):
    """Pinning that takes hold seconds a chunk, each registration's start and end recorded."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.hold = hold
        self.spans: list[tuple[float, float]] = []

    def host_register(self, ordinal: int, ptr: int, nbytes: int, setting: str) -> None:
        began = time.perf_counter()
        time.sleep(self.hold)
        super().host_register(ordinal, ptr, nbytes, setting)
        self.spans.append((began, time.perf_counter()))


def pinning_gaps(hold: float, hurries: list[bool]) -> list[tuple[float, float]]:
    """Pin len(hurries) chunks, each reported with its hurry: (how long each chunk's
    registration took, the gap before the next), for all but the last chunk."""
    driver = TimedDriver(hold)
    arena = an_arena(driver)

    def pinned(whole: torch.Tensor, ready: int) -> bool:
        return hurries[ready // MiB - 1]

    arena.host_arena_async(len(hurries) * MiB, pinned).result(timeout=10)
    spans = driver.spans
    arena.stop_pinning()
    arena.unpin()
    return [
        (spans[k][1] - spans[k][0], spans[k + 1][0] - spans[k][1]) for k in range(len(spans) - 1)
    ]


def test_a_background_pinning_in_no_hurry_leaves_the_driver_lock_free_pin_pace_times_as_long() -> (
    None
):
    """Each registration holds the driver lock the process's kernel launches wait for:
    where the cache says there is no hurry, the next chunk waits PIN_PACE times as long as
    the last one took; where it asks for room, only the short pause."""
    hurries = [True, False, False, True, True, False]
    for hurry, (held, gap) in zip(hurries, pinning_gaps(0.01, hurries), strict=False):
        if hurry:
            assert gap < PIN_PACE * held / 2
        else:
            assert gap >= PIN_PACE * held * 0.95


def test_a_paced_pause_is_50_ms_at_most() -> None:
    """A registration that waited long for the driver's lock must not hold back the chunks
    a put will soon need: the pause after it is capped."""
    for held, gap in pinning_gaps(0.1, [False, False, False]):
        assert 0.05 * 0.95 <= gap < min(PIN_PACE * held, 0.05 + 0.03)


def test_stopping_a_pinning_in_no_hurry_does_not_wait_out_its_pause() -> None:
    driver = TimedDriver(0.016)
    arena = an_arena(driver)
    reported = threading.Event()

    def pinned(whole: torch.Tensor, ready: int) -> bool:
        reported.set()
        return False  # the next chunk after a pause of PIN_PACE times 16 ms

    future = arena.host_arena_async(64 * MiB, pinned)
    assert reported.wait(10)
    started = time.perf_counter()
    arena.stop_pinning()
    assert time.perf_counter() - started < PIN_PACE * 0.016 * 0.75
    with pytest.raises(MMCacheError, match="closed while its host arena was pinned"):
        future.result(timeout=10)
    arena.unpin()
    assert sorted(driver.unregistered) == sorted(driver.registered)

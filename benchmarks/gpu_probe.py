"""Measure the GPU facts CudaDevice is built on: copy bandwidth, pinning cost, fence wake-up.

Run from the repository root (about a minute on an H200):

    python benchmarks/gpu_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import math
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# Run as a script from a checkout: make the package and the sibling helpers importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import (  # noqa: E402
    LoopLag,
    MiB,
    cuda_elapsed_s,
    gbps,
    gpu_sleep,
    markdown_table,
    median,
    sleep_cycles_per_second,
    summary_us,
    timing_event,
    write_json,
)

from mmcache.device import CopyPlan, Fence, NewCopyPlan  # noqa: E402
from mmcache.device.cuda import CudaDevice, CudaFence  # noqa: E402

SIZES = {"64KB": 64 << 10, "1MB": 1 * MiB, "8MB": 8 * MiB, "64MB": 64 * MiB, "512MB": 512 * MiB}
WAKE_COPY_BYTES = 64 << 10


# --- bandwidth ------------------------------------------------------------------------------


def _copy_d2h(
    device: CudaDevice, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]
) -> Fence:
    """One device-to-host copy, submitted as a plan."""
    return device.submit(CopyPlan("d2h", (src,), (dst,), after=after))


def _copy_d2h_batch(
    device: CudaDevice,
    srcs: Sequence[torch.Tensor],
    host: torch.Tensor,
    offsets: Sequence[int],
    after: Sequence[Fence],
) -> Fence:
    """Device-to-host copies into host's bytes at offsets, submitted as one plan."""
    return device.submit(CopyPlan("d2h", srcs, into=host, offsets=offsets, after=after))


def copy_bandwidth(
    device: CudaDevice, arena: torch.Tensor, gpu: torch.Tensor, cycles_per_s: float, quick: bool
) -> dict[str, dict[str, float]]:
    """Pinned D2H / H2D GB/s per size: back-to-back copies, timed on the GPU with events."""
    results: dict[str, dict[str, float]] = {}
    for name, size in SIZES.items():
        # Enough copies per timing that small sizes are not lost in event resolution.
        inner = max(1, min(256, (64 * MiB) // size))
        reps = 3 if quick else (5 if size >= 64 * MiB else 11)
        row: dict[str, float] = {"bytes": float(size), "copies_per_rep": float(inner)}
        for direction, stream in (("d2h", device.d2h_stream), ("h2d", device.h2d_stream)):
            samples = []
            for _ in range(reps):

                def queue_copies(
                    direction: str = direction, inner: int = inner, size: int = size
                ) -> None:
                    for i in range(inner):
                        host = arena[i * size : (i + 1) * size]
                        dev = gpu[:size]
                        if direction == "d2h":
                            host.copy_(dev, non_blocking=True)
                        else:
                            dev.copy_(host, non_blocking=True)

                # Hold the stream while Python enqueues, so the events time the copy engine
                # and not the enqueue rate.
                hold_s = 0.5e-3 + inner * 20e-6
                gpu_sleep(int(hold_s * cycles_per_s), stream)
                samples.append(inner * size / cuda_elapsed_s(queue_copies, stream) / 1e9)
            row[f"{direction}_gbps"] = median(samples)
        results[name] = row
    both = 64 * MiB
    start = timing_event()
    ends = [timing_event() for _ in range(2)]
    main = torch.cuda.current_stream(device.index)
    start.record(main)
    for end, stream in zip(ends, (device.d2h_stream, device.h2d_stream), strict=True):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            if stream is device.d2h_stream:
                arena[:both].copy_(gpu[:both], non_blocking=True)
            else:
                gpu[both : 2 * both].copy_(arena[both : 2 * both], non_blocking=True)
            end.record(stream)
    torch.cuda.synchronize(device.index)
    slowest = max(float(start.elapsed_time(end)) for end in ends) / 1e3
    results["both_64MB"] = {"bytes": float(2 * both), "total_gbps": gbps(2 * both, slowest)}
    return results


def small_copy_paths(device: CudaDevice, arena: torch.Tensor) -> dict[str, dict[str, float]]:
    """1,024 x 64 KB and 64 x 1 MB evictions: a d2h copy each vs one d2h plan (wall)."""
    results: dict[str, dict[str, float]] = {}
    for label, size, count in (("1024x64KB", 64 << 10, 1024), ("64x1MB", MiB, 64)):
        srcs = [
            torch.randint(0, 255, (size,), dtype=torch.uint8, device=device.name)
            for _ in range(count)
        ]
        dsts = [arena[i * size : (i + 1) * size] for i in range(count)]
        torch.cuda.synchronize(device.index)
        row: dict[str, float] = {}
        for path in ("separate", "batch"):
            best_wall, best_cpu = math.inf, math.inf
            for _ in range(5):
                arena[: size * count].zero_()  # so the exactness check sees this path's bytes
                start = time.perf_counter()
                if path == "separate":
                    fence = None
                    for src, dst in zip(srcs, dsts, strict=True):
                        fence = _copy_d2h(device, src, dst, ())
                else:
                    offsets = [i * size for i in range(count)]
                    fence = _copy_d2h_batch(device, srcs, arena, offsets, ())
                enqueued = time.perf_counter() - start
                assert fence is not None
                fence.wait()
                best_wall = min(best_wall, time.perf_counter() - start)
                best_cpu = min(best_cpu, enqueued)
            ok = all(torch.equal(dst, src.cpu()) for src, dst in zip(srcs, dsts, strict=True))
            row[f"{path}_gbps"] = gbps(size * count, best_wall)
            row[f"{path}_enqueue_us_per_copy"] = best_cpu / count * 1e6
            row[f"{path}_exact"] = float(ok)
        results[label] = row
    return results


def straddling_copy(index: int, gpu: torch.Tensor) -> dict[str, Any]:
    """One raw 64 MB copy across two separately registered chunks vs CudaDevice's split copy."""
    half = 32 * MiB
    device = CudaDevice(index, background_pinning=False, pin_chunk_bytes=2 * half)
    try:
        arena = device.host_arena(4 * half).result()
        window = arena[half : 3 * half]  # crosses the boundary between the first two chunks
        results: dict[str, Any] = {}
        for name, copy in (
            (
                "raw copy_ across the boundary",
                lambda w=window: w.copy_(gpu[: 2 * half], non_blocking=True),
            ),
            (
                "CudaDevice.copy_d2h (split)",
                lambda w=window: _copy_d2h(device, gpu[: 2 * half], w, ()),
            ),
        ):
            window.zero_()
            try:
                seconds = cuda_elapsed_s(copy, device.d2h_stream)
            except RuntimeError as exc:
                results[name] = {"error": str(exc)}
                continue
            device.synchronize()
            exact = torch.equal(window, gpu[: 2 * half].cpu())
            results[name] = {"gbps": gbps(2 * half, seconds), "exact": exact}
        del window, arena
        return results
    finally:
        device.close()


# --- pinning ----------------------------------------------------------------------------------


def pinning_cost(index: int, quick: bool) -> dict[str, dict[str, float]]:
    """Seconds to pin (and unpin) an arena by each method, and whether it came back pinned."""
    sizes = {"256MB": 256 * MiB} if quick else {"256MB": 256 * MiB, "2GB": 2048 * MiB}
    methods: list[tuple[str, dict[str, Any]]] = [
        ("cuMemHostAlloc", {"arena_method": "hostalloc"}),
        ("cuMemHostRegister 256MB chunks", {"arena_method": "register", "huge_pages": False}),
        ("cuMemHostRegister 256MB chunks + THP", {"arena_method": "register", "huge_pages": True}),
    ]
    results: dict[str, dict[str, float]] = {}
    for size_name, size in sizes.items():
        for method, kwargs in methods:
            device = CudaDevice(index, **kwargs)
            start = time.perf_counter()
            arena = device.host_arena(size).result()
            pin_s = time.perf_counter() - start
            pinned = arena.is_pinned()
            # First touch of a page is part of the price for register: make it comparable.
            start = time.perf_counter()
            arena[::4096].fill_(1)
            touch_s = time.perf_counter() - start
            start = time.perf_counter()
            device.close()
            del arena
            gc.collect()
            free_s = time.perf_counter() - start
            results[f"{method} {size_name}"] = {
                "bytes": float(size),
                "pin_s": pin_s,
                "ms_per_MiB": pin_s * 1e3 / (size / MiB),
                "touch_s": touch_s,
                "unpin_s": free_s,
                "is_pinned": float(pinned),
            }
    return results


def launches_while_pinning(index: int, quick: bool) -> dict[str, dict[str, float]]:
    """CPU µs per kernel launch (torch.sub of 1 MB) with no pinning, and while a fresh
    device pins its arena in the background at full speed (the cache in a hurry) and at
    its pace (PIN_PACE: the cache with room ahead); pinning holds the driver lock every
    launch waits for. The launches run until the arena is pinned; pin_s, how long it took."""
    nbytes = (512 if quick else 2048) * MiB
    results: dict[str, dict[str, float]] = {}
    for name, hurry in (
        ("no pinning", None),
        ("pinning, full speed", True),
        ("pinning, paced", False),
    ):
        device = CudaDevice(index)
        a = torch.ones(512 * 1024, dtype=torch.bfloat16, device=device.name)
        torch.sub(a, a)
        torch.cuda.synchronize(device.index)
        start = time.perf_counter()
        if hurry is None:
            pinned = None
            until = start + 0.5
        else:

            def says(arena: torch.Tensor, ready: int, hurry: bool = hurry) -> bool:
                return hurry  # the same answer at each chunk

            pinned = device.host_arena(nbytes, says)
            until = math.inf
        samples: list[float] = []
        while (pinned is None or not pinned.done()) and time.perf_counter() < until:
            for _ in range(50):
                began = time.perf_counter()
                torch.sub(a, a)
                samples.append(time.perf_counter() - began)
            torch.cuda.synchronize(device.index)  # the GPU's queue never fills
        pin_s = math.nan if pinned is None else time.perf_counter() - start
        results[name] = {**summary_us(samples), "pin_s": pin_s}
        if pinned is not None:
            pinned.result()  # raises where pinning failed
        device.close()
        del a, pinned
        gc.collect()
    return results


# --- fence wake-up ----------------------------------------------------------------------------


async def await_by_callback(fence: CudaFence) -> None:
    """The waiter thread calls back; the loop is woken with call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    fence.add_done_callback(lambda: loop.call_soon_threadsafe(resolve))
    await future


async def await_by_polling(fence: CudaFence) -> None:
    """Spin on query() between event-loop turns."""
    while not fence.done():  # noqa: ASYNC110 - the spinning baseline under test
        await asyncio.sleep(0)


async def await_by_executor(fence: CudaFence) -> None:
    """cudaEventSynchronize in the default thread pool, on a blocking-sync event recorded
    just behind the fence (the fence's own plain event would spin the pool's thread)."""
    sleeper = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    sleeper.record(fence.stream)
    await asyncio.get_running_loop().run_in_executor(None, sleeper.synchronize)


class SignalWake:
    """A wake that takes no GIL on the driver's side: a host function raises a signal.

    After the fence, a host function queued on a side stream is libc's raise(signum):
    it runs on the driver's callback thread, where CPython's C-level signal handler
    only writes the event loop's wakeup fd (asyncio's add_signal_handler). The loop then
    looks which awaited fences are done. Main thread only, and it takes a signal.
    """

    SIGNUM = signal.SIGUSR2

    def __init__(self, device: CudaDevice) -> None:
        self._loop = asyncio.get_running_loop()
        raise_fn = ctypes.cast(getattr(ctypes.CDLL(None), "raise"), ctypes.c_void_p).value
        assert raise_fn is not None
        self._raise = ctypes.c_void_p(raise_fn)
        self._launch = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._stream = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]
        self._waiting: list[tuple[CudaFence, asyncio.Future[None]]] = []
        self._loop.add_signal_handler(self.SIGNUM, self._on_signal)

    async def wait(self, fence: CudaFence) -> None:
        """Resume once fence is done, woken by the signal (no thread of ours involved)."""
        if fence.done():
            return
        future: asyncio.Future[None] = self._loop.create_future()
        self._waiting.append((fence, future))
        event = fence.pending_event()
        if event is not None:
            self._stream.wait_event(event)
        rc = self._launch(self._stream.cuda_stream, self._raise, int(self.SIGNUM))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed: CUDA error {rc}")
        await future

    def _on_signal(self) -> None:
        # Signals coalesce: one may stand for several landings, so look at every waiter.
        waiting = []
        for fence, future in self._waiting:
            if not fence.done():
                waiting.append((fence, future))
            elif not future.done():
                future.set_result(None)
        self._waiting = waiting

    def close(self) -> None:
        self._loop.remove_signal_handler(self.SIGNUM)


_signal_wake: SignalWake | None = None


async def await_by_signal(fence: CudaFence) -> None:
    """A host function raises a signal; its C handler wakes the loop's selector."""
    assert _signal_wake is not None
    await _signal_wake.wait(fence)


WAKE_METHODS: dict[str, Callable[[CudaFence], Awaitable[None]]] = {
    "callback (waiter thread)": await_by_callback,
    "poll query() + sleep(0)": await_by_polling,
    "run_in_executor(synchronize)": await_by_executor,
    "host function raises a signal": await_by_signal,
}


async def fence_wake_latency(
    device: CudaDevice, arena: torch.Tensor, quick: bool
) -> dict[str, dict[str, float]]:
    """Enqueue a 64 KB D2H copy, await its fence: enqueue-to-resume latency per method."""
    src = torch.randint(0, 255, (WAKE_COPY_BYTES,), dtype=torch.uint8, device=device.name)
    dst = arena[:WAKE_COPY_BYTES]
    reps = 100 if quick else 400
    results: dict[str, dict[str, float]] = {}
    for name, method in WAKE_METHODS.items():
        samples = []
        for rep in range(reps + 20):
            start = time.perf_counter()
            fence = _copy_d2h(device, src, dst, ())
            assert isinstance(fence, CudaFence)
            await method(fence)
            if rep >= 20:  # warm-up: thread start, executor spin-up
                samples.append(time.perf_counter() - start)
        results[name] = summary_us(samples)
    return results


async def loop_lag_while_pending(
    device: CudaDevice, arena: torch.Tensor, gpu: torch.Tensor
) -> dict[str, float]:
    """Worst event-loop lateness while 512 MB of offloads are pending, per wake method."""
    results: dict[str, float] = {}
    async with LoopLag() as idle:
        await asyncio.sleep(0.2)
    results["idle_ms"] = idle.max_lag_s * 1e3
    chunk, count = 8 * MiB, 64
    for name, method in WAKE_METHODS.items():
        worst = 0.0
        for _ in range(3):
            async with LoopLag() as lag:
                fences = []
                for i in range(count):
                    fence = _copy_d2h(
                        device,
                        gpu[i * chunk : (i + 1) * chunk],
                        arena[i * chunk : (i + 1) * chunk],
                        (),
                    )
                    assert isinstance(fence, CudaFence)
                    fences.append(fence)
                    await asyncio.sleep(0)
                await asyncio.gather(*(method(f) for f in fences))
            worst = max(worst, lag.max_lag_s)
        results[f"{name}_ms"] = worst * 1e3
    start = time.perf_counter()
    fence = _copy_d2h(device, gpu[: count * chunk], arena[: count * chunk], ())
    fence.wait()
    results["blocking synchronize (loop blocked)_ms"] = (time.perf_counter() - start) * 1e3
    return results


async def waiter_cpu(device: CudaDevice, cycles_per_s: float, quick: bool) -> dict[str, float]:
    """Process CPU time per second of waiting on a long fence, as % of one core."""
    wait_s = 0.3 if quick else 1.0
    side = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]
    results: dict[str, float] = {}
    for name, method in WAKE_METHODS.items():
        gpu_sleep(int(wait_s * cycles_per_s), side)
        fence = device.record(side)
        assert isinstance(fence, CudaFence)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await method(fence)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        results[f"{name}_pct_core"] = 100 * cpu / wall
    # The waiter thread alone, with the main thread asleep on a threading.Event.
    gpu_sleep(int(wait_s * cycles_per_s), side)
    fence = device.record(side)
    woke = threading.Event()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    fence.add_done_callback(woke.set)
    await asyncio.to_thread(woke.wait)
    results["waiter thread only_pct_core"] = (
        100 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    )
    return results


# --- primitives -------------------------------------------------------------------------------


def _us_per_call(fn: Callable[[], object], n: int) -> float:
    """Host µs per call of fn, over n calls after one that is not timed."""
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def primitive_costs(
    device: CudaDevice, arena: torch.Tensor, cycles_per_s: float
) -> dict[str, float]:
    """CPU microseconds per call of the operations the cache does per entry, and of what
    its choices cost the kernels around it."""
    n = 2000
    stream = device.d2h_stream
    src = torch.empty(WAKE_COPY_BYTES, dtype=torch.uint8, device=device.name)
    dst = arena[:WAKE_COPY_BYTES]

    def per_call(fn: Callable[[], object]) -> float:
        return _us_per_call(fn, n)

    fence = device.record(stream)
    assert isinstance(fence, CudaFence)
    results = {
        "record_fence_us": per_call(lambda: device.record(stream)),
        "event_query_us": per_call(
            lambda: fence.event.query()  # type: ignore[no-untyped-call]
        ),
        "record_stream_us": per_call(lambda: src.record_stream(stream)),
        "wait_on_us": per_call(lambda: device.wait_on(stream, fence)),
        "copy_d2h_64KB_enqueue_us": per_call(lambda: _copy_d2h(device, src, dst, ())),
    }
    torch.cuda.synchronize(device.index)
    results.update(upload_enqueue_costs(device, arena))
    results.update(kernel_launch_beside_pending_frees(device, cycles_per_s))
    return results


def upload_enqueue_costs(device: CudaDevice, arena: torch.Tensor) -> dict[str, float]:
    """CPU µs to queue 16 host hits of 1 MiB into one buffer on a reader's stream: as the
    cache does (one driver batch where the driver has it) and by one torch copy_ each."""
    features, nbytes, n = 16, MiB, 100
    srcs = [arena[i * nbytes : (i + 1) * nbytes] for i in range(features)]
    offsets = [i * nbytes for i in range(features)]
    reader = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]

    def cache_upload() -> None:
        plan = NewCopyPlan("h2d", srcs, (features * nbytes,), offsets=offsets, stream=reader)
        buffer, _ = device.submit(plan)
        buffer.record_stream(reader)

    def copy_loop() -> None:
        with torch.cuda.stream(reader):
            buffer = torch.empty(features * nbytes, dtype=torch.uint8, device=device.name)
            for src, at in zip(srcs, offsets, strict=True):
                buffer[at : at + nbytes].copy_(src, non_blocking=True)

    out = {}
    timed = (("upload_16x1MiB_cache_us", cache_upload), ("upload_16x1MiB_copy_loop_us", copy_loop))
    for name, fn in timed:
        fn()
        spent = 0.0
        for _ in range(n):  # each queued alone: a full launch queue would block the host
            reader.synchronize()
            start = time.perf_counter()
            fn()
            spent += time.perf_counter() - start
        out[name] = spent / n * 1e6
        reader.synchronize()
    return out


_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # a CUdevice_attribute


class _MappedRange:
    """A range of registered host memory as a CUDA array (__cuda_array_interface__): on a
    GPU that reads registered memory through its host pointer (UVA), torch.as_tensor of it
    is a device tensor whose kernels read the host bytes over PCIe, with no copy engine."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def mapped_gather(device: CudaDevice, arena: torch.Tensor) -> dict[str, Any]:
    """16 and 32 host hits of 1 MiB gathered into one device buffer by one torch.cat kernel
    that reads the pinned arena in place, against the cache's upload (one driver batch):
    CPU µs to queue, GPU µs to run, GB/s, and whether the bytes match."""
    out: dict[str, Any] = {}
    # A kernel reading host memory the GPU cannot map faults the context for good: ask first
    # (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM).
    can = ctypes.c_int(0)
    try:
        code = ctypes.CDLL("libcuda.so.1").cuDeviceGetAttribute(
            ctypes.byref(can), _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device.index
        )
    except OSError as exc:
        return {"error": f"no driver library: {exc}"}
    if code != 0 or not can.value:
        return {"error": f"the GPU does not read registered memory by its host pointer ({code})"}
    try:
        mapped = torch.as_tensor(_MappedRange(arena.data_ptr(), arena.numel()), device=device.name)
    except Exception as exc:  # not every driver lets a kernel read registered memory
        return {"error": f"{type(exc).__name__}: {exc}"}
    reader = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]
    arena[: 32 * MiB].copy_(torch.randint(0, 255, (32 * MiB,), dtype=torch.uint8))
    for features in (16, 32):
        # Every other MiB: the hits of a turn are not adjacent in the arena.
        starts = [2 * i * MiB % (arena.numel() - MiB) for i in range(features)]
        srcs = [arena[at : at + MiB] for at in starts]
        views = [mapped[at : at + MiB] for at in starts]
        offsets = [i * MiB for i in range(features)]

        def batch(srcs: list[torch.Tensor] = srcs, offsets: list[int] = offsets) -> torch.Tensor:
            plan = NewCopyPlan("h2d", srcs, (len(srcs) * MiB,), offsets=offsets, stream=reader)
            buffer, _ = device.submit(plan)
            buffer.record_stream(reader)
            return buffer

        def cat(views: list[torch.Tensor] = views) -> torch.Tensor:
            with torch.cuda.stream(reader):
                return torch.cat(views)

        for name, fn in (("driver_batch", batch), ("mapped_cat", cat)):
            try:
                result = fn()
                reader.synchronize()
                exact = bool(torch.equal(result.cpu(), torch.cat(srcs)))
                cpu = gpu = 0.0
                reps = 50
                for _ in range(reps):
                    reader.synchronize()
                    begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    begin.record(reader)
                    t0 = time.perf_counter()
                    fn()
                    cpu += time.perf_counter() - t0
                    end.record(reader)
                    end.synchronize()
                    gpu += begin.elapsed_time(end) / 1e3
                out[f"{features}x1MiB_{name}"] = {
                    "cpu_us": cpu / reps * 1e6,
                    "gpu_us": gpu / reps * 1e6,
                    "gbps": features * MiB * reps / gpu / 1e9,
                    "exact": exact,
                }
            except Exception as exc:
                out[f"{features}x1MiB_{name}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def kernel_launch_beside_pending_frees(device: CudaDevice, cycles_per_s: float) -> dict[str, float]:
    """CPU µs of a kernel that allocates its output (torch.sub of 1 MB), alone and while
    blocks freed after record_stream on a busy stream wait for it: the caching allocator
    then queries an event at each allocation, on every stream."""
    n = 2000
    a = torch.ones(512 * 1024, dtype=torch.bfloat16, device=device.name)

    def per_call() -> float:
        return _us_per_call(lambda: torch.sub(a, a), n)

    plain = per_call()
    torch.cuda.synchronize(device.index)
    busy = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]
    side = torch.cuda.Stream(device.index)  # type: ignore[no-untyped-call]
    gpu_sleep(int(cycles_per_s * 2.0), busy)  # far longer than the timed calls
    with torch.cuda.stream(side):
        blocks = [torch.empty(MiB, dtype=torch.uint8, device=device.name) for _ in range(64)]
    for block in blocks:
        block.record_stream(busy)
    del blocks, block  # freed now; reusable once busy's work so far is done
    pending = per_call()
    torch.cuda.synchronize(device.index)
    return {"sub_1MB_alloc_us": plain, "sub_1MB_alloc_pending_frees_us": pending}


# --- main -------------------------------------------------------------------------------------


async def probe(index: int, quick: bool) -> dict[str, Any]:
    """Run every measurement and return the results."""
    # One allocation: the raw torch copies below may cover any range of the arena.
    device = CudaDevice(index, arena_method="hostalloc")
    arena_bytes = 1024 * MiB
    start = time.perf_counter()
    arena = await asyncio.wrap_future(device.host_arena(arena_bytes))
    pin_s = time.perf_counter() - start
    gpu = torch.randint(0, 255, (arena_bytes,), dtype=torch.uint8, device=device.name)
    cycles_per_s = sleep_cycles_per_second(device.d2h_stream)
    results: dict[str, Any] = {
        "device": device.describe(),
        "arena_pin_s": pin_s,
        "sleep_cycles_per_s": cycles_per_s,
    }
    results["primitives_us"] = primitive_costs(device, arena, cycles_per_s)
    results["bandwidth"] = copy_bandwidth(device, arena, gpu, cycles_per_s, quick)
    results["small_copies"] = small_copy_paths(device, arena)
    results["straddling_copy"] = straddling_copy(device.index, gpu)
    global _signal_wake
    _signal_wake = SignalWake(device)
    try:
        results["fence_wake"] = await fence_wake_latency(device, arena, quick)
        results["loop_lag_512MB_pending"] = await loop_lag_while_pending(device, arena, gpu)
        results["waiter_cpu"] = await waiter_cpu(device, cycles_per_s, quick)
    finally:
        _signal_wake.close()
        _signal_wake = None
    # Last with this device: a kernel that read the host wrongly would spoil what follows.
    results["mapped_gather"] = mapped_gather(device, arena)
    device.close()
    del arena, gpu
    gc.collect()
    results["pinning"] = pinning_cost(index, quick)
    try:  # the newest measurement: a failure of its own leaves the rest reported
        results["launches_while_pinning"] = launches_while_pinning(index, quick)
    except Exception as exc:
        results["launches_while_pinning"] = {"error": {"message": repr(exc)}}
    return results


def report(results: dict[str, Any]) -> str:
    """The results as markdown tables."""
    out = [
        f"## GPU probe: {results['device'].get('gpu')} (torch {results['device'].get('torch')}, "
        f"CUDA {results['device'].get('cuda')})",
        "",
    ]
    bw = results["bandwidth"]
    out += [
        "### Pinned copy bandwidth (GB/s, copy engine time)",
        markdown_table(
            ["size", "D2H", "H2D"],
            [[name, bw[name]["d2h_gbps"], bw[name]["h2d_gbps"]] for name in SIZES],
        ),
        f"\nboth directions at once, 64 MB each: {bw['both_64MB']['total_gbps']:.1f} GB/s total",
        "",
    ]
    small = results["small_copies"]
    out += [
        "### Small evictions (wall, enqueue to done)",
        markdown_table(
            [
                "workload",
                "separate GB/s",
                "batch GB/s",
                "separate µs/copy",
                "batch µs/copy",
                "exact",
            ],
            [
                [
                    k,
                    v["separate_gbps"],
                    v["batch_gbps"],
                    v["separate_enqueue_us_per_copy"],
                    v["batch_enqueue_us_per_copy"],
                    bool(v["separate_exact"] and v["batch_exact"]),
                ]
                for k, v in small.items()
            ],
        ),
        "",
    ]
    out += [
        "### A 64 MB D2H copy across two registered chunks",
        "```",
        str(results["straddling_copy"]),
        "```",
        "",
    ]
    out += [
        "### Pinning the arena",
        markdown_table(
            ["method", "pin s", "ms/MiB", "unpin s", "pinned"],
            [
                [k, v["pin_s"], v["ms_per_MiB"], v["unpin_s"], bool(v["is_pinned"])]
                for k, v in results["pinning"].items()
            ],
        ),
        "",
    ]
    launches = results["launches_while_pinning"]
    out += [
        "### Kernel launches while the arena pins (CPU µs per launch of a 1 MB sub)",
        markdown_table(
            ["while", "p50", "p99", "max", "launches", "pinned after s"],
            [
                [k, v["p50_us"], v["p99_us"], v["max_us"], int(v["n"]), v["pin_s"]]
                if "message" not in v
                else [k, v["message"], "", "", "", ""]
                for k, v in launches.items()
            ],
        ),
        "",
    ]
    out += [
        "### Fence wake-up: enqueue 64 KB D2H, resume the awaiting task (µs)",
        markdown_table(
            ["method", "p50", "p99", "max"],
            [[k, v["p50_us"], v["p99_us"], v["max_us"]] for k, v in results["fence_wake"].items()],
        ),
        "",
    ]
    lag = results["loop_lag_512MB_pending"]
    out += [
        "### Event-loop max lag while 512 MB of offloads are pending (ms)",
        markdown_table(
            ["method", "max lag ms"], [[k.removesuffix("_ms"), v] for k, v in lag.items()]
        ),
        "",
    ]
    cpu = results["waiter_cpu"]
    out += [
        "### CPU while waiting on a long fence (% of one core, whole process)",
        markdown_table(
            ["method", "% core"], [[k.removesuffix("_pct_core"), v] for k, v in cpu.items()]
        ),
        "",
    ]
    out += [
        "### Per-call CPU cost (µs)",
        markdown_table(
            ["operation", "µs"],
            [[k.removesuffix("_us"), v] for k, v in results["primitives_us"].items()],
        ),
        "",
        "### A turn's host hits gathered: one driver batch, or one kernel reading the arena",
    ]
    for name, row in results.get("mapped_gather", {}).items():
        if not isinstance(row, dict) or "error" in row:
            out.append(f"{name}: {row if not isinstance(row, dict) else row['error']}")
            continue
        out.append(
            f"{name}: CPU {row['cpu_us']:.1f} µs, GPU {row['gpu_us']:.1f} µs, "
            f"{row['gbps']:.1f} GB/s, exact {row['exact']}"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse arguments, probe, print tables, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", help="write results as JSON to this path")
    parser.add_argument("--index", type=int, default=0, help="GPU index (default 0)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller arenas")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_probe measures an NVIDIA GPU; nothing to do")
        write_json(args.out, {"skipped": "no CUDA device"})
        return 0
    start = time.perf_counter()
    results = asyncio.run(probe(args.index, args.quick))
    results["elapsed_s"] = time.perf_counter() - start
    print(report(results))
    print(f"\nprobe took {results['elapsed_s']:.1f} s")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

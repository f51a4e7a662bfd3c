"""Host cost of queueing offloads: the gather kernel, copy_d2h_batch, and one copy.

    python benchmarks/gather_probe.py    # CUDA only: about 10 s on an H200

For 8 x 1 MB and 128 x 64 KB bf16 features it times, per call (300 calls after 20
warm-up calls): joining them with torch.cat and with flatten_dense_tensors on the
D2H stream, and a whole CudaDevice.copy_d2h_batch into the pinned arena (checks,
gather, one copy, one fence); then checks the copied bytes. Last, the host time of
one device-to-host copy_ (1 MB and 8 MB, paced like an offload stream), alone and
while another thread waits on CUDA events and runs a little Python per landing,
as a fence waiter thread does: it shows what sharing the GIL costs the loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from mmcache.device.cuda import CudaDevice, _OnStream  # noqa: E402

CALLS = 300
SHAPES = {"8x1MB": (8, 128), "128x64KB": (128, 8)}  # count, rows of 4,096 bf16


def per_call_us(fn: Callable[[], object]) -> tuple[float, float]:
    """(host µs to enqueue, wall µs until the GPU finished), per call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (enqueued - start) / CALLS * 1e6, (done - start) / CALLS * 1e6


def paced_copies_us(
    stream: torch.cuda.Stream, host: torch.Tensor, src: torch.Tensor, gap_s: float
) -> tuple[float, float]:
    """(p50, p90) host µs of one copy_ call, one call every gap_s (busy-waited)."""
    torch.cuda.synchronize()
    times = []
    for i in range(64):
        offset = i * src.numel() % (host.numel() - src.numel())
        with _OnStream(stream):
            start = time.perf_counter()
            host[offset : offset + src.numel()].copy_(src, non_blocking=True)
            times.append(time.perf_counter() - start)
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6


def copy_with_a_waiter_thread(stream: torch.cuda.Stream, host: torch.Tensor) -> None:
    cases = {"1 MB every 20 µs": (1 << 20, 20e-6), "8 MB every 150 µs": (8 << 20, 150e-6)}
    sources = {
        name: torch.empty(n, dtype=torch.uint8, device="cuda") for name, (n, _) in cases.items()
    }
    alone = {
        name: paced_copies_us(stream, host, sources[name], gap) for name, (_, gap) in cases.items()
    }
    stop = threading.Event()

    def waiter() -> None:
        while not stop.is_set():
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(stream)
            event.synchronize()  # sleeps without the GIL; takes it back on waking
            sum(range(200))  # a callback's worth of Python

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    shared = {
        name: paced_copies_us(stream, host, sources[name], gap) for name, (_, gap) in cases.items()
    }
    stop.set()
    thread.join()
    print(f"{'copy_ call':20s} {'alone p50/p90 µs':>18s} {'with waiter p50/p90 µs':>24s}")
    for name in cases:
        (a50, a90), (s50, s90) = alone[name], shared[name]
        print(f"{name:20s} {a50:8.1f} / {a90:6.1f} {s50:14.1f} / {s90:6.1f}")


def main() -> int:
    if not torch.cuda.is_available():
        print("gather_probe: needs a CUDA device")
        return 0
    # One allocation: the raw copy_ calls below may cross any offset.
    device = CudaDevice(0, background_pinning=False, arena_method="hostalloc")
    stream = device.d2h_stream
    arena = device.host_arena(128 << 20)
    flatten = torch._C._nn.flatten_dense_tensors
    print(f"{'batch':10s} {'operation':16s} {'enqueue µs':>11s} {'wall µs':>9s}")
    exact = True
    for label, (count, rows) in SHAPES.items():
        srcs = [torch.randn(rows, 4096, device="cuda").to(torch.bfloat16) for _ in range(count)]
        offsets = [i * srcs[0].nbytes for i in range(count)]

        def cat(srcs: list[torch.Tensor] = srcs) -> object:
            with _OnStream(stream):  # the device's own stream switch, as in copy_d2h_batch
                return torch.cat(srcs)

        def flat(srcs: list[torch.Tensor] = srcs) -> object:
            with _OnStream(stream):
                return flatten(srcs)

        def batch(srcs: list[torch.Tensor] = srcs, offsets: list[int] = offsets) -> object:
            return device.copy_d2h_batch(srcs, arena, offsets, ())

        for name, fn in (("torch.cat", cat), ("flatten", flat), ("copy_d2h_batch", batch)):
            enqueue, wall = per_call_us(fn)
            print(f"{label:10s} {name:16s} {enqueue:11.1f} {wall:9.1f}")
        for src, offset in zip(srcs, offsets, strict=True):
            got = arena[offset : offset + src.nbytes]
            exact &= torch.equal(got, src.cpu().reshape(-1).view(torch.uint8))
    print("bytes exact:", exact)
    copy_with_a_waiter_thread(stream, arena)
    device.close()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

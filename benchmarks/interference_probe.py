"""Which part of an offload path slows a concurrent matmul? One ingredient at a time.

A bf16 matmul runs on its own stream for about half a second while a loop copies
128 features of 8 MB to pinned memory, over and over, in five variants that add the
offload path's ingredients one by one: torch's pinned memory or the cache's arena
(cuMemHostAlloc), a plain stream or CudaDevice's D2H stream, a blocking-sync event
per copy with a thread sleeping on those events (the fence waiter), and finally
CudaDevice.copy_d2h_batch itself, its fences waited on by the device's waiter
thread. Each variant runs twice in the same process.

    python benchmarks/interference_probe.py

CUDA only.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import copy_to_slot  # noqa: E402
from bench_offload import ComputeLoad  # noqa: E402

from mmcache.device.cuda import CudaDevice  # noqa: E402

FEATURES = 128
ROWS, HIDDEN = 1000, 4096  # 8 MB of bf16: a 1120x700 image's embedding


def slowdown(copy_pass: Callable[[], None]) -> float:
    """The matmul's time per call beside repeated copy passes, over its time alone."""
    load = ComputeLoad(quick=False)
    k = load.calibrate(0.5)
    torch.cuda.synchronize()
    events = load.start(k)
    while not events[1].query():  # type: ignore[no-untyped-call]
        copy_pass()
    torch.cuda.synchronize()
    return load.slowdown(events, k)


def main() -> int:
    if not torch.cuda.is_available():
        print("interference_probe: needs a CUDA device")
        return 0
    features = [
        torch.randn(ROWS, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(FEATURES)
    ]
    nbytes = features[0].nbytes
    pinned = torch.empty(FEATURES * nbytes, dtype=torch.uint8, pin_memory=True)
    device = CudaDevice(0, arena_method="hostalloc")  # one allocation: raw copies go anywhere
    arena = device.host_arena(FEATURES * nbytes)
    plain = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    d2h = device.d2h_stream
    fences: queue.SimpleQueue[torch.cuda.Event | None] = queue.SimpleQueue()

    def copies(dst: torch.Tensor, stream: torch.cuda.Stream, events: bool = False) -> None:
        with torch.cuda.stream(stream):
            for i, feature in enumerate(features):
                copy_to_slot(dst, i, feature)
                if events:
                    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                    event.record(stream)
                    fences.put(event)
        stream.synchronize()

    def waiter() -> None:
        while (event := fences.get()) is not None:
            event.synchronize()

    def through_device() -> None:
        for i, feature in enumerate(features):
            fence = device.copy_d2h_batch([feature], arena, [i * nbytes], ())
            fence.add_done_callback(lambda: None)  # the device's waiter thread sleeps on it
        d2h.synchronize()

    variants: list[tuple[str, Callable[[], None]]] = [
        ("torch pinned memory, plain stream", lambda: copies(pinned, plain)),
        ("arena (cuMemHostAlloc), plain stream", lambda: copies(arena, plain)),
        ("arena, the device's D2H stream", lambda: copies(arena, d2h)),
        ("arena, D2H stream, blocking event per copy + waiter", lambda: copies(arena, d2h, True)),
        ("CudaDevice.copy_d2h_batch, one feature per call", through_device),
    ]
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    print("| variant | matmul slowdown, run 1 | run 2 |")
    print("| --- | --- | --- |")
    for name, copy_pass in variants:
        first, second = slowdown(copy_pass), slowdown(copy_pass)
        print(f"| {name} | {first:.3f} | {second:.3f} |", flush=True)
    fences.put(None)
    thread.join()
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

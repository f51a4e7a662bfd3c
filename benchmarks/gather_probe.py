"""Host cost of queueing a batch of small offloads: the gather kernel and copy_d2h_batch.

    python benchmarks/gather_probe.py    # CUDA only: about 10 s on an H200

For 8 x 1 MB and 128 x 64 KB bf16 features it times, per call (300 calls after 20
warm-up calls): joining them with torch.cat and with flatten_dense_tensors on the
D2H stream, and a whole CudaDevice.copy_d2h_batch into the pinned arena (checks,
gather, one copy, one fence); then checks the copied bytes.
"""

from __future__ import annotations

import sys
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


def main() -> int:
    if not torch.cuda.is_available():
        print("gather_probe: needs a CUDA device")
        return 0
    device = CudaDevice(0, background_pinning=False)
    stream = device.d2h_stream
    arena = device.host_arena(64 << 20)
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
    device.close()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

"""IPC transport benchmark: features/s and GB/s through the device pool vs the host fallback.

Run from the repository root (a minute on an H200; --quick: a few seconds):

    python benchmarks/bench_ipc.py [--device cuda|sim] [--receivers 1|2] [--quick] [--out JSON]

One sender (this process, GPU 0) hands features of several sizes to receiver
processes (GPU 0, and GPU 1 for a second receiver when there is one), which
copy each onto their device. "pool" sends through the IPC pool (device to
device, stream-ordered); "fallback" turns the pool off (MMCACHE_USE_CUDA_IPC=0)
so every feature goes device -> shared pinned host memory -> device. The time
runs from the first send to the last receiver's last copy completing; handles
travel over multiprocessing queues as plain bytes (handle.to_bytes(), parsed
back with FeatureHandle.from_bytes()), as they would over a scheduler's socket.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import sys
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

# Run as a script from a checkout: make the package and the sibling helpers importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import MiB, gbps, markdown_table, write_json  # noqa: E402

from mmcache import CacheSettings  # noqa: E402
from mmcache.device import Device, SimDevice  # noqa: E402
from mmcache.ipc import FeatureHandle, FeatureReceiver, FeatureSender, SenderEndpoint  # noqa: E402

#: name -> bytes of one feature (bf16 rows of 4096: 8 MB is a 1000-token image).
SIZES = {"64KB": 64 << 10, "1MB": 1 << 20, "8MB": 8 << 20}
VERIFY = 3  # features per run checked byte for byte by every receiver
#: ("connect", endpoint bytes) | ("size", nbytes) | ("item", i, handle bytes) | ("end",) | ("stop",)
Command = tuple[Any, ...]


def make_device(kind: str, gpu: int) -> Device:
    """The simulator, or GPU gpu."""
    if kind == "sim":
        return SimDevice()
    from mmcache.device.cuda import CudaDevice

    torch.cuda.set_device(gpu)
    return CudaDevice(gpu, background_pinning=False)


def source(nbytes: int, variant: int, device: str) -> torch.Tensor:
    """A distinct feature of nbytes (bf16 rows of 4096)."""
    generator = torch.Generator().manual_seed(variant)
    rows = max(1, nbytes // (4096 * 2))
    return torch.randn(rows, 4096, generator=generator).to(torch.bfloat16).to(device)


def receiver_process(
    kind: str, gpu: int, inbox: Queue[Command], outbox: Queue[tuple[Any, ...]]
) -> None:
    """A scheduler process: connect to each sender it is told of, receive, time, verify."""
    asyncio.run(_serve(kind, gpu, inbox, outbox))


async def _serve(
    kind: str, gpu: int, inbox: Queue[Command], outbox: Queue[tuple[Any, ...]]
) -> None:
    device = make_device(kind, gpu)
    where = "cpu" if kind == "sim" else f"cuda:{gpu}"
    receiver = FeatureReceiver(device=device)
    loop = asyncio.get_running_loop()
    wrong = 0
    nbytes = 0
    while True:
        command = await loop.run_in_executor(None, inbox.get)
        if command[0] == "stop":
            break
        if command[0] == "connect":
            await receiver.connect(SenderEndpoint.from_bytes(command[1]))
            outbox.put(("connected",))
        elif command[0] == "size":
            size = command[1]
            assert isinstance(size, int)
            nbytes = size
        elif command[0] == "item":
            i = command[1]
            assert isinstance(i, int)
            got = await receiver.receive(FeatureHandle.from_bytes(command[2]))
            if i < VERIFY and not torch.equal(got, source(nbytes, i, where)):
                wrong += 1
        elif command[0] == "end":
            if kind == "cuda":
                torch.cuda.current_stream(gpu).synchronize()
            outbox.put(("done", time.perf_counter(), wrong))
            wrong = 0
    await receiver.close()
    device.close()


async def _run_one(
    kind: str,
    device: Device,
    path: str,
    size_name: str,
    count: int,
    inboxes: list[Queue[Command]],
    outbox: Queue[tuple[Any, ...]],
) -> dict[str, Any]:
    """Send count features of one size through one path; time until every receiver is done."""
    nbytes = SIZES[size_name]
    pool_mb = 512 if kind == "cuda" else 64
    settings = CacheSettings(
        use_cuda_ipc=path == "pool",
        ipc_pool_mb=pool_mb,
        ipc_fallback_mb=pool_mb,
        ipc_recycle_interval_s=0.001,
    )
    where = "cpu" if kind == "sim" else device.name
    sources = [source(nbytes, v, where) for v in range(8)]
    loop = asyncio.get_running_loop()

    async def reply() -> tuple[Any, ...]:
        got: tuple[Any, ...] = await loop.run_in_executor(
            None, functools.partial(outbox.get, timeout=120)
        )
        return got

    sender = FeatureSender(
        settings, device=device, consumers=len(inboxes), registry=CollectorRegistry()
    )
    async with sender:
        for inbox in inboxes:
            inbox.put(("connect", sender.endpoint.to_bytes()))
            inbox.put(("size", nbytes))
        for _ in inboxes:
            await reply()
        for warm in range(8):  # first touches: mappings, pinning, IPC events
            data = (await sender.send(sources[warm % 8].clone())).to_bytes()
            for inbox in inboxes:
                inbox.put(("item", VERIFY + warm, data))
        for inbox in inboxes:
            inbox.put(("end",))
        for _ in inboxes:
            await reply()
        if kind == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(count):
            data = (await sender.send(sources[i % 8].clone())).to_bytes()
            for inbox in inboxes:
                inbox.put(("item", i, data))
        sent = time.perf_counter()
        for inbox in inboxes:
            inbox.put(("end",))
        done = [await reply() for _ in inboxes]
        finished = max(d[1] for d in done)
        wrong = sum(d[2] for d in done)
        await sender.drain(timeout=30)
        stats = sender.stats()
    seconds = finished - started
    return {
        "path": path,
        "size": size_name,
        "features": count,
        "receivers": len(inboxes),
        "seconds": seconds,
        "send_seconds": sent - started,
        "features_per_s": count / seconds,
        "gb_per_s": gbps(count * nbytes, seconds),
        "fallbacks": stats.fallbacks,
        "leaked_bytes": stats.leaked_bytes,
        "wrong": wrong,
    }


async def main(kind: str, receivers: int, quick: bool, out: str | None) -> int:
    ctx = multiprocessing.get_context("spawn")
    device = make_device(kind, 0)
    gpus = [0, 1 if kind == "cuda" and torch.cuda.device_count() > 1 else 0][:receivers]
    outbox: Queue[tuple[Any, ...]] = ctx.Queue()
    inboxes: list[Queue[Command]] = [ctx.Queue() for _ in gpus]
    processes = [
        ctx.Process(target=receiver_process, args=(kind, gpu, inbox, outbox), daemon=True)
        for gpu, inbox in zip(gpus, inboxes, strict=True)
    ]
    for process in processes:
        process.start()
    # Bytes per run: enough to reach steady state on the GPU, little on the simulator.
    per_run = (256 if quick else 2048) * MiB if kind == "cuda" else (32 if quick else 128) * MiB
    rows: list[dict[str, Any]] = []
    try:
        for size_name, nbytes in SIZES.items():
            count = max(32, min(20_000, per_run // nbytes))
            for path in ("pool", "fallback"):
                row = await _run_one(kind, device, path, size_name, count, inboxes, outbox)
                rows.append(row)
                print(
                    f"{path:8} {size_name:>5}: {row['features_per_s']:9.0f} features/s "
                    f"{row['gb_per_s']:6.2f} GB/s",
                    file=sys.stderr,
                )
    finally:
        for inbox in inboxes:
            inbox.put(("stop",))
        for process in processes:
            process.join(30)
        device.close()
    facts = device.describe()
    write_json(out, {"device": facts, "receivers": gpus, "rows": rows})
    if kind == "cuda":
        where = ", ".join(f"cuda:{g}" for g in gpus)
        print(f"\nIPC transport on {facts.get('gpu')}: sender on cuda:0, receivers on {where}\n")
    else:
        print(f"\nIPC transport on the simulator, {len(gpus)} receiver process(es)\n")
    print(
        markdown_table(
            ["path", "size", "features", "features/s", "GB/s", "fallbacks", "wrong"],
            [
                [
                    r["path"],
                    r["size"],
                    r["features"],
                    r["features_per_s"],
                    r["gb_per_s"],
                    r["fallbacks"],
                    r["wrong"],
                ]
                for r in rows
            ],
        )
    )
    return 0 if all(r["wrong"] == 0 and r["leaked_bytes"] == 0 for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="cuda")
    parser.add_argument("--receivers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ipc: no CUDA device; run with --device sim to exercise the protocol")
        sys.exit(0)
    sys.exit(asyncio.run(main(args.device, args.receivers, args.quick, args.out)))

"""An encoder process hands image features to two scheduler processes through the IPC transport.

    .venv/bin/python examples/encoder_to_scheduler_ipc.py [--device sim|cuda] [--images N]

This process is the vision encoder: it owns a FeatureSender whose pool is
deliberately small, so some features take the shared host fallback. Each
feature goes to both schedulers (one per tensor-parallel rank, consumers=2);
the handles travel over a multiprocessing queue (a ZMQ socket in a real
engine) as plain bytes (handle.to_bytes()): a scheduler parses them with
FeatureHandle.from_bytes() and never unpickles what arrives on its socket, and
its receiver serves only what the encoder published. Each scheduler receives
every handle onto its own device and checks it against the encoder's output.
The exit status is 0 when both schedulers verified every feature and the
transport ended with nothing held or leaked. With --device cuda the schedulers
run on GPU 0 and GPU 1 (when there are two).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import sys
import time
from multiprocessing.queues import Queue

import torch

from mmcache import CacheSettings, MMCacheError
from mmcache.device import Device, SimDevice
from mmcache.ipc import FeatureHandle, FeatureReceiver, FeatureSender, SenderEndpoint

HIDDEN = 1024
Item = tuple[int, bytes] | None


def encoder_output(image_id: int, device: str) -> torch.Tensor:
    """The encoder's feature of an image: 64..1024 tokens, deterministic so reads can be checked."""
    generator = torch.Generator().manual_seed(image_id)
    tokens = 64 * (1 + image_id * 7919 % 16)
    feature = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    return feature.to(device)


def make_device(kind: str, gpu: int) -> Device:
    """The simulator, or GPU gpu."""
    if kind == "sim":
        return SimDevice()
    from mmcache.device.cuda import CudaDevice

    if not torch.cuda.is_available():  # before set_device, which fails obscurely without one
        raise MMCacheError("--device cuda: CUDA is not available here; use --device sim")
    torch.cuda.set_device(gpu)
    return CudaDevice(gpu, background_pinning=False)


def scheduler(
    rank: int, kind: str, gpu: int, endpoint: bytes, inbox: Queue[Item], outbox: Queue[str]
) -> None:
    """One scheduler process: receive every feature, check it, report."""
    outbox.put(asyncio.run(schedule(rank, kind, gpu, SenderEndpoint.from_bytes(endpoint), inbox)))


async def schedule(
    rank: int, kind: str, gpu: int, endpoint: SenderEndpoint, inbox: Queue[Item]
) -> str:
    device = make_device(kind, gpu)
    where = "cpu" if kind == "sim" else f"cuda:{gpu}"
    verified = wrong = 0
    loop = asyncio.get_running_loop()
    async with FeatureReceiver(device=device) as receiver:
        await receiver.connect(endpoint)  # before the first handle: the sender sees our GPU
        while (item := await loop.run_in_executor(None, inbox.get)) is not None:
            image_id, data = item
            feature = await receiver.receive(FeatureHandle.from_bytes(data))
            if torch.equal(feature, encoder_output(image_id, where)):
                verified += 1
            else:
                wrong += 1
                print(f"rank {rank}: image {image_id} differs", file=sys.stderr)
    device.close()
    return f"{rank} {verified} {wrong}"


async def main(kind: str, images: int) -> int:
    ctx = multiprocessing.get_context("spawn")
    device = make_device(kind, 0)
    gpus = [0, 1 if kind == "cuda" and torch.cuda.device_count() > 1 else 0]
    # A 16 MiB pool holds a few dozen images: the rest go through shared host memory.
    settings = CacheSettings(
        use_cuda_ipc=True, ipc_pool_mb=16, ipc_fallback_mb=64, ipc_recycle_interval_s=0.01
    )
    outbox: Queue[str] = ctx.Queue()
    inboxes: list[Queue[Item]] = [ctx.Queue() for _ in gpus]
    started = time.perf_counter()
    async with FeatureSender(settings, device=device, consumers=2) as sender:
        ranks = [
            ctx.Process(
                target=scheduler,
                args=(rank, kind, gpu, sender.endpoint.to_bytes(), inboxes[rank], outbox),
                daemon=True,
            )
            for rank, gpu in enumerate(gpus)
        ]
        for process in ranks:
            process.start()
        await sender.wait_for_receivers(2, timeout=60)
        where = "cpu" if kind == "sim" else "cuda:0"
        for image_id in range(images):
            handle = await sender.send(encoder_output(image_id, where))
            data = handle.to_bytes()  # plain data: what goes on the wire
            for inbox in inboxes:
                inbox.put((image_id, data))
        for inbox in inboxes:
            inbox.put(None)
        loop = asyncio.get_running_loop()
        reports = [
            await loop.run_in_executor(None, functools.partial(outbox.get, timeout=60))
            for _ in ranks
        ]
        for process in ranks:
            process.join(30)
        drained = await sender.drain(timeout=10)
        stats = sender.stats()
    device.close()
    elapsed = time.perf_counter() - started
    ok = drained and stats.leaked_bytes == 0 and stats.live_leases == 0
    for report in sorted(reports):
        rank, verified, wrong = map(int, report.split())
        on = "the simulator" if kind == "sim" else f"cuda:{gpus[rank]}"
        print(f"scheduler {rank} on {on}: {verified}/{images} features verified")
        ok = ok and verified == images and wrong == 0
    print(
        f"{stats.sends} features in {elapsed:.1f} s; {stats.sends - stats.fallbacks} through "
        f"the pool, {stats.fallbacks} through host memory {stats.fallbacks_by_reason}; "
        f"leaked {stats.leaked_bytes} bytes"
    )
    print("all features verified" if ok else "FAILED", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--images", type=int, default=200)
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.device, args.images)))
    except MMCacheError as e:  # a bad setting, no GPU for --device cuda: say so, no traceback
        sys.exit(f"error: {e}")

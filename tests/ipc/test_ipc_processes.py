"""The transport across real processes (spawn): thousands of features, exhaustion, a kill.

The same scenario runs on the simulator (the pool is shared CPU memory) and on
CUDA (producer on GPU 0, receivers on GPU 0 and, when there is one, GPU 1).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized

import pytest
import torch
from ipc_support import feature, ipc_settings, same_bytes
from prometheus_client import CollectorRegistry

from mmcache.device import Device, SimDevice
from mmcache.ipc import FeatureHandle, FeatureReceiver, FeatureSender, SenderEndpoint

FEATURES = 3000
KILL_AT = FEATURES // 3

Item = tuple[int, FeatureHandle] | None
Report = tuple[str, int, int, list[str]]


def _make_device(kind: str, gpu: int) -> Device:
    if kind == "sim":
        return SimDevice()
    from mmcache.device.cuda import CudaDevice

    torch.cuda.set_device(gpu)  # as a scheduler process of one tensor-parallel rank does
    return CudaDevice(gpu, background_pinning=False)


def receiver_process(
    name: str,
    kind: str,
    gpu: int,
    endpoint: SenderEndpoint,
    inbox: Queue[Item],
    outbox: Queue[Report],
    progress: Synchronized[int],
    gpu0_context: Synchronized[int],
) -> None:
    """A scheduler process: receive every handle of its inbox, check its bytes, report."""
    report = asyncio.run(_receive_all(name, kind, gpu, endpoint, inbox, progress, gpu0_context))
    outbox.put(report)


async def _receive_all(
    name: str,
    kind: str,
    gpu: int,
    endpoint: SenderEndpoint,
    inbox: Queue[Item],
    progress: Synchronized[int],
    gpu0_context: Synchronized[int],
) -> Report:
    receiver = FeatureReceiver(device=_make_device(kind, gpu))
    await receiver.connect(endpoint)
    loop = asyncio.get_running_loop()
    ok = bad = 0
    errors: list[str] = []
    while (item := await loop.run_in_executor(None, inbox.get)) is not None:
        i, handle = item
        try:
            got = await receiver.receive(handle)
            if same_bytes(got, feature(i)):
                ok += 1
            else:
                bad += 1
        except Exception as exc:
            errors.append(f"feature {i}: {exc!r}")
        if kind == "cuda" and gpu != 0:
            from mmcache.device.cuda_driver import CudaDriver

            # Kept up to date: this process may be killed at any receive.
            gpu0_context.value = int(CudaDriver.get().primary_context_active(0))
        with progress.get_lock():
            progress.value += 1
    await receiver.close()
    return name, ok, bad, errors[:5]


async def _until(condition: Callable[[], bool], timeout: float) -> None:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ["sim", pytest.param("cuda", marks=pytest.mark.cuda)])
async def test_a_sender_and_two_receiver_processes_survive_a_killed_receiver(kind: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    second_gpu = 1 if kind == "cuda" and torch.cuda.device_count() >= 2 else 0
    device = _make_device(kind, 0)
    # No wait for pool room: the stream must exhaust the pool and fall back.
    settings = ipc_settings(pool_mb=4, fallback_mb=24, ipc_lease_timeout_s=60, ipc_pool_wait_s=0)
    registry = CollectorRegistry()
    sender = FeatureSender(settings, device=device, consumers=2, registry=registry)
    await sender.start()
    outbox: Queue[Report] = ctx.Queue()
    inboxes: dict[str, Queue[Item]] = {name: ctx.Queue() for name in "AB"}
    progress = {name: ctx.Value("i", 0) for name in "AB"}
    gpu0_context = {name: ctx.Value("i", -1) for name in "AB"}
    gpus = {"A": 0, "B": second_gpu}
    processes = {
        name: ctx.Process(
            target=receiver_process,
            args=(
                name,
                kind,
                gpus[name],
                sender.endpoint,
                inboxes[name],
                outbox,
                progress[name],
                gpu0_context[name],
            ),
            daemon=True,
        )
        for name in "AB"
    }
    for process in processes.values():
        process.start()
    loop = asyncio.get_running_loop()
    try:
        await sender.wait_for_receivers(2, timeout=90)
        routes = ["A", "B"]
        baseline = _device_bytes(device)
        for i in range(FEATURES):
            value = feature(i)
            handle = await sender.send(value if kind == "sim" else value.to(device.name))
            del value
            for name in routes:
                inboxes[name].put((i, handle))
            if i == KILL_AT:
                # B dies mid-stream: leases open, handles still queued for it.
                await _until(lambda: progress["B"].value >= 20, 60)
                processes["B"].kill()
                processes["B"].join(10)
                # Handles B never read stay in its pipe: at exit, the queue's feeder thread
                # would wait to write them to a reader that is gone, and hold the exit.
                inboxes["B"].cancel_join_thread()
                routes = ["A"]
        inboxes["A"].put(None)
        report = await loop.run_in_executor(None, functools.partial(outbox.get, timeout=90))
        assert report == ("A", FEATURES, 0, []), report
        if kind == "cuda" and second_gpu == 1:
            assert gpu0_context["B"].value == 0, "the GPU 1 receiver created a context on GPU 0"
        assert await sender.drain(timeout=30), sender.stats()
        stats = sender.stats()
        assert stats.sends == FEATURES
        assert stats.fallbacks_by_reason.get("pool_full", 0) > 0, "the pool was never exhausted"
        assert stats.receivers_lost >= 1
        assert (stats.pool_used_bytes, stats.fallback_used_bytes, stats.live_leases) == (0, 0, 0)
        assert stats.leaked_bytes == 0
        assert registry.get_sample_value(
            "mmcache_leaked_bytes", {"cache": "ipc", "tier": "ipc"}
        ) in (0, None)
        if isinstance(device, SimDevice):
            assert device.allocated_bytes == stats.pool_capacity_bytes
        else:
            assert await _settled(device, baseline) == baseline
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join(10)
        await sender.close(timeout=5)
        device.close()


def _device_bytes(device: Device) -> int:
    if isinstance(device, SimDevice):
        return device.allocated_bytes
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated(0))


async def _settled(device: Device, want: int) -> int:
    """Device memory once fence callbacks caught up with the GPU (they drop tensors late)."""
    deadline = time.monotonic() + 2
    while True:
        got = _device_bytes(device)
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.01)

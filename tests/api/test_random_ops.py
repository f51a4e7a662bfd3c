"""Thousands of random concurrent operations, bit-exact, with producers still running at put.

Runs on the simulator and, where present, on a GPU: producers write their
output on a side stream behind a long kernel (the output is not there yet when
it is put), evictions follow at once, and readers use their own stream.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import torch
from conftest import CacheFactory, Rig, stall

from mmcache import FeatureCache
from mmcache.device import SimDevice, Stream

ROWS = (8, 16, 64)
COLS = 256


def _value(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, COLS, generator=g).to(torch.bfloat16)


class _Producer:
    """Makes a device tensor whose contents a stream writes later (a kernel still running)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        if isinstance(rig.device, SimDevice):
            self.stream: Stream = rig.device.stream("producer")
        else:
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.gates: list[threading.Event] = []

    def make(self, want: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
        """gated: the simulated kernel waits for release_all() (the test must not block)."""
        dev = self.rig.device
        out = dev.empty(tuple(want.shape), want.dtype, self.stream)
        if isinstance(dev, SimDevice):
            gate = threading.Event()
            if gated:
                self.gates.append(gate)
            else:
                gate.set()

            def kernel(dst: torch.Tensor = out, src: torch.Tensor = want) -> None:
                gate.wait(5)
                time.sleep(0.0005)  # still running when put, evicted and read
                dst.copy_(src)

            dev.launch(self.stream, kernel)  # type: ignore[arg-type]
            alias = out.detach()
            dev.release(out, after=[])  # the caller's alias below is what it hands to put
            return alias
        assert isinstance(self.stream, torch.cuda.Stream)
        stall(self.stream, 0.002)
        with torch.cuda.stream(self.stream):
            out.copy_(want.to(out.device, non_blocking=True))
        return out

    def release_all(self) -> None:
        for gate in self.gates:
            gate.set()
        self.gates.clear()


async def test_thousands_of_random_operations_are_bit_exact(
    rig: Rig, make_cache: CacheFactory
) -> None:
    rng = random.Random(1234)
    cache: FeatureCache = make_cache(gpu_mb=0.5, cpu_mb=1.5, evict_ahead=0.0625)
    producer = _Producer(rig)
    consumer: Stream = (
        rig.device.stream("consumer") if isinstance(rig.device, SimDevice) else torch.cuda.Stream()  # type: ignore[no-untyped-call]
    )
    current: dict[int, tuple[int, int]] = {}  # key -> (seed, rows) of its latest put
    next_seed = 0
    checked = 0

    def expect(key: int) -> Callable[[torch.Tensor, slice | None], bool]:
        seed, rows = current[key]

        def ok(got: torch.Tensor, rows_: slice | None) -> bool:
            want = _value(seed, rows)
            return torch.equal(got.cpu(), want if rows_ is None else want[rows_])

        return ok

    async def read(key: int) -> None:
        nonlocal checked
        if key not in current:
            return
        check = expect(key)
        rows = current[key][1]
        span = rng.choice([None, slice(0, rows // 2), slice(rows // 4, rows)])
        if rng.random() < 0.5:
            got = await cache.get(key, device="cpu", rows=span)
        else:
            got = await cache.get(key, rows=span, stream=consumer)
            if got is not None and not isinstance(rig.device, SimDevice):
                assert isinstance(consumer, torch.cuda.Stream)
                with torch.cuda.stream(consumer):
                    got = got.clone()  # read on the consumer stream, ordered by the cache
                consumer.synchronize()
        if got is not None:  # absent: dropped or evicted from the host tier
            assert check(got, span), f"key {key} rows {span}: not what was put"
            checked += 1

    for step in range(2000):
        key = rng.randrange(40)
        op = rng.random()
        if op < 0.45:
            if op < 0.35:
                next_seed += 1
                rows = rng.choice(ROWS)
                value = producer.make(_value(next_seed, rows))
                current[key] = (next_seed, rows)
                await cache.put(key, value, stream=producer.stream)
            else:  # an encoder's batch for a few keys, some of them cached alone or grouped
                keys = rng.sample(range(40), rng.randint(2, 4))
                sizes = [rng.choice(ROWS) for _ in keys]
                parts = []
                for k, rows in zip(keys, sizes, strict=True):
                    next_seed += 1
                    parts.append(_value(next_seed, rows))
                    current[k] = (next_seed, rows)
                value = producer.make(torch.cat(parts))
                await cache.put_split(keys, value, sizes, stream=producer.stream)
            del value
            if rng.random() < 0.3:
                await read(rng.choice(list(current)))  # a read right after, maybe evicted
        elif op < 0.9:
            producer.release_all()
            await read(key)
        else:
            cache.discard(key)
            current.pop(key, None)
        if step % 50 == 0:
            producer.release_all()
    producer.release_all()
    await cache.drain()
    for key in list(current):
        await read(key)
    assert checked > 500
    s = cache.stats()
    assert s.evictions_gpu > 100 and s.leaked_bytes == 0
    assert s.gpu_bytes <= s.gpu_capacity_bytes and s.cpu_bytes <= s.cpu_capacity_bytes


async def test_producer_still_running_put_evicted_and_read_at_once(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """The seed race on a real timeline: put, evict and read while the producer still writes."""
    cache = make_cache(gpu_mb=32 / 1024, cpu_mb=1)  # one 32 KiB feature fits
    producer = _Producer(rig)
    want = _value(7, 64)
    value = producer.make(want, gated=True)
    await cache.put("late", value, stream=producer.stream)
    del value
    evictor = asyncio.create_task(cache.put("next", rig.tensor(64, 256, seed=8)))
    reader = asyncio.create_task(cache.get("late", device="cpu"))
    await asyncio.sleep(0.005)
    producer.release_all()
    got = await reader
    await evictor
    assert got is not None and torch.equal(got, want)
    assert cache.stats().evictions_gpu == 1

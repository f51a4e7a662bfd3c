"""What a fence waiter thread costs a busy event loop: the GIL it takes at each report.

The loop thread does Python work (as puts do), then enqueues an 8 MiB device-to-pinned
copy and records an event on a side stream, once per iteration. Either the loop looks
at the copies itself (an event query), or a waiter thread sleeps on each event through
the cache's FenceSleeper and reports it to the loop with call_soon_threadsafe, as the
device's waiter threads do. Printed: the loop's time in `copy_` and `record`, the rate.

    python benchmarks/waiter_gil_probe.py [--copies 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import markdown_table, percentile  # noqa: E402

from mmcache.device.cuda_driver import CudaDriver  # noqa: E402

COPY_BYTES = 8 << 20


def _busy(us: float, table: dict[int, int]) -> int:
    """Dict lookups for us microseconds: the loop's own Python work between copies."""
    end = time.perf_counter() + us * 1e-6
    x = 0
    while time.perf_counter() < end:
        x += table.get(x % 1000, 0)
    return x


class _Reporter:
    """A thread that sleeps on each event in turn and tells the loop, like a fence waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device: torch.device) -> None:
        self.reported = 0
        self._loop = loop
        self._device = device
        self._events: queue.SimpleQueue[torch.cuda.Event | None] = queue.SimpleQueue()
        self._landed: list[int] = []
        self._scheduled = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(self, event: torch.cuda.Event) -> None:
        self._events.put(event)

    def close(self) -> None:
        self._events.put(None)
        self._thread.join()

    def _run(self) -> None:
        torch.cuda.set_device(self._device)
        sleeper = CudaDriver.get().sleeper(self._device.index or 0)
        try:
            while (event := self._events.get()) is not None:
                if not event.query():  # type: ignore[no-untyped-call]
                    sleeper.sleep_until(event.cuda_event)
                self._landed.append(1)
                if not self._scheduled:  # one loop wake-up per burst, as FenceWatcher
                    self._scheduled = True
                    self._loop.call_soon_threadsafe(self._drain)
        finally:
            sleeper.close()

    def _drain(self) -> None:
        self._scheduled = False
        self.reported += len(self._landed)
        self._landed.clear()


async def _one(mode: str, busy_us: float, copies: int) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dsts = [torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    table = {i: i for i in range(1000)}
    reporter = _Reporter(asyncio.get_running_loop(), device) if mode == "waiter" else None
    pending: list[torch.cuda.Event] = []
    copy_us: list[float] = []
    record_us: list[float] = []
    start, cpu0 = time.perf_counter(), time.thread_time()
    for i in range(copies):
        _busy(busy_us, table)
        with torch.cuda.stream(side):
            a = time.perf_counter()
            dsts[i % len(dsts)].copy_(src, non_blocking=True)
            b = time.perf_counter()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
            c = time.perf_counter()
        copy_us.append((b - a) * 1e6)
        record_us.append((c - b) * 1e6)
        if reporter is not None:
            reporter.submit(event)
        else:
            pending.append(event)
            while pending and pending[0].query():  # type: ignore[no-untyped-call]
                pending.pop(0)
        await asyncio.sleep(0)
    side.synchronize()
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    if reporter is not None:
        reporter.close()
    return {
        "mode": mode,
        "busy_us": busy_us,
        "copy_p50_us": percentile(copy_us, 50),
        "copy_p90_us": percentile(copy_us, 90),
        "record_p50_us": percentile(record_us, 50),
        "gbps": copies * COPY_BYTES / wall / 1e9,
        "loop_cpu_over_wall": cpu / wall,
    }


async def run(copies: int, busy: Sequence[float], rounds: int) -> list[dict[str, Any]]:
    results = []
    for busy_us in busy:
        for r in range(rounds):
            modes = ("loop", "waiter") if r % 2 == 0 else ("waiter", "loop")
            for mode in modes:
                results.append(await _one(mode, busy_us, copies))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--copies", type=int, default=1500)
    parser.add_argument("--busy", type=float, nargs="+", default=[100.0, 150.0, 250.0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("waiter_gil_probe: needs a CUDA device")
        return 0
    results = asyncio.run(run(args.copies, args.busy, args.rounds))
    print(
        markdown_table(
            [
                "loop work µs per copy",
                "who sees the copies land",
                "copy_ call µs p50 / p90",
                "record µs p50",
                "GB/s",
                "loop CPU ÷ wall",
            ],
            [
                [
                    f"{r['busy_us']:.0f}",
                    "the loop (query)" if r["mode"] == "loop" else "waiter thread reports each",
                    f"{r['copy_p50_us']:.1f} / {r['copy_p90_us']:.1f}",
                    f"{r['record_p50_us']:.1f}",
                    f"{r['gbps']:.1f}",
                    f"{r['loop_cpu_over_wall']:.2f}",
                ]
                for r in results
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

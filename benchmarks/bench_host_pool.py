"""Host block placement in a fragmented arena: HostPool against its previous scan.

A full host tier that evicts features of mixed sizes leaves the arena full of holes;
every offload then asks for a block. The baseline is the pool's placement before its
size index, run on the same free ranges and requests in the same run: a best-fit scan
over the free ranges in arena order that stops at the first exact fit.

    python benchmarks/bench_host_pool.py [--quick] [--out host_pool.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import fmt, markdown_table, summary_us, write_json  # noqa: E402

from mmcache.device.base import Fence  # noqa: E402
from mmcache.device.sim import SimDevice  # noqa: E402
from mmcache.host_pool import HostPool  # noqa: E402

KiB = 1024
BLOCK = 64 * KiB
ALIGN = 512
#: (label, bytes): the previous scan stops early only at an exact fit.
REQUESTS = (
    ("exactly a hole's size", BLOCK),
    ("smaller than a hole", 60 * KiB),
    ("larger than every hole", 2 * BLOCK),
)


def fragmented_pool(holes: int) -> HostPool:
    """An arena of 2 x holes 64 KiB blocks with every other block freed: holes 64 KiB holes."""

    def run_now(_fences: Sequence[Fence], callback: Callable[[], None]) -> None:
        callback()

    arena = torch.empty(2 * holes * BLOCK + 64 * BLOCK, dtype=torch.uint8)
    pool = HostPool(SimDevice(), arena, alignment=ALIGN, defer=run_now)
    blocks = [pool.allocate(BLOCK) for _ in range(2 * holes)]
    for block in blocks[::2]:
        assert block is not None
        pool.free(block)
    return pool


def previous_best_fit(ranges: list[tuple[int, int]], size: int) -> int | None:
    """The baseline: scan the free ranges in arena order for the smallest that fits,
    stopping at the first exact fit (one arena chunk here, so no chunk edges)."""
    best_off = -1
    best_size = 0
    for off, free in ranges:
        if free < size or (best_off >= 0 and free >= best_size):
            continue
        best_off, best_size = off, free
        if free == size:
            break
    return None if best_off < 0 else best_off


def measure(holes: int, calls: int) -> dict[str, Any]:
    """Time allocations that fit a hole and ones that fit only the arena's tail."""
    out: dict[str, Any] = {"holes": holes}
    for label, size in REQUESTS:
        pool = fragmented_pool(holes)
        ranges = pool.free_ranges()
        clock = time.perf_counter
        ours, base = [], []
        for _ in range(calls):
            t0 = clock()
            block = pool.allocate(size)
            ours.append(clock() - t0)
            t0 = clock()
            expected = previous_best_fit(ranges, size)
            base.append(clock() - t0)
            assert block is not None and block.offset == expected, "placements must agree"
            pool.free(block)  # back to the same free ranges for the next call
        out[label] = {"pool": summary_us(ours), "scan": summary_us(base)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    calls = 200 if args.quick else 2_000
    results = [measure(holes, calls) for holes in (16, 1_024, 8_192)]
    rows = []
    for r in results:
        for label, _ in REQUESTS:
            pool, scan = r[label]["pool"]["p50_us"], r[label]["scan"]["p50_us"]
            rows.append([r["holes"], label, fmt(pool), fmt(scan), fmt(scan / pool)])
    print(f"host block allocation, median µs of {calls} calls (same placements checked)")
    headers = ["free ranges", "request", "HostPool", "previous scan (search only)", "scan / pool"]
    print(markdown_table(headers, rows))
    write_json(args.out, {"calls": calls, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

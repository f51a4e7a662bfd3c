"""Cold start: a fresh cache serving at once, while its host arena still pins.

A serving engine takes requests as soon as it is up. mmcache's host arena (the host
tier's size) is then still being pinned in the background, chunk by chunk, and torch's
caching host allocator behind the SGLang-style design pins each new block on first use.
This runs bench_serving.py's workload (same request sequence, same encoder, same check
of every feature served) from the moment each design is made, with no warm-up: by
default one client and 8 MB features, the first seconds cut into windows. A request
counts in the window in which its features were consumed on the GPU (an event recorded
after the check, timed against one recorded at the start), so a GPU backlog is not
counted as served. The designs alternate (SGLang-style, mmcache, then mmcache,
SGLang-style, ...) so that a host that drifts favours neither; torch's cached pinned
blocks are handed back between them, so each design starts with none.

    python benchmarks/bench_cold_start.py [--device cuda|sim] [--size 8MB] [--clients 1]
        [--windows 0.5 1 2 3 4] [--rounds 2] [--quick] [--out F]

On --device sim the cache pins its arena in simulated chunks (8 MiB every 2.5 ms, the
H200's registration rate) and the baseline uses plain CPU tensors: the figures exercise
the script, not a GPU. Exits non-zero when a design served a wrong value or mmcache
leaked a byte.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import fmt, markdown_table, median, timing_event, write_json  # noqa: E402
from bench_serving import (  # noqa: E402
    DEFAULTS,
    MM_GET,
    SGLANG,
    Config,
    EncodeKernel,
    Features,
    MMCache,
    Requests,
    SglangStyle,
    Strategy,
    Window,
    check_config,
    client,
    feature_rows,
    release_memory,
)

from mmcache.device import SimDevice  # noqa: E402

#: The simulator's arena pins 8 MiB per chunk; this long per chunk is about 3.4 GB/s,
#: what cuMemHostRegister reached on an H200 (BENCHMARKS.md, device primitives).
SIM_PIN_CHUNK_S = 0.0025
DESIGNS = (SGLANG, MM_GET)


@dataclass(slots=True)
class MarkedWindow(Window):
    """A window open from the start that also marks when each request was served."""

    mark: Callable[[], Any] = time.perf_counter
    marks: list[Any] = field(default_factory=list)

    def completed(self, issued: float, done: float, features: int) -> None:
        """Count the request and mark it (a CUDA event after its check, or the time)."""
        Window.completed(self, issued, done, features)
        self.marks.append(self.mark())


def served_at(marks: Sequence[Any], start: Any, simulated: bool) -> list[float]:
    """Seconds from the start to each request's check on the device (host time on the
    simulator); synchronises the host once."""
    if simulated:
        return [mark - start for mark in marks]
    torch.cuda.synchronize()
    return [start.elapsed_time(mark) / 1e3 for mark in marks]


def per_window(times: Sequence[float], edges: Sequence[float]) -> list[float]:
    """Requests per second served in each window [edges[i-1], edges[i]) (from 0)."""
    rates, low = [], 0.0
    for high in edges:
        served = sum(1 for t in times if low <= t < high)
        rates.append(served / (high - low))
        low = high
    return rates


class PinWatch:
    """How much of an mmcache's host arena was pinned at each window's edge, and when
    all of it was."""

    def __init__(self, design: MMCache, edges: Sequence[float], start: float) -> None:
        self.design, self.edges, self.start = design, edges, start
        self.fractions: list[float] = []
        self.whole_s: float | None = None
        self._tasks = [asyncio.create_task(self._sample()), asyncio.create_task(self._whole())]

    async def _sample(self) -> None:
        budget = self.design.settings.cpu_cache_mb * (1 << 20)
        for edge in self.edges:
            await asyncio.sleep(max(0.0, self.start + edge - time.perf_counter()))
            ready = self.design.cache.stats().host_ready_bytes
            self.fractions.append(min(1.0, ready / budget) if budget else 1.0)

    async def _whole(self) -> None:
        # Polled: a wait_host_ready call would have the arena pinned at full speed, as
        # for any caller who waits for it, where a serving engine lets it go at its pace.
        cache = self.design.cache
        while True:
            if cache.stats().host_ready:
                self.whole_s = time.perf_counter() - self.start
                return
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop watching (a design that finished first leaves nothing running)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def make_design(name: str, features: Features, cfg: Config, working_set: int) -> Strategy:
    """A fresh design: SGLang-style, or mmcache serving before its arena is pinned."""
    gpu_bytes = int(working_set * cfg.gpu_fraction)
    cpu_bytes = int(working_set * cfg.cpu_fraction)
    if name == SGLANG:
        return SglangStyle(features, cfg, gpu_bytes, cpu_bytes)
    device = SimDevice(pin_chunk_s=SIM_PIN_CHUNK_S) if cfg.simulated else None
    return MMCache(
        features, cfg, gpu_bytes, cpu_bytes, many=False, device=device, pinned_first=False
    )


async def serve_cold(
    name: str, features: Features, requests: Requests, cfg: Config, edges: Sequence[float]
) -> dict[str, Any]:
    """One design from the moment it is made until the last window closes."""
    working_set = cfg.catalogue * features.nbytes
    requests.restart()
    release_memory(cfg)  # torch's cached pinned blocks too: each design pins from nothing
    design = make_design(name, features, cfg, working_set)
    await design.start()
    mark: Callable[[], Any] = time.perf_counter if cfg.simulated else _cuda_mark
    start_mark, start = mark(), time.perf_counter()
    w = MarkedWindow(open=True, mark=mark)
    watch = PinWatch(design, edges, start) if isinstance(design, MMCache) else None
    clients = [
        asyncio.create_task(client(design, features, requests, w)) for _ in range(cfg.concurrency)
    ]
    await asyncio.sleep(edges[-1])
    w.stopped = True
    await asyncio.gather(*clients)
    times = served_at(w.marks, start_mark, cfg.simulated)
    row: dict[str, Any] = {
        "requests_per_s": per_window(times, edges),
        "requests": sum(1 for t in times if t < edges[-1]),
    }
    if watch is not None:
        await watch.stop()
        row["pinned_fraction"] = watch.fractions
        row["arena_pinned_s"] = watch.whole_s
    extra = await design.finish()
    row["wrong_values"] = features.take_wrong()
    row["leaked_bytes"] = extra.get("leaked_bytes", 0)
    del design
    release_memory(cfg)
    return row


def _cuda_mark() -> torch.cuda.Event:
    event = timing_event()
    event.record()
    return event


async def run(cfg: Config, size: str, edges: Sequence[float], rounds: int) -> dict[str, Any]:
    """Every round: the designs in alternating order, each from cold."""
    kernel = None if cfg.simulated else EncodeKernel(cfg.encode_ms / 1e3, cfg.tensor_device)
    features = Features(feature_rows(size), cfg, kernel)
    requests = Requests(cfg)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in DESIGNS}
    for i in range(rounds):
        for name in DESIGNS if i % 2 == 0 else DESIGNS[::-1]:
            runs[name].append(await serve_cold(name, features, requests, cfg, edges))
    return {
        "device": cfg.device,
        "device_name": "simulated" if cfg.simulated else torch.cuda.get_device_name(),
        "size": size,
        "feature_bytes": features.nbytes,
        "clients": cfg.concurrency,
        "catalogue": cfg.catalogue,
        "gpu_fraction": cfg.gpu_fraction,
        "cpu_fraction": cfg.cpu_fraction,
        "window_edges_s": list(edges),
        "encode_kernel": kernel.describe() if kernel is not None else None,
        "runs": runs,
        "wrong_values": sum(r["wrong_values"] for rs in runs.values() for r in rs),
        "leaked_bytes": sum(r["leaked_bytes"] for rs in runs.values() for r in rs),
    }


def report(results: dict[str, Any]) -> str:
    """Per window: each design's req/s (median of its rounds, range), mmcache over SGLang-style."""
    edges = results["window_edges_s"]
    labels = [f"{low:g}-{high:g} s" for low, high in zip([0.0, *edges], edges, strict=False)]
    medians = {
        name: [median([r["requests_per_s"][i] for r in runs]) for i in range(len(edges))]
        for name, runs in results["runs"].items()
    }
    rows: list[list[str]] = []
    for name, runs in results["runs"].items():
        cells = []
        for i, mid in enumerate(medians[name]):
            low = min(r["requests_per_s"][i] for r in runs)
            high = max(r["requests_per_s"][i] for r in runs)
            cells.append(f"{mid:,.0f} ({low:,.0f}-{high:,.0f})")
        rows.append([name, *cells])
    rows.append(
        [
            "mmcache ÷ SGLang-style",
            *(
                fmt(ours / theirs if theirs else None)
                for ours, theirs in zip(medians[MM_GET], medians[SGLANG], strict=True)
            ),
        ]
    )
    mm_runs = results["runs"][MM_GET]
    pinned = [median([r["pinned_fraction"][i] for r in mm_runs]) for i in range(len(edges))]
    rows.append(["mmcache arena pinned at the window's end", *(f"{p:.0%}" for p in pinned)])
    whole = [r["arena_pinned_s"] for r in mm_runs if r["arena_pinned_s"] is not None]
    return "\n".join(
        [
            f"cold start on {results['device']} ({results['device_name']}), "
            f"{results['size']} features, {results['clients']} client(s), "
            f"{len(mm_runs)} round(s); req/s served in each window after start:",
            "",
            markdown_table(["design", *labels], rows),
            "",
            f"mmcache's arena pinned whole after {fmt(median(whole))} s (median); "
            f"wrong values: {results['wrong_values']}, leaked bytes: {results['leaked_bytes']}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, run, print the table, write JSON; 1 on a wrong value or a leak."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "sim"), default=None)
    parser.add_argument("--size", default="8MB", help="feature size (default 8MB)")
    parser.add_argument("--clients", type=int, default=1, help="concurrent clients (default 1)")
    parser.add_argument("--catalogue", type=int, default=DEFAULTS.catalogue)
    parser.add_argument(
        "--windows",
        type=float,
        nargs="+",
        default=None,
        help="the windows' end edges in seconds after start (default 0.5 1 2 3 4)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="runs of each design (default 2)")
    parser.add_argument("--quick", action="store_true", help="windows 0.25 0.5 1, one round")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "sim")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_cold_start: no CUDA device here; run with --device sim")
        return 0
    default_edges, default_rounds = ([0.25, 0.5, 1.0], 1) if args.quick else ([0.5, 1, 2, 3, 4], 2)
    edges = sorted(args.windows if args.windows is not None else default_edges)
    rounds = args.rounds if args.rounds is not None else default_rounds
    if edges[0] <= 0 or len(set(edges)) != len(edges):
        parser.error("--windows must be distinct edges > 0")
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    cfg = Config(
        device=device, sizes=(args.size,), concurrency=args.clients, catalogue=args.catalogue
    )
    problem = check_config(cfg)
    if problem:
        parser.error(problem)
    if cfg.simulated:
        torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    results = asyncio.run(run(cfg, args.size, edges, rounds))
    print(report(results))
    write_json(args.out, results)
    return 1 if results["wrong_values"] or results["leaked_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())

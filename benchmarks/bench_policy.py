"""Eviction policies on features that cost different encoder time: the seconds misses cost.

Images (1 MiB features, about 5 ms to encode) and video clips (8 MiB, about 80 ms) are
requested with Zipf popularity, seeded, in two traces: stationary, and drifting (every
tenth of the trace, 30 % of the popularity ranks are dealt to other items, as new
content comes and old content fades). Each trace is replayed through
FeatureCache.get_or_compute on the simulator with each eviction_policy at the same GPU
budgets, fractions of the working set; the host tier is off, so every miss is an
encoder run. fn runs no encoder: it advances the clock get_or_compute reads by the
item's seconds, so get_or_compute measures the trace's cost. Features are held at
1/--scale of their size (the policies and the budget see only ratios). Reported: the
hit ratio and the encoder seconds the misses cost.

    python benchmarks/bench_policy.py [--quick] [--requests N] [--seed S] [--scale N]
                                      [--out policy.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from prometheus_client import CollectorRegistry

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import MiB, fmt, markdown_table, write_json  # noqa: E402

import mmcache.compute_on_miss  # noqa: E402
from mmcache import CacheSettings, FeatureCache  # noqa: E402
from mmcache.core.entry import Entry  # noqa: E402
from mmcache.core.policy import POLICY_NAMES, PolicyName  # noqa: E402

#: kind -> (feature bytes, encoder seconds); each item's seconds vary by ±20 %
KINDS = {"image": (1 * MiB, 0.005), "clip": (8 * MiB, 0.080)}
IMAGES = 2_000
CLIPS = 250  # as many bytes as the images
ZIPF_S = 0.9
#: trace -> (phases, share of popularity ranks dealt anew between phases)
TRACES = {"stationary": (1, 0.0), "drifting": (10, 0.3)}
BUDGETS = (0.10, 0.25)  # of the working set
ROW_BYTES = 1024  # int32 rows of 256 values


@dataclass(frozen=True, slots=True)
class Item:
    """An image or clip: its feature's bytes and the encoder seconds it takes."""

    kind: str
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Trace:
    """The catalogue and the requests (indices into it), in order."""

    name: str
    items: list[Item]
    requests: list[int]

    def working_set_bytes(self) -> int:
        return sum(self.items[i].nbytes for i in set(self.requests))

    def total_seconds(self) -> float:
        return sum(self.items[i].seconds for i in self.requests)


def make_trace(name: str, requests: int, seed: int) -> Trace:
    """requests Zipf-popular picks from the catalogue, popularity re-dealt between phases."""
    phases, churn = TRACES[name]
    rng = random.Random(seed)
    items = []
    for kind, count in (("image", IMAGES), ("clip", CLIPS)):
        nbytes, seconds = KINDS[kind]
        items += [Item(kind, nbytes, seconds * rng.uniform(0.8, 1.2)) for _ in range(count)]
    ranked = list(range(len(items)))  # ranked[r]: the item at popularity rank r
    rng.shuffle(ranked)
    weights = list(itertools.accumulate(1 / (r + 1) ** ZIPF_S for r in range(len(items))))
    picks: list[int] = []
    for phase in range(phases):
        if phase:
            ranks = rng.sample(range(len(ranked)), int(churn * len(ranked)))
            dealt = [ranked[r] for r in ranks]
            rng.shuffle(dealt)
            for r, item in zip(ranks, dealt, strict=True):
                ranked[r] = item
        n = requests // phases if phase < phases - 1 else requests - len(picks)
        picks += rng.choices(ranked, cum_weights=weights, k=n)
    return Trace(name, items, picks)


class EncoderClock:
    """Stands in for the time module get_or_compute reads: fn "takes" an item's seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


async def replay(trace: Trace, policy: PolicyName, budget: float, scale: int) -> dict[str, Any]:
    """trace through a cache of budget x the working set: hits, misses and their seconds."""
    clock = EncoderClock()
    gpu_bytes = budget * trace.working_set_bytes() / scale
    settings = CacheSettings(
        gpu_cache_mb=gpu_bytes / MiB, cpu_cache_mb=0, evict_ahead=0, eviction_policy=policy
    )
    misses = wrong = 0
    miss_seconds = 0.0
    with mock.patch.object(mmcache.compute_on_miss, "time", clock):
        async with FeatureCache(settings, device="sim", registry=CollectorRegistry()) as cache:
            for index in trace.requests:
                item = trace.items[index]
                computed: list[int] = []

                def encode(
                    index: int = index, item: Item = item, computed: list[int] = computed
                ) -> torch.Tensor:
                    clock.now += item.seconds
                    computed.append(index)
                    rows = max(1, item.nbytes // scale // ROW_BYTES)
                    return torch.full((rows, ROW_BYTES // 4), index, dtype=torch.int32)

                got = await cache.get_or_compute(index, encode)
                if int(got[0, 0]) != index or int(got[-1, -1]) != index:
                    wrong += 1
                del got
                if computed:
                    if not misses:
                        check_measured(cache, index, item.seconds)
                    misses += 1
                    miss_seconds += item.seconds
            await cache.drain()
            stats = cache.stats()
    requests = len(trace.requests)
    return {
        "policy": policy,
        "budget": budget,
        "requests": requests,
        "hit_ratio": 1 - misses / requests,
        "miss_seconds": miss_seconds,
        "evictions": stats.evictions_gpu,
        "wrong": wrong,
        "leaked_bytes": stats.leaked_bytes,
    }


def check_measured(cache: FeatureCache, key: int, seconds: float) -> None:
    """The cost get_or_compute gave key's entry is the encoder clock's: else this measures
    nothing (the clock no longer reaches get_or_compute)."""
    entry = cache._core.index[key]
    if not isinstance(entry, Entry) or entry.cost is None or abs(entry.cost - seconds) > 1e-9:
        raise RuntimeError(f"get_or_compute did not measure the encoder clock ({entry!r})")


async def run(requests: int, scale: int, seed: int) -> dict[str, Any]:
    results: dict[str, Any] = {"requests": requests, "scale": scale, "seed": seed, "traces": {}}
    for name in TRACES:
        trace = make_trace(name, requests, seed)
        rows = [
            await replay(trace, policy, budget, scale)
            for budget in BUDGETS
            for policy in POLICY_NAMES
        ]
        results["traces"][name] = {
            "working_set_mib": trace.working_set_bytes() / MiB,
            "total_seconds": trace.total_seconds(),
            "rows": rows,
        }
    return results


def table(results: dict[str, Any]) -> str:
    rows = []
    for name, trace in results["traces"].items():
        lru = {r["budget"]: r["miss_seconds"] for r in trace["rows"] if r["policy"] == "lru"}
        for r in trace["rows"]:
            rows.append(
                [
                    name,
                    f"{r['budget']:.0%} ({r['budget'] * trace['working_set_mib'] / 1024:.1f} GiB)",
                    r["policy"],
                    fmt(r["hit_ratio"], 3),
                    fmt(r["miss_seconds"], 1),
                    fmt(r["miss_seconds"] / lru[r["budget"]], 3),
                ]
            )
    headers = ["trace", "GPU budget", "policy", "hit ratio", "encoder s of misses", "÷ LRU's"]
    return markdown_table(headers, rows)


def verdicts(results: dict[str, Any]) -> list[str]:
    """Per trace and budget: the cost policy's encoder seconds against the best other's."""
    lines = []
    for name, trace in results["traces"].items():
        for budget in BUDGETS:
            rows = {r["policy"]: r for r in trace["rows"] if r["budget"] == budget}
            cost = rows.pop("cost")["miss_seconds"]
            best = min(rows, key=lambda p: rows[p]["miss_seconds"])
            other = rows[best]["miss_seconds"]
            verdict = "saves" if cost < other else "does not save"
            lines.append(
                f"{name}, {budget:.0%}: cost {verdict} encoder time against the best other "
                f"policy, {best} ({cost:.1f} s against {other:.1f} s, {other - cost:+.1f} s)"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000, help="requests per trace")
    parser.add_argument("--quick", action="store_true", help="2,000 requests per trace")
    parser.add_argument(
        "--scale", type=int, default=1024, help="features held at 1/scale of their size"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    requests = 2_000 if args.quick else args.requests
    results = asyncio.run(run(requests, args.scale, args.seed))
    print(
        f"bench_policy on sim: {requests:,} requests a trace over {IMAGES:,} images (1 MiB, "
        f"~5 ms) and {CLIPS} clips (8 MiB, ~80 ms), Zipf s={ZIPF_S}, seed {args.seed}; "
        f"host tier off; features held at 1/{args.scale} of their size"
    )
    print(
        "; ".join(
            f"{name}: working set {trace['working_set_mib'] / 1024:.1f} GiB, every request "
            f"encoded {trace['total_seconds']:.1f} s"
            for name, trace in results["traces"].items()
        )
    )
    print(table(results))
    print("\n".join(verdicts(results)))
    bad = [
        r
        for trace in results["traces"].values()
        for r in trace["rows"]
        if r["wrong"] or r["leaked_bytes"]
    ]
    print(
        f"wrong values: {sum(r['wrong'] for r in bad)}; leaked bytes: "
        f"{sum(r['leaked_bytes'] for r in bad)}"
    )
    write_json(args.out, results)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

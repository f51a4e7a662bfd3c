"""The remote tier against a local redis-server: remote hit latency and GB/s by feature size.

For each size (64 KiB, 1 MiB, 8 MiB), node A puts N features and drains its remote
writes (write GB/s); node B, a fresh cache on the same server, reads and discards each
one once (which warms its arena up), then gets each one (a remote hit: fetched,
checked, landed in its host tier, uploaded to the device) and then again (a local
hit). Each read is checked bit for bit. Remote hits are set against re-encoding the
feature, as mmcache demo models a vision encoder (ENCODE_S_PER_1K_TOKENS for a
thousand bf16 rows of width 3,584). Then `put` latency with no remote tier, with one,
and with one whose server is down (it must not change beyond noise: writes never block).

    python benchmarks/bench_remote.py [--device sim|cuda] [--remote-url URL] [--quick] [--out F]

Without --remote-url it starts a redis-server of its own (no persistence); where none
is installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import fmt, gbps, markdown_table, summary_us, write_json  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from mmcache import CacheSettings, FeatureCache, MMCacheError  # noqa: E402
from mmcache.demo import ENCODE_S_PER_1K_TOKENS  # noqa: E402
from mmcache.remote.local_server import local_redis_server  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 1 * MiB, 8 * MiB)
DEMO_ROW_BYTES = 3584 * 2  # a bf16 row of the demo's width


def feature(nbytes: int, seed: int, where: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 1024, 256, generator=g).to(where)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    if got is None:
        print(f"a read of {want.nbytes} bytes missed", file=sys.stderr)
        return False
    return torch.equal(got.cpu(), want)


def cache(device: str, url: str | None, namespace: str, name: str) -> FeatureCache:
    # A queue that takes every write of a round: this measures throughput, not overflow.
    settings = CacheSettings(
        gpu_cache_mb=512,
        cpu_cache_mb=1024,
        remote_url=url,
        remote_namespace=namespace,
        remote_queue_mb=1024,
    )
    return FeatureCache(settings, device, name=name, registry=CollectorRegistry())


async def by_size(device: str, where: str, url: str, nbytes: int, count: int) -> dict[str, Any]:
    namespace = f"bench-{time.time_ns()}"
    wants = [feature(nbytes, i, "cpu") for i in range(count)]
    async with cache(device, url, namespace, "a") as a, cache(device, url, namespace, "b") as b:
        await b.wait_host_ready()  # remote hits land in the host tier
        for i, want in enumerate(wants):
            await a.put(i, want.to(where) if where != "cpu" else want.clone())
        started = time.perf_counter()
        await a.drain()
        write_s = time.perf_counter() - started
        remote: list[float] = []
        local: list[float] = []
        exact = True
        for i, want in enumerate(wants):  # a first pass warms node B's arena up, then goes
            exact &= _same(await b.get(i, device="cpu"), want)
            b.discard(i)
        await b.drain()
        for i, want in enumerate(wants):
            for times in (remote, local):
                began = time.perf_counter()
                got = await b.get(i)
                times.append(time.perf_counter() - began)
                exact &= _same(got, want)
                del got
        sa, sb = a.stats(), b.stats()
    encode_s = ENCODE_S_PER_1K_TOKENS * nbytes / DEMO_ROW_BYTES / 1000
    return {
        "feature_bytes": nbytes,
        "features": count,
        "write_gbps": gbps(sa.remote_written_bytes, write_s),
        "remote_hit": summary_us(remote),
        "remote_gbps": gbps(nbytes * count, sum(remote)),
        "local_hit": summary_us(local),
        "encode_us": encode_s * 1e6,
        "remote_hits": sb.remote_hits // 2,
        "dropped_writes": sa.remote_dropped_writes,
        "errors": sa.remote_errors + sb.remote_errors,
        "exact": exact,
        "leaked_bytes": sa.leaked_bytes + sb.leaked_bytes,
    }


async def put_latency(device: str, where: str, url: str | None, count: int) -> dict[str, float]:
    async with cache(device, url, f"bench-put-{time.time_ns()}", "p") as c:
        # Warm up first: the first writes after start are what finds a down server down.
        for i in range(16):
            await c.put(("warm-up", i), feature(64 * KiB, i, where))
        await c.drain()
        await asyncio.sleep(0.01)
        values = [feature(64 * KiB, i, where) for i in range(count)]
        times = []
        for i in range(count):
            began = time.perf_counter()
            await c.put(i, values[i])
            times.append(time.perf_counter() - began)
            values[i] = torch.empty(0)
            if i % 16 == 15:
                await asyncio.sleep(0)  # let the writes go, as a serving loop would
        return summary_us(times)


async def main(args: argparse.Namespace) -> int:
    device = args.device  # each cache makes its own
    where = "cpu" if device == "sim" else "cuda"
    count = 16 if args.quick else 64
    with contextlib.ExitStack() as stack:
        try:
            url = args.remote_url or stack.enter_context(local_redis_server())
        except MMCacheError as e:
            print(f"bench_remote: {e}; nothing to measure")
            return 0
        rows = [await by_size(device, where, url, n, count) for n in SIZES]
        down = "redis://127.0.0.1:1/0"  # nothing listens there
        puts = {
            "no remote tier": await put_latency(device, where, None, count * 4),
            "remote tier": await put_latency(device, where, url, count * 4),
            "remote tier, server down": await put_latency(device, where, down, count * 4),
        }
    print(f"device: {args.device}; server: {'given' if args.remote_url else 'local'}\n")
    print(
        markdown_table(
            (
                "feature",
                "write GB/s",
                "remote hit p50 / p99 µs",
                "remote GB/s",
                "local hit p50 µs",
                "re-encode µs (modelled)",
                "exact",
            ),
            [
                (
                    f"{r['feature_bytes'] // KiB} KiB",
                    fmt(r["write_gbps"]),
                    f"{fmt(r['remote_hit']['p50_us'], 0)} / {fmt(r['remote_hit']['p99_us'], 0)}",
                    fmt(r["remote_gbps"]),
                    fmt(r["local_hit"]["p50_us"], 1),
                    fmt(r["encode_us"], 0),
                    r["exact"],
                )
                for r in rows
            ],
        )
    )
    print()
    print(
        markdown_table(
            ("put of 64 KiB", "p50 µs", "p99 µs"),
            [(k, fmt(v["p50_us"], 1), fmt(v["p99_us"], 1)) for k, v in puts.items()],
        )
    )
    write_json(args.out, {"device": args.device, "sizes": rows, "put": puts})
    ok = all(
        r["exact"] and r["leaked_bytes"] == 0 and r["remote_hits"] == r["features"] for r in rows
    )
    ratio = puts["remote tier, server down"]["p50_us"] / puts["no remote tier"]["p50_us"]
    print(f"\nput p50 with the server down / without a remote tier: {ratio:.2f}")
    print(f"median remote hit speed: {statistics.median(r['remote_gbps'] for r in rows):.2f} GB/s")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--remote-url", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    try:
        sys.exit(asyncio.run(main(parser.parse_args())))
    except MMCacheError as e:
        sys.exit(f"error: {e}")

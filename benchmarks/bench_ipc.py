"""IPC transport benchmark: mmcache's pool and host fallback beside a torch.multiprocessing queue.

Run from the repository root (a few minutes on an H200; --quick on the simulator: seconds):

    python benchmarks/bench_ipc.py [--device cuda|sim] [--receivers 1|2] [--quick] [--out JSON]

One sender (this process, GPU 0) hands features of 64 KB, 1 MB and 8 MB (bf16 rows of
4,096) to receiver processes (GPU 0, and GPU 1 for a second receiver when there is one),
one feature per message and in batches of 16, along four paths:

- pool receive: FeatureSender.send -> FeatureReceiver.receive (a copy the receiver owns)
  through the device IPC pool (use_cuda_ipc=True); batches by send_many / receive_many;
- pool lease: the same pool read in place inside receiver.lease() / lease_many(), no copy
  out (each view's last 256 values are read; the checked ones compared whole);
- fallback: use_cuda_ipc=False, every feature through the shared pinned host memory;
- torch.mp queue: what a user would pick instead, a torch.multiprocessing (spawn) Queue
  of CUDA tensors (CPU tensors on the simulator), one list of 16 per message in batches;
  the consumer clones each tensor onto its device.

Handles travel as plain bytes (to_bytes()) through a multiprocessing pipe, as over a
scheduler's socket. Receivers read every message waiting before they receive; the sender
does not wait for receives, and the features it sends are made before the clock starts
(send takes ownership of each). A run lasts from the first send to the last receiver's
last feature done (its GPU synchronised; time.perf_counter is one clock for every process
on Linux). The table gives features/s, GB/s, the pool paths' ratios to the fallback and
to torch.mp, fallbacks and leaked bytes, and wrong features (four per run compared byte
for byte). Then the latency of one 1 MB feature at a time (from just before send to the
receiver holding it: receive returned, lease entered, or the clone queued; "GPU done"
after the receiver synchronises), and a steady stream of 1 MB sends paced at 80 % of the
pool's 1 MB throughput, with the share that fell back for a full pool (target < 1 %).
Exits 1 if a feature was wrong or bytes leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from prometheus_client import CollectorRegistry

# Run as a script from a checkout: make the package and the sibling helpers importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from _common import MiB, gbps, markdown_table, percentile, write_json  # noqa: E402

from mmcache import CacheSettings  # noqa: E402
from mmcache.device import SimDevice  # noqa: E402
from mmcache.device.cuda import CudaDevice  # noqa: E402
from mmcache.ipc import (  # noqa: E402
    FeatureBatch,
    FeatureHandle,
    FeatureReceiver,
    FeatureSender,
    SenderEndpoint,
)

#: name -> bytes of one feature (bf16 rows of 4096: 8 MB is a 1000-token image).
SIZES = {"64KB": 64 << 10, "1MB": 1 << 20, "8MB": 8 << 20}
BATCHES = (1, 16)
RECEIVE, LEASE, FALLBACK, TORCH = "pool receive", "pool lease", "fallback", "torch.mp queue"
PATHS = (RECEIVE, LEASE, FALLBACK, TORCH)
VARIANTS = 8  # feature i holds content i % VARIANTS
TOUCH = 256  # values of each leased view the receiver reads
STEADY_SHARE = 0.8  # the steady stream's pace, of the pool's measured 1 MB throughput
REPLY_TIMEOUT_S = 120.0


def make_device(kind: str, gpu: int) -> SimDevice | CudaDevice:
    """The simulator, or GPU gpu."""
    if kind == "sim":
        return SimDevice()
    torch.cuda.set_device(gpu)
    return CudaDevice(gpu, background_pinning=False)


def feature(nbytes: int, variant: int, where: str) -> torch.Tensor:
    """Feature content `variant` of nbytes: bf16 rows of 4096, finite values, distinct bits."""
    bits = torch.arange(nbytes // 2, dtype=torch.int32, device=where).mul_(7).add_(variant * 6443)
    return bits.remainder_(16381).to(torch.int16).view(torch.bfloat16).view(-1, 4096)


def features(nbytes: int, where: str, made: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Every content of nbytes on where, kept in made for one size at a time."""
    if nbytes not in made:
        made.clear()
        made[nbytes] = [feature(nbytes, v, where) for v in range(VARIANTS)]
    return made[nbytes]


def checked(count: int) -> frozenset[int]:
    """The features of a run of count that receivers compare byte for byte."""
    return frozenset((0, 1, count // 2, count - 1))


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether got holds want's bytes (got may live on another device)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return torch.equal(got.to(want.device).view(torch.int16), want.view(torch.int16))


async def readable(conn: Connection) -> None:
    """Wait until conn has a message, on the running loop (no thread hop)."""
    if conn.poll():
        return
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            await ready
    finally:
        loop.remove_reader(conn.fileno())


def widen(conn: Connection) -> None:
    """Let the pipe behind conn hold many handles, so a sender seldom blocks on it."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)


# --- receiver processes -----------------------------------------------------------------


def receiver_process(
    kind: str, gpu: int, inbox: Connection, outbox: Connection, queue: Any
) -> None:
    """A scheduler process: connect to the sender it is told of, consume, time, verify."""
    if kind == "sim":
        torch.set_num_threads(1)  # the simulator's copies and checks: keep to one core
    asyncio.run(Consumer(kind, gpu, inbox, outbox, queue).serve())


class Consumer:
    """One receiver process's side of every run."""

    def __init__(self, kind: str, gpu: int, inbox: Connection, outbox: Connection, queue: Any):
        self.device = make_device(kind, gpu)
        self.where = "cpu" if kind == "sim" else f"cuda:{gpu}"
        self.inbox = inbox
        self.outbox = outbox
        self.queue = queue
        self.receiver: FeatureReceiver | None = None
        self.backlog: deque[bytes] = deque()
        self.sinks: dict[torch.device, torch.Tensor] = {}
        self.held_at = 0.0  # when the last feature was held (perf_counter)
        self.expected: dict[int, list[torch.Tensor]] = {}

    async def serve(self) -> None:
        try:
            while True:
                await readable(self.inbox)
                command = self.inbox.recv()
                if command[0] == "stop":
                    break
                self.outbox.send(await self.obey(command))
        finally:
            if self.receiver is not None:
                await self.receiver.close()
            self.device.close()

    async def obey(self, command: tuple[Any, ...]) -> tuple[Any, ...]:
        op = command[0]
        if op == "connect":
            self.receiver = FeatureReceiver(device=self.device)
            await self.receiver.connect(SenderEndpoint.from_bytes(command[1]))
        elif op == "leave":
            assert self.receiver is not None
            await self.receiver.close()
            self.receiver = None
        elif op == "run":
            return await self.run(*command[1:])
        elif op == "ping":
            return await self.ping(*command[1:])
        return ("ok",)

    async def run(self, path: str, nbytes: int, batch: int, count: int) -> tuple[Any, ...]:
        """Consume count features; report when the last was done and how many were wrong."""
        expected = features(nbytes, self.where, self.expected)
        checks = checked(count)
        self.outbox.send(("ready",))
        wrong = 0
        for first in range(0, count, batch):
            wrong += await self.consume(path, batch, first, checks, expected)
        self.device.synchronize()
        return ("done", time.perf_counter(), wrong)

    async def ping(self, path: str, nbytes: int, count: int) -> tuple[Any, ...]:
        """One feature at a time: answer each with when it was held and when its GPU work ended."""
        self.outbox.send(("ready",))
        for i in range(count):  # unchecked: a check would delay "GPU done"
            await self.consume(path, 1, i, frozenset(), ())
            self.device.synchronize()
            self.outbox.send_bytes(struct.pack("dd", self.held_at, time.perf_counter()))
        return ("done",)

    async def message(self) -> bytes:
        """The next handle's bytes, reading every message already waiting first."""
        while not self.backlog:
            await readable(self.inbox)
            while self.inbox.poll():
                self.backlog.append(self.inbox.recv_bytes())
        return self.backlog.popleft()

    async def consume(
        self,
        path: str,
        batch: int,
        first: int,
        checks: frozenset[int],
        expected: Sequence[torch.Tensor],
    ) -> int:
        """Take one message of batch features (first is the first's number); count wrong ones."""
        if path == TORCH:
            got = self.queue.get()
            tensors = [t.to(self.where, copy=True) for t in (got if batch > 1 else [got])]
            del got
            self.held_at = time.perf_counter()
            return self.wrong(tensors, first, checks, expected)
        data = await self.message()
        receiver = self.receiver
        assert receiver is not None
        if path == LEASE:
            if batch == 1:
                async with receiver.lease(FeatureHandle.from_bytes(data)) as view:
                    self.held_at = time.perf_counter()
                    return self.read([view], first, checks, expected)
            async with receiver.lease_many(FeatureBatch.from_bytes(data)) as views:
                self.held_at = time.perf_counter()
                return self.read(views, first, checks, expected)
        if batch == 1:
            tensors = [await receiver.receive(FeatureHandle.from_bytes(data))]
        else:
            tensors = await receiver.receive_many(FeatureBatch.from_bytes(data))
        self.held_at = time.perf_counter()
        return self.wrong(tensors, first, checks, expected)

    def read(
        self,
        views: Sequence[torch.Tensor],
        first: int,
        checks: frozenset[int],
        expected: Sequence[torch.Tensor],
    ) -> int:
        """Read each leased view in place (a few values; the checked ones whole)."""
        for view in views:
            flat = view.reshape(-1)
            sink = self.sinks.get(flat.device)
            if sink is None:
                sink = self.sinks[flat.device] = torch.empty(
                    TOUCH, dtype=flat.dtype, device=flat.device
                )
            sink.copy_(flat[-TOUCH:], non_blocking=True)
        return self.wrong(views, first, checks, expected)

    @staticmethod
    def wrong(
        tensors: Sequence[torch.Tensor],
        first: int,
        checks: frozenset[int],
        expected: Sequence[torch.Tensor],
    ) -> int:
        """How many of the checked ones among tensors (numbered from first) are wrong."""
        return sum(
            1
            for i, tensor in enumerate(tensors, first)
            if i in checks and not same_bytes(tensor, expected[i % VARIANTS])
        )


# --- the sender ---------------------------------------------------------------------------


def settings(kind: str, pool: bool) -> CacheSettings:
    """The transport's settings for one path."""
    # The simulator's pool and fallback hold two of the largest batches (a batch must fit
    # whole), the GPU's several.
    mb = 512 if kind == "cuda" else max(64, 2 * max(BATCHES) * max(SIZES.values()) // MiB)
    return CacheSettings(
        use_cuda_ipc=pool, ipc_pool_mb=mb, ipc_fallback_mb=mb, ipc_recycle_interval_s=0.001
    )


class Bench:
    """The sending side: receivers to talk to, the runs, and their rows."""

    def __init__(
        self,
        kind: str,
        quick: bool,
        device: SimDevice | CudaDevice,
        wires: Sequence[tuple[Connection, Connection]],
        queues: Sequence[Any],
    ) -> None:
        self.kind = kind
        self.quick = quick
        self.device = device
        self.where = "cpu" if kind == "sim" else device.name
        self.inboxes = [inbox for inbox, _ in wires]
        self.outboxes = [outbox for _, outbox in wires]
        self.queues = queues
        self._bases: dict[int, list[torch.Tensor]] = {}

    # talking to the receivers

    def tell(self, command: tuple[Any, ...]) -> None:
        for inbox in self.inboxes:
            inbox.send(command)

    async def replies(self) -> list[tuple[Any, ...]]:
        got = []
        for outbox in self.outboxes:
            await readable(outbox)
            got.append(outbox.recv())
        return got

    async def ask(self, command: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        self.tell(command)
        return await self.replies()

    @contextlib.asynccontextmanager
    async def sender(self, pool: bool) -> AsyncIterator[FeatureSender]:
        """A started FeatureSender that every receiver connected to; drained, left, closed."""
        sender = FeatureSender(
            settings(self.kind, pool),
            device=self.device,
            consumers=len(self.inboxes),
            registry=CollectorRegistry(),
        )
        async with sender:
            await self.ask(("connect", sender.endpoint.to_bytes()))
            yield sender  # after a failure the receivers may be mid-run: main ends them
            await sender.drain(timeout=30)
            await self.ask(("leave",))

    # what the runs send

    def prepare(self, nbytes: int, count: int, batch: int) -> list[list[torch.Tensor] | None]:
        """count features to send, batch per message (distinct tensors: send owns each)."""
        bases = features(nbytes, self.where, self._bases)
        messages: list[list[torch.Tensor] | None] = [
            [bases[i % VARIANTS].clone() for i in range(first, min(count, first + batch))]
            for first in range(0, count, batch)
        ]
        self.device.synchronize()
        return messages

    async def post(
        self, sender: FeatureSender | None, messages: list[list[torch.Tensor] | None], j: int
    ) -> None:
        """Send message j to every receiver, letting go of its tensors."""
        group, messages[j] = messages[j], None
        assert group is not None
        if sender is None:
            item: object = group if len(group) > 1 else group[0]
            for queue in self.queues:
                queue.put(item)
            return
        if len(group) == 1:
            data = (await sender.send(group.pop())).to_bytes()
        else:
            data = (await sender.send_many(group)).to_bytes()
        del group
        for inbox in self.inboxes:
            inbox.send_bytes(data)

    # the measurements

    def count(self, nbytes: int) -> int:
        """Features per run of one size: enough bytes to reach a steady state, a multiple of 16."""
        if self.kind == "cuda":
            per_run = (256 if self.quick else 8192) * MiB
        else:
            per_run = (8 if self.quick else 64) * MiB
        count = max(16 if self.quick else 32, min(10_000, per_run // nbytes))
        return -(-count // max(BATCHES)) * max(BATCHES)

    async def throughput(
        self,
        path: str,
        sender: FeatureSender | None,
        size: str,
        batch: int,
        count: int,
        rate: float | None = None,
    ) -> dict[str, Any]:
        """count features of one size through one path; time until every receiver is done.

        rate: send at most this many features per second (a steady stream), else at once.
        """
        nbytes = SIZES[size]
        messages = self.prepare(nbytes, count, batch)
        await self.ask(("run", path, nbytes, batch, count))  # each answers once it is ready
        before = sender.stats() if sender is not None else None
        started = time.perf_counter()
        for j in range(len(messages)):
            if rate is not None:
                lag = started + j * batch / rate - time.perf_counter()
                if lag > 0:
                    await asyncio.sleep(lag)
            await self.post(sender, messages, j)
        sent = time.perf_counter()
        done = await self.replies()
        seconds = max(d[1] for d in done) - started
        row: dict[str, Any] = {
            "path": path,
            "size": size,
            "batch": batch,
            "features": count,
            "receivers": len(self.inboxes),
            "seconds": seconds,
            "send_seconds": sent - started,
            "features_per_s": count / seconds,
            "gb_per_s": gbps(count * nbytes, seconds),
            "fallbacks": None,
            "pool_full": None,
            "leaked_bytes": None,
            "wrong": sum(d[2] for d in done),
        }
        if sender is not None and before is not None:
            await sender.drain(timeout=30)
            after = sender.stats()
            row["fallbacks"] = after.fallbacks - before.fallbacks
            full = after.fallbacks_by_reason.get("pool_full", 0)
            row["pool_full"] = full - before.fallbacks_by_reason.get("pool_full", 0)
            row["sends"] = after.sends - before.sends
            row["leaked_bytes"] = after.leaked_bytes
        return row

    async def measure(
        self, path: str, sender: FeatureSender | None, size: str, batch: int
    ) -> dict[str, Any]:
        """A warm-up (first touches: mappings, pinning, IPC events), then the timed run."""
        count = self.count(SIZES[size])
        warm = min(1024, max(batch, count // 8 // batch * batch))
        await self.throughput(path, sender, size, batch, warm)
        row = await self.throughput(path, sender, size, batch, count)
        print(
            f"{path:15} {size:>5} x{batch:<2}: {row['features_per_s']:9.0f} features/s "
            f"{row['gb_per_s']:6.2f} GB/s",
            file=sys.stderr,
        )
        return row

    async def latency(self, path: str, sender: FeatureSender | None) -> dict[str, Any]:
        """One 1 MB feature at a time: from just before send to each receiver holding it."""
        warm, pings = (5, 40) if self.quick else (30, 300)
        nbytes = SIZES["1MB"]
        messages = self.prepare(nbytes, warm + pings, 1)
        await self.ask(("ping", path, nbytes, warm + pings))
        held: list[float] = []
        done: list[float] = []
        for i in range(warm + pings):
            started = time.perf_counter()
            await self.post(sender, messages, i)
            stamps = []
            for outbox in self.outboxes:
                await readable(outbox)
                stamps.append(struct.unpack("dd", outbox.recv_bytes()))
            if i >= warm:
                held.append(max(s[0] for s in stamps) - started)
                done.append(max(s[1] for s in stamps) - started)
        await self.replies()
        return {
            "path": path,
            "pings": pings,
            "p50_us": percentile(held, 50) * 1e6,
            "p90_us": percentile(held, 90) * 1e6,
            "gpu_done_p50_us": percentile(done, 50) * 1e6,
            "gpu_done_p90_us": percentile(done, 90) * 1e6,
        }

    async def steady(self, sender: FeatureSender, rate: float) -> dict[str, Any]:
        """1 MB sends paced at rate per second for a while: the share that found the pool full."""
        seconds = 0.5 if self.quick else 2.0
        cap = 40_000 if self.kind == "cuda" else 512  # features made ahead of the stream
        count = max(1, min(cap, round(rate * seconds)))
        row = await self.throughput(RECEIVE, sender, "1MB", 1, count, rate=rate)
        row["rate_per_s"] = rate
        row["pool_full_share"] = row["pool_full"] / max(1, row["sends"])
        return row


async def main(kind: str, receivers: int, quick: bool, out: str | None) -> int:
    ctx = torch_mp.get_context("spawn")
    device = make_device(kind, 0)
    gpus = [0, 1 if kind == "cuda" and torch.cuda.device_count() > 1 else 0][:receivers]
    wires: list[tuple[Connection, Connection]] = []
    queues: list[Any] = []
    processes = []
    for gpu in gpus:
        inbox_r, inbox_w = ctx.Pipe(duplex=False)
        outbox_r, outbox_w = ctx.Pipe(duplex=False)
        widen(inbox_w)
        queue = ctx.Queue()
        processes.append(
            ctx.Process(
                target=receiver_process,
                args=(kind, gpu, inbox_r, outbox_w, queue),
                daemon=True,
            )
        )
        wires.append((inbox_w, outbox_r))
        queues.append(queue)
    for process in processes:
        process.start()
    bench = Bench(kind, quick, device, wires, queues)
    rows: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    steady: dict[str, Any] = {}
    try:
        async with bench.sender(pool=True) as sender:
            for size in SIZES:
                for batch in BATCHES:
                    for path in (RECEIVE, LEASE):
                        rows.append(await bench.measure(path, sender, size, batch))
            for path in (RECEIVE, LEASE):
                latency.append(await bench.latency(path, sender))
            pace = next(
                r for r in rows if (r["path"], r["size"], r["batch"]) == (RECEIVE, "1MB", 1)
            )
            steady = await bench.steady(sender, STEADY_SHARE * pace["features_per_s"])
        async with bench.sender(pool=False) as sender:
            for size in SIZES:
                for batch in BATCHES:
                    rows.append(await bench.measure(FALLBACK, sender, size, batch))
            latency.append(await bench.latency(FALLBACK, sender))
        for size in SIZES:
            for batch in BATCHES:
                rows.append(await bench.measure(TORCH, None, size, batch))
        latency.append(await bench.latency(TORCH, None))
        facts = device.describe()
        bench.tell(("stop",))
        for process in processes:
            process.join(30)
    finally:
        for process in processes:
            if process.is_alive():  # a failed run left it waiting for features
                process.terminate()
        device.close()
    write_json(
        out,
        {
            "device": facts,
            "receivers": gpus,
            "rows": rows,
            "latency": latency,
            "steady": steady,
        },
    )
    report(kind, facts, gpus, rows, latency, steady)
    bad = [r for r in [*rows, steady] if r["wrong"] or r["leaked_bytes"]]
    return 1 if bad else 0


def report(
    kind: str,
    facts: dict[str, Any],
    gpus: list[int],
    rows: list[dict[str, Any]],
    latency: list[dict[str, Any]],
    steady: dict[str, Any],
) -> None:
    """The tables, on stdout."""
    if kind == "cuda":
        where = ", ".join(f"cuda:{g}" for g in gpus)
        print(f"\nIPC transport on {facts.get('gpu')}: sender on cuda:0, receivers on {where}\n")
    else:
        print(f"\nIPC transport on the simulator, {len(gpus)} receiver process(es)\n")
    speed = {(r["path"], r["size"], r["batch"]): r["features_per_s"] for r in rows}

    def ratio(row: dict[str, Any], other: str) -> float | None:
        base = speed.get((other, row["size"], row["batch"]))
        if row["path"] not in (RECEIVE, LEASE) or not base:
            return None
        return float(row["features_per_s"] / base)

    order = {name: i for i, name in enumerate(PATHS)}
    ordered = sorted(
        rows, key=lambda r: (list(SIZES).index(r["size"]), r["batch"], order[r["path"]])
    )
    print(
        markdown_table(
            [
                "path",
                "size",
                "batch",
                "features",
                "features/s",
                "GB/s",
                "vs fallback",
                "vs torch.mp",
                "sends fallen back",
                "leaked bytes",
                "wrong",
            ],
            [
                [
                    r["path"],
                    r["size"],
                    r["batch"],
                    r["features"],
                    r["features_per_s"],
                    r["gb_per_s"],
                    ratio(r, FALLBACK),
                    ratio(r, TORCH),
                    r["fallbacks"],
                    r["leaked_bytes"],
                    r["wrong"],
                ]
                for r in ordered
            ],
        )
    )
    print(f"\nLatency of one 1 MB feature at a time ({latency[0]['pings']} after a warm-up):\n")
    print(
        markdown_table(
            ["path", "held p50 µs", "held p90 µs", "GPU done p50 µs"],
            [
                [
                    r["path"],
                    r["p50_us"],
                    r["p90_us"],
                    r["gpu_done_p50_us"] if r["path"] != LEASE else None,
                ]
                for r in latency
            ],
        )
    )
    share = steady["pool_full_share"]
    verdict = "meets" if share < 0.01 else "misses"
    print(
        f"\nSteady stream: {steady['sends']} sends of 1 MB at {steady['rate_per_s']:.0f}/s "
        f"({STEADY_SHARE:.0%} of pool receive) over {steady['send_seconds']:.2f} s: "
        f"{steady['pool_full']} fell back for a full pool ({share:.2%}); "
        f"{verdict} the < 1 % target"
    )


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

"""Remote tier faults: a server down, paused, killed and restarted, or slow to drain.

Gets miss within remote_timeout_sec, puts succeed locally and never wait on the network,
errors are counted and logged once per burst, the tier reconnects by itself, and no
exception reaches the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "redis", reason="the redis package is not installed: pip install 'mmcache[remote]'"
)

import redis.asyncio
import torch
from conftest import CacheFactory, Rig, assert_exact, put_feature
from redis_server import (
    SERVER_KINDS,
    RedisServer,
    free_port,
    redis_server,
    require_server,
    skip_without_redis,
)


@pytest.fixture(params=SERVER_KINDS)
def own_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server of this test's own, Redis and Valkey, to kill, pause and restart."""
    require_server(request.param)
    with redis_server(kind=request.param) as server:
        yield server


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The server stopped (SIGSTOP): it accepts connections and answers nothing."""
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


async def shared(make_cache: CacheFactory, rig: Rig, url: str, key: str) -> torch.Tensor:
    """Put a feature through one cache and wait for its remote write; a clone of it."""
    writer = make_cache(remote_url=url)
    want = await put_feature(writer, rig, key, 16)
    await writer.drain()
    return want


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_with_no_server_puts_succeed_and_gets_miss_logged_once(
    rig: Rig, make_cache: CacheFactory, caplog: pytest.LogCaptureFixture
) -> None:
    skip_without_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cache = make_cache(gpu_mb=0.25, remote_url=url, remote_timeout_sec=0.2)
    wants = [await put_feature(cache, rig, ("k", i), 64, seed=i) for i in range(8)]
    await cache.drain()
    for i in range(20):  # over a second: several back-offs, each ended by a failed retry
        started = time.perf_counter()
        assert await cache.get(("absent", i)) is None
        assert time.perf_counter() - started < 1.0
        await asyncio.sleep(0.06)
    for i, want in enumerate(wants):
        assert_exact(await cache.get(("k", i), device="cpu"), want)
    s = cache.stats()
    assert s.remote_errors >= 3 and s.remote_hits == 0 and s.leaked_bytes == 0
    assert s.misses == 20
    assert len([m for m in _warnings(caplog) if "remote tier" in m]) == 1  # one burst, one line


async def test_with_the_server_down_a_put_queues_no_write_and_one_probe_asks_after(
    rig: Rig, make_cache: CacheFactory
) -> None:
    skip_without_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cache = make_cache(gpu_mb=1, remote_url=url, remote_timeout_sec=0.2)
    await put_feature(cache, rig, "first", 4)  # its write finds the server down
    await cache.drain()
    before = cache.stats()
    assert before.remote_errors >= 1
    for i in range(50):  # over 100 ms, past the first back-off, with the loop never idle
        await put_feature(cache, rig, ("k", i), 4, seed=i)
        assert cache.stats().remote_queued_bytes == 0  # no write queued, no host copy made
        time.sleep(0.002)  # noqa: ASYNC251 - the loop must stay busy: no other task runs
    await asyncio.sleep(0.3)  # past the first back-off: a put starts the one probe
    await put_feature(cache, rig, "last", 4)
    await cache.drain()
    await asyncio.sleep(0.05)
    after = cache.stats()
    assert after.remote_dropped_writes - before.remote_dropped_writes == 51
    assert 1 <= after.remote_errors - before.remote_errors <= 2  # the probe, not 51 writes


async def test_a_paused_server_makes_gets_miss_within_the_timeout(
    rig: Rig, make_cache: CacheFactory, own_server: RedisServer
) -> None:
    await shared(make_cache, rig, own_server.url, "k")
    writer = make_cache(remote_url=own_server.url)
    reader = make_cache(remote_url=own_server.url, remote_timeout_sec=0.3)
    with paused(own_server):
        started = time.perf_counter()
        assert await reader.get("k") is None
        assert time.perf_counter() - started < 0.3 + 0.5
        put_started = time.perf_counter()
        for i in range(10):
            await put_feature(writer, rig, ("new", i), 16, seed=i)
        assert time.perf_counter() - put_started < 0.3  # puts never wait on the server
    assert reader.stats().remote_errors >= 1


async def test_a_server_killed_and_restarted_misses_then_hits_again(
    rig: Rig, make_cache: CacheFactory, own_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a = make_cache(remote_url=own_server.url, remote_timeout_sec=0.2)
    b = make_cache(remote_url=own_server.url, remote_timeout_sec=0.2)
    want = await put_feature(a, rig, "before", 16)
    await a.drain()
    assert_exact(await b.get("before", device="cpu"), want)

    own_server.stop()  # killed: its values are gone with it (no persistence)
    for i in range(5):
        assert await b.get(("during", i)) is None
        assert await a.put(("during", i), rig.tensor(64, 16, seed=i))
    await a.drain()
    assert b.stats().remote_errors >= 1

    own_server.start()  # the same port, empty
    after = await put_feature(a, rig, "after", 16, seed=7)
    deadline = time.monotonic() + 15
    while True:  # back-off ends, the client reconnects, a re-put reaches the server
        await a.drain()
        got = await b.get("after", device="cpu")
        if got is not None:
            break
        assert time.monotonic() < deadline, "the remote tier did not come back"
        await asyncio.sleep(0.1)
        await put_feature(a, rig, "after", 16, seed=7)  # written again once the tier is back
    assert_exact(got, after)
    assert any("back after" in m for m in _warnings(caplog))
    for cache in (a, b):
        assert cache.stats().leaked_bytes == 0


async def test_writes_past_remote_queue_mb_are_dropped_and_counted(
    rig: Rig, make_cache: CacheFactory, redis_url: str
) -> None:
    cache = make_cache(gpu_mb=4, remote_url=redis_url, remote_queue_mb=0.25)
    limit = 256 * 1024
    for i in range(20):  # puts of resident features do not yield: the queue cannot drain
        await put_feature(cache, rig, ("k", i), 64, seed=i)
        assert cache.stats().remote_queued_bytes <= limit
    s = cache.stats()
    assert s.remote_dropped_writes == 20 - limit // (64 * 1024)
    await cache.drain()
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        stored = sum([await client.exists(cache.remote_key(("k", i))) for i in range(20)])
    finally:
        await client.aclose()
    s = cache.stats()
    assert stored == 20 - s.remote_dropped_writes
    assert s.remote_written_bytes == stored * 64 * 1024 and s.remote_queued_bytes == 0


async def test_close_sends_queued_writes(
    rig: Rig, make_cache: CacheFactory, redis_url: str
) -> None:
    cache = make_cache(gpu_mb=4, remote_url=redis_url)
    for i in range(10):
        await put_feature(cache, rig, ("k", i), 64, seed=i)
    assert cache.stats().remote_queued_bytes > 0
    await cache.close()
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert sum([await client.exists(cache.remote_key(("k", i))) for i in range(10)]) == 10
    finally:
        await client.aclose()


async def test_close_with_writes_queued_and_the_server_paused_ends_in_time(
    rig: Rig, make_cache: CacheFactory, own_server: RedisServer
) -> None:
    cache = make_cache(gpu_mb=4, remote_url=own_server.url, remote_timeout_sec=0.3)
    with paused(own_server):
        for i in range(10):
            await put_feature(cache, rig, ("k", i), 64, seed=i)
        started = time.perf_counter()
        await cache.close()
        assert time.perf_counter() - started < 3
    s = cache.stats()
    assert s.remote_dropped_writes == 10 and s.remote_queued_bytes == 0


def test_every_outage_is_logged_when_it_starts_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from mmcache.remote import faults

    counted: list[str] = []
    tracker = faults.Faults("server", counted.append)
    now = [1000.0]
    tracker._clock = lambda: now[0]
    caplog.set_level(logging.DEBUG, logger="mmcache")
    for _ in range(5):  # five short outages within a minute, each of three failed calls
        for _ in range(3):
            tracker.failed("get", TimeoutError())
        now[0] += 1
        tracker.succeeded()
    warnings = _warnings(caplog)
    assert len(warnings) == 10  # each outage's start and end, none swallowed
    assert all("get failed (TimeoutError: no answer in time)" in m for m in warnings[::2])
    assert all("back after 3 failed operations in 1.0 s" in m for m in warnings[1::2])
    tracker.failed("get", ConnectionError("refused"))
    assert "(ConnectionError: refused)" in _warnings(caplog)[-1]
    assert counted == ["timeout"] * 15 + ["connection"]
    assert tracker.errors["timeout"] == 15 and tracker.total == 16


async def test_calls_failing_in_one_outage_back_off_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The calls in flight when the server goes down all fail: one outage, one back-off at
    its least, however many failed and whenever their errors come; it doubles only when
    the probe after it fails too."""
    from mmcache.remote.calls import ServerCalls
    from mmcache.remote.faults import BACKOFF_MIN_S, Faults

    faults = Faults("server", lambda kind: None)
    now = [1000.0]
    faults._clock = lambda: now[0]
    calls = ServerCalls(faults, 1.0, {})

    async def refused(answered: asyncio.Event) -> None:
        await answered.wait()
        raise ConnectionRefusedError("refused")

    def send(count: int) -> tuple[list[asyncio.Event], list[asyncio.Task[object]]]:
        answers = [asyncio.Event() for _ in range(count)]
        return answers, [asyncio.create_task(calls("get", refused(a))) for a in answers]

    # Eight calls fail at the same moment.
    answers, tasks = send(8)
    await asyncio.sleep(0)
    for answer in answers:
        answer.set()
    await asyncio.gather(*tasks)
    assert not faults.available()
    now[0] += BACKOFF_MIN_S
    assert faults.available()  # the least back-off is over: the probe
    assert not faults.available()  # the others wait for its answer
    faults.succeeded()

    # Four calls sent together fail one by one, each after the least back-off.
    answers, tasks = send(4)
    await asyncio.sleep(0)
    for answer, task in zip(answers, tasks, strict=True):
        now[0] += BACKOFF_MIN_S * 1.2
        answer.set()
        await task
    assert faults.available()  # the first error's back-off is over: the probe
    probe, failing = send(1)
    now[0] += 0.01
    probe[0].set()
    await failing[0]
    now[0] += 2 * BACKOFF_MIN_S - 0.001
    assert not faults.available()  # the probe failed: twice as long
    now[0] += 0.001
    assert faults.available()
    faults.succeeded()
    warnings = [m for m in _warnings(caplog) if "remote tier server" in m]
    assert len(warnings) == 4  # two outages, each logged when it starts and ends
    assert "back after 8 failed operations" in warnings[1]
    assert "back after 5 failed operations" in warnings[3]


async def test_a_get_cancelled_during_a_fetch_leaves_the_fetch_to_land(
    rig: Rig, make_cache: CacheFactory, own_server: RedisServer
) -> None:
    want = await shared(make_cache, rig, own_server.url, "k")
    b = make_cache(remote_url=own_server.url, remote_timeout_sec=5)
    with paused(own_server):
        reader = asyncio.create_task(b.get("k"))
        await asyncio.sleep(0.2)
        assert not reader.done()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
    deadline = time.monotonic() + 5
    while "k" not in b:  # the shared fetch went on without its caller
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert_exact(await b.get("k", device="cpu"), want)
    assert b.stats().remote_hits == 1 and b.stats().leaked_bytes == 0


async def test_close_during_a_fetch_makes_the_waiting_get_miss(
    rig: Rig, make_cache: CacheFactory, own_server: RedisServer
) -> None:
    await shared(make_cache, rig, own_server.url, "k")
    b = make_cache(remote_url=own_server.url, remote_timeout_sec=5)
    with paused(own_server):
        reader = asyncio.create_task(b.get("k"))
        await asyncio.sleep(0.2)
        await b.close()
        assert await reader is None
    assert b.stats().leaked_bytes == 0


def test_errors_are_counted_by_kind() -> None:
    import redis.exceptions as errors

    from mmcache.remote.faults import error_kind

    kinds: dict[str, list[Exception]] = {
        "timeout": [TimeoutError(), errors.TimeoutError()],
        "connection": [
            ConnectionRefusedError(),
            errors.ConnectionError(),
            errors.BusyLoadingError(),
        ],
        "server": [errors.ResponseError("WRONGTYPE"), errors.ReadOnlyError("READONLY")],
        "other": [ValueError()],
    }
    for kind, excs in kinds.items():
        assert [error_kind(e) for e in excs] == [kind] * len(excs)


async def test_a_calls_time_limit_grows_with_the_bytes_it_moves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import Histogram

    from mmcache.remote.calls import Failed, ServerCalls
    from mmcache.remote.faults import Faults

    counted: list[str] = []
    seconds: dict[str, Histogram] = {}
    calls = ServerCalls(Faults("server", counted.append), 0.1, seconds, per_mib_s=0.05)
    mib = 1024 * 1024
    assert calls.timeout() == pytest.approx(0.1)
    assert calls.timeout(40 * mib) == pytest.approx(2.1)
    # 0.3 s to move 8 MiB: within 0.1 + 8 x 0.05 s, a fault for a small value.
    assert await calls("put", asyncio.sleep(0.3, "sent"), 8 * mib) == "sent"
    assert counted == []
    assert isinstance(await calls("put", asyncio.sleep(0.3, "sent"), 1024), Failed)
    assert counted == ["timeout"]
    warning = _warnings(caplog)[-1]
    assert "put failed (TimeoutError: timed out after 0.10 s moving 1024 bytes)" in warning


async def test_a_large_value_moves_within_its_time_limit(
    rig: Rig, make_cache: CacheFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """48 MiB in 0.05 s would need 1 GB/s through redis-py: the limit must scale."""
    a = make_cache(gpu_mb=64, cpu_mb=64, remote_url=redis_url, remote_timeout_sec=0.05)
    want = rig.tensor(48 * 1024, 256, dtype=torch.float32, seed=3)
    expected = want.cpu().clone()
    assert await a.put("large", want)
    del want
    await a.drain()
    s = a.stats()
    assert (s.remote_dropped_writes, s.remote_errors) == (0, 0), _warnings(caplog)
    b = make_cache(gpu_mb=0, cpu_mb=64, remote_url=redis_url, remote_timeout_sec=0.05)
    assert_exact(await b.get("large", device="cpu"), expected)
    assert b.stats().remote_errors == 0


def test_the_demo_fails_when_its_remote_tier_never_answered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mmcache.cli import main

    skip_without_redis()
    small = ["demo", "--device", "sim", "--requests", "6", "--seed", "1", "--hidden", "256"]
    small += ["--gpu-mb", "64", "--cpu-mb", "128", "--images", "20", "--quiet"]
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    assert main([*small, "--remote-url", url]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: the remote tier ({url}) never answered" in out
    assert "PASS" not in out


async def test_a_drain_that_close_overtakes_returns_instead_of_being_cancelled(
    rig: Rig, make_cache: CacheFactory, redis_url: str
) -> None:
    """close() stops the writes its time limit leaves unsent; a drain() waiting for them then
    returns (they are dropped, counted) instead of raising CancelledError in a task that no
    one cancelled."""
    cache = make_cache(gpu_mb=4, remote_url=redis_url, remote_timeout_sec=0.2)
    with rig.hold():  # the writes' host copies do not land: they wait past close's limit
        for i in range(4):
            await put_feature(cache, rig, ("k", i), 16, seed=i)
        drain = asyncio.create_task(cache.drain())
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(cache.close())
        await asyncio.sleep(0.5)
    await closing
    await asyncio.wait([drain], timeout=5)
    assert drain.done() and not drain.cancelled()
    assert drain.result() is None
    s = cache.stats()
    assert (
        s.remote_queued_bytes == 0
        and s.remote_dropped_writes + s.remote_written_bytes // (16 * 1024) == 4
    )

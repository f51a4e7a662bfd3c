"""Handles are plain data, and a receiver serves only what their sender published.

Every altered, forged or stale handle raises InvalidHandleError before a byte is
read, closes whatever it opened, and leaves the receiver usable; a fuzzer
mutates every field of real handles (and their byte form) to show it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import pickle
import random
import secrets
import stat
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import Rig
from ipc_support import Transport, new_receiver, same_bytes, transport

import mmcache
from mmcache.ipc import (
    FeatureHandle,
    FeatureReceiver,
    HandleExpiredError,
    InvalidHandleError,
    SenderEndpoint,
)
from mmcache.ipc.handle import FORMAT_VERSION
from mmcache.ipc.shm import SHM_DIR

#: Mutations the fuzzer tries per run (the issue asks for at least 1,000).
FUZZ_MUTATIONS = 2000


def open_fds() -> Counter[str]:
    """What this process's descriptors are open on, once mappings nothing references are gone."""
    gc.collect()  # a mapping holds a descriptor of its own until it is collected
    targets: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            targets[os.readlink(f"/proc/self/fd/{fd}")] += 1
    return targets


def opened_since(before: Counter[str]) -> Counter[str]:
    """Descriptors open now that were not open at before (threads of earlier tests may
    close theirs meanwhile: only new ones count)."""
    return open_fds() - before


def with_sender(handle: FeatureHandle, **fields: Any) -> FeatureHandle:
    """handle with fields of its sender endpoint replaced."""
    return dataclasses.replace(handle, sender=dataclasses.replace(handle.sender, **fields))


async def refused(receiver: FeatureReceiver, handle: object, match: str | None = None) -> None:
    """receive(handle) and lease(handle) both raise InvalidHandleError."""
    with pytest.raises(InvalidHandleError, match=match):
        await receiver.receive(handle)  # type: ignore[arg-type]
    with pytest.raises(InvalidHandleError, match=match):
        async with receiver.lease(handle):  # type: ignore[arg-type]
            pass


# --- the byte form ----------------------------------------------------------------------------


async def test_a_handle_round_trips_through_its_versioned_bytes(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        want = sim_rig.tensor(5, 7, seed=3)
        handle = await tr.sender.send(want.clone())
        data = handle.to_bytes()
        assert data.startswith(b"MMCH" + bytes([FORMAT_VERSION])) and len(data) < 1024
        copy = FeatureHandle.from_bytes(data)
        assert copy == handle and copy.to_bytes() == data
        assert SenderEndpoint.from_bytes(tr.sender.endpoint.to_bytes()) == tr.sender.endpoint
        # Pickling goes through the same plain fields: the pickle holds no mmcache class.
        assert b"FeatureHandle\n" not in pickle.dumps(handle, protocol=0)
        assert pickle.loads(pickle.dumps(handle)) == handle
        got = await tr.receivers[0].receive(copy)
        assert same_bytes(got, want)


def _bad_forms(data: bytes) -> Iterator[tuple[str, object]]:
    yield "empty", b""
    for cut in range(1, len(data)):  # every truncation
        yield f"truncated to {cut}", data[:cut]
    yield "trailing garbage", data + b"\x00junk"
    yield "wrong magic", b"XMCH" + data[4:]
    for version in (0, FORMAT_VERSION + 1, 255):
        yield f"version {version}", data[:4] + bytes([version]) + data[5:]
    yield "garbage fields", data[:5] + b"\xff\xfe not a handle"
    yield "a JSON list", data[:5] + b"[1, 2, 3]"
    yield "nested a million deep", data[:5] + b"[" * 1_000_000
    yield "not bytes", data.decode("latin-1")
    yield "too long", data + b" " * (1 << 20)
    rng = random.Random(5)
    for i in range(200):
        yield f"random bytes {i}", data[:5] + rng.randbytes(rng.randrange(1, 600))


async def test_from_bytes_refuses_every_malformed_byte_string(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        handle = await tr.sender.send(sim_rig.tensor(4, 4))
        data = handle.to_bytes()
        for what, bad in _bad_forms(data):
            with pytest.raises(InvalidHandleError):
                FeatureHandle.from_bytes(bad)  # type: ignore[arg-type]
                pytest.fail(f"{what} was accepted")
        with pytest.raises(InvalidHandleError, match=f"reads version {FORMAT_VERSION}"):
            FeatureHandle.from_bytes(data[:4] + bytes([FORMAT_VERSION + 1]) + data[5:])
        await tr.receivers[0].receive(handle)  # the real one is still served


def test_invalid_handle_error_is_an_mmcache_error_exported_at_the_top() -> None:
    assert mmcache.InvalidHandleError is InvalidHandleError
    assert issubclass(InvalidHandleError, mmcache.MMCacheError)
    assert issubclass(HandleExpiredError, InvalidHandleError)


# --- forged handles, class by class ----------------------------------------------------------


@contextlib.asynccontextmanager
async def two_sent(rig: Rig, **settings: Any) -> AsyncIterator[tuple[Transport, list[Any]]]:
    """A transport with two features sent and not yet received: (handle, the sent bytes)."""
    async with transport(rig, consumers=1, **settings) as tr:
        sent = []
        for seed in (1, 2):
            want = rig.tensor(32, 48, seed=seed)
            sent.append((await tr.sender.send(want.clone()), want))
        yield tr, sent
        # The genuine handles are still served, exactly, after every refusal.
        for handle, want in sent:
            got = await tr.receivers[0].receive(handle)
            assert same_bytes(got, want)
            del got
        assert await tr.sender.drain(timeout=5)
        assert tr.sender.stats().leaked_bytes == 0


@pytest.mark.parametrize("where", ["pool", "host"])
async def test_a_handle_with_an_altered_slice_is_refused(rig: Rig, where: str) -> None:
    settings = {} if where == "pool" else {"use_cuda_ipc": False}
    async with two_sent(rig, **settings) as (tr, sent):
        (a, _), (b, _) = sent
        assert (a.where, b.where) == (where, where)
        receiver = tr.receivers[0]
        published = "does not match the slice its sender published"
        fds = open_fds()
        await refused(receiver, dataclasses.replace(a, offset=b.offset), published)
        await refused(receiver, dataclasses.replace(a, offset=a.offset + 512), published)
        await refused(receiver, dataclasses.replace(a, offset=-512), "offset")
        await refused(receiver, dataclasses.replace(a, offset=1 << 62), published)
        await refused(receiver, dataclasses.replace(a, offset=1 << 64), "offset")
        await refused(receiver, dataclasses.replace(a, shape=(33, 48)), published)
        await refused(receiver, dataclasses.replace(a, shape=(48, 32)), published)  # same size
        await refused(receiver, dataclasses.replace(a, shape=(1 << 40, 1 << 40)), "larger")
        await refused(receiver, dataclasses.replace(a, shape=(1 << 20, 1 << 20)), published)
        await refused(receiver, dataclasses.replace(a, shape=(-32, -48)), "shape")
        await refused(receiver, dataclasses.replace(a, dtype="float64"), published)
        await refused(receiver, dataclasses.replace(a, dtype="int16"), published)  # same size
        await refused(receiver, dataclasses.replace(a, dtype="Tensor"), "dtype")
        await refused(receiver, dataclasses.replace(a, cuda_event=b"\x01" * 64), published)
        flipped = "host" if where == "pool" else "pool"
        await refused(receiver, dataclasses.replace(a, where=flipped), published)
        await refused(receiver, dataclasses.replace(a, slot=b.slot), "not held")
        await refused(receiver, dataclasses.replace(a, slot=1 << 20), "slot")
        await refused(receiver, dataclasses.replace(a, seq=b.seq), "not held")
        await refused(receiver, dataclasses.replace(a, seq=0), "seq")
        await refused(receiver, "a handle", "FeatureHandle")
        assert not opened_since(fds), "a refused handle left a file descriptor open"


def _write(path: str, data: bytes, mode: int = 0o600) -> str:
    """path, a new file of this user holding data."""
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def _own_file(data: bytes, mode: int = 0o600) -> str:
    fd, path = tempfile.mkstemp()
    os.close(fd)
    return _write(path, data, mode)


@contextlib.contextmanager
def _fake_sender_directory(mode: int) -> Iterator[str]:
    """A directory named like a sender's, holding segments named like its own."""
    path = os.path.join(SHM_DIR, f"mmcache-{os.getpid()}-{secrets.token_hex(16)}")
    os.mkdir(path)
    os.chmod(path, mode)
    try:
        yield path
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


async def test_a_handle_naming_other_memory_is_refused_before_it_is_opened(rig: Rig) -> None:
    secret = _own_file(b"secret bytes of another file " * 100)
    try:
        async with two_sent(rig, use_cuda_ipc=False) as (tr, sent):
            (a, _), _ = sent
            fresh = new_receiver(rig)  # no channel yet: it must check the endpoint itself
            fds = open_fds()
            try:
                for receiver in (tr.receivers[0], fresh):
                    for fallback in (secret, "/etc/passwd", "/dev/zero", a.sender.pool_path):
                        await refused(receiver, with_sender(a, fallback_path=fallback))
                    await refused(receiver, with_sender(a, fallback_nbytes=1 << 40))
                    await refused(receiver, with_sender(a, pid=a.sender.pid + 1))
                    other_kind = "sim" if a.sender.device_kind == "cuda" else "cuda"
                    await refused(receiver, with_sender(a, device_kind=other_kind))
                    await refused(receiver, with_sender(a, cuda_pool=b"\x00" * 64))
                assert not opened_since(fds), "a refused handle left a file descriptor open"
            finally:
                await fresh.close()
    finally:
        os.unlink(secret)


async def test_a_control_path_naming_anything_but_a_senders_block_is_refused(rig: Rig) -> None:
    plain = _own_file(b"\x00" * 4096)
    wide = _own_file(b"\x00" * 4096, mode=0o644)
    scratch = tempfile.mkdtemp()
    fifo = os.path.join(scratch, "fifo")
    link = os.path.join(scratch, "control")
    os.mkfifo(fifo, 0o600)
    try:
        async with two_sent(rig) as (_, sent):
            (a, _), _ = sent
            real = a.sender.control_path
            os.symlink(real, link)
            candidates = [
                plain,
                wide,
                fifo,
                link,
                "/dev/null",
                "/etc/passwd",
                "",
                "relative/control",
                os.path.dirname(real),  # the sender's directory itself
                real + "/",
                os.path.join(os.path.dirname(real), "..", os.path.basename(os.path.dirname(real)))
                + "/control",
                a.sender.pool_path,
                "/proc/self/mem",
            ]
            with _fake_sender_directory(0o755) as shared, _fake_sender_directory(0o700) as own:
                for directory in (shared, own):
                    # The right names in a directory the sender did not make (a world-readable
                    # one, or one that holds a block of the wrong form).
                    candidates.append(_write(os.path.join(directory, "control"), b"\x00" * 4096))
                fresh = new_receiver(rig)
                try:
                    fds = open_fds()
                    for path in candidates:
                        for _ in range(20):  # no descriptor left behind per attempt
                            await refused(fresh, with_sender(a, control_path=path))
                    assert not opened_since(fds), "a refused control path left a descriptor open"
                finally:
                    await fresh.close()
    finally:
        for path in (plain, wide, fifo, link):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.rmdir(scratch)


async def test_a_stale_handle_is_refused_after_its_slot_was_recycled(rig: Rig) -> None:
    async with transport(rig, consumers=1) as tr:
        receiver = tr.receivers[0]
        old = await tr.sender.send(rig.tensor(16, 16, seed=1))
        await receiver.receive(old)
        assert await tr.sender.drain(timeout=5)
        want = rig.tensor(16, 16, seed=2)
        new = await tr.sender.send(want.clone())
        assert new.slot == old.slot and new.seq != old.seq  # the slot's next generation
        await refused(receiver, old, "not held")
        await refused(receiver, dataclasses.replace(new, seq=old.seq), "not held")
        got = await receiver.receive(new)
        assert same_bytes(got, want)


def _assert_private(endpoint: SenderEndpoint) -> str:
    """The sender's directory, once checked to be its own (mode 0700, unguessable)."""
    directory = os.path.dirname(endpoint.control_path)
    info = os.lstat(directory)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert len(os.path.basename(directory).rsplit("-", 1)[1]) == 32  # 128 random bits
    for path in (endpoint.control_path, endpoint.pool_path, endpoint.fallback_path):
        assert os.path.dirname(path) == directory
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    return directory


async def test_the_segments_of_a_sender_are_private(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as tr:
        directory = _assert_private(tr.sender.endpoint)
    assert not any(map(os.path.exists, [directory]))  # close() removed it


async def test_a_new_sender_removes_directories_no_live_sender_holds(sim_rig: Rig) -> None:
    async with transport(sim_rig, consumers=1) as live:
        kept = _assert_private(live.sender.endpoint)
        with _fake_sender_directory(0o700) as making:  # no control block yet: being made
            with _fake_sender_directory(0o700) as abandoned:
                _write(os.path.join(abandoned, "control"), b"\x00" * 64)
                _write(os.path.join(abandoned, "fallback"), b"\x00" * 64)
                async with transport(sim_rig, consumers=1):
                    gone = not any(map(os.path.exists, [abandoned]))
                    assert gone, "the directory of a dead sender was left"
                    assert all(map(os.path.exists, [kept, making]))
                os.mkdir(abandoned)  # for the context manager's own clean-up


# --- the fuzzer ------------------------------------------------------------------------------


def _int_mutations(value: int, others: list[object]) -> list[object]:
    return [
        value + 1,
        value - 1,
        -value,
        0,
        -1,
        value ^ (1 << 9),
        (1 << 31),
        (1 << 63) - 1,
        1 << 63,
        1 << 64,
        True,
        None,
        str(value),
        float(value),
        *others,
    ]


def _text_mutations(value: str, others: list[object]) -> list[object]:
    flipped = value[:-1] + ("0" if value[-1:] != "0" else "1")
    return [
        "",
        value + "x",
        value[:-1],
        flipped,
        value.replace("mmcache", "mmcachf"),
        "/etc/passwd",
        "/dev/zero",
        value + "/../control",
        os.path.dirname(value) + "/fallback",
        os.path.dirname(value) + "/control",
        os.path.dirname(value) + "/pool",
        value + "\0",
        7,
        None,
        b"bytes",
        *others,
    ]


def _field_mutations(name: str, value: object, others: list[object]) -> list[object]:
    if name == "shape":
        assert isinstance(value, tuple)
        head = value[0] if value else 1
        return [
            (),
            (*value, 1),
            (*value, 2),
            value[:-1],
            (head + 1, *value[1:]),
            (head - 1, *value[1:]),
            (-head, *value[1:]),
            (1 << 62, *value[1:]),
            tuple(reversed(value)),
            list(value),
            tuple(float(v) for v in value),
            (True,) * len(value),
            *others,
        ]
    if name == "dtype":
        return ["float64", "float16", "int8", "uint8", "bool", "float", "Tensor", "", 3, *others]
    if name == "where":
        return ["pool", "host", "disk", "", None, *others]
    if name == "device_kind":
        return ["sim", "cuda", "cpu", None, *others]
    if isinstance(value, bytes):
        return [b"", b"\x00" * 64, b"\x01" * 64, value + b"\x00", value[:-1], "00", *others]
    if isinstance(value, str):
        return _text_mutations(value, others)
    assert isinstance(value, int)
    return _int_mutations(value, others)


def _mutations_of(handle: FeatureHandle, peers: list[FeatureHandle], rng: random.Random) -> object:
    """One mutation of handle: a field of it or of its endpoint, or of its byte form."""
    kind = rng.random()
    if kind < 0.25:  # the byte form: flip, drop, insert or truncate bytes, then parse
        data = bytearray(handle.to_bytes())
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            op = rng.randrange(4)
            if op == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[at]
            elif op == 2:
                data.insert(at, rng.randrange(256))
            else:
                del data[at:]
                if not data:
                    break
        return bytes(data)
    peer = rng.choice(peers)
    if kind < 0.5:
        name = rng.choice([f.name for f in dataclasses.fields(SenderEndpoint)])
        value = getattr(handle.sender, name)
        others = [getattr(peer.sender, name)]
        new = rng.choice(_field_mutations(name, value, others))
        return dataclasses.replace(handle, sender=_replaced(handle.sender, name, new))
    name = rng.choice(
        [f.name for f in dataclasses.fields(FeatureHandle) if f.init and f.name != "sender"]
    )
    value = getattr(handle, name)
    new = rng.choice(_field_mutations(name, value, [getattr(peer, name)]))
    return _replaced(handle, name, new)


def _replaced(record: Any, name: str, value: object) -> Any:
    """record with field name set to value, whatever its type (as a forger would)."""
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}
    fields[name] = value
    return type(record)(**fields)


@dataclass
class _Live:
    """A handle sent and not yet received, and the bytes it must serve."""

    handle: FeatureHandle
    want: torch.Tensor


async def test_a_fuzzer_mutating_real_handles_is_never_served_wrong_bytes(rig: Rig) -> None:
    rng = random.Random(20261202)
    async with contextlib.AsyncExitStack() as stack:
        pooled = await stack.enter_async_context(transport(rig, consumers=1, pool_mb=1))
        hosted = await stack.enter_async_context(
            transport(rig, consumers=1, use_cuda_ipc=False, receivers=0)
        )
        receiver = pooled.receivers[0]
        await receiver.connect(hosted.sender.endpoint)
        serial = [0]

        async def send(tr: Transport) -> _Live:
            serial[0] += 1
            shape = rng.choice([(64,), (8, 24), (3, 5, 7), (1, 128)])
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
            want = rig.tensor(*shape, dtype=dtype, seed=serial[0])
            return _Live(await tr.sender.send(want.clone()), want)

        live = [await send(pooled) for _ in range(4)] + [await send(hosted) for _ in range(4)]
        assert {item.handle.where for item in live} == {"pool", "host"}
        # A first genuine receive of each sender maps its memory: counted before, not leaked.
        for i, item in enumerate(live):
            if i in (0, 4):
                assert same_bytes(await receiver.receive(item.handle), item.want)
                live[i] = await send(pooled if i == 0 else hosted)
        fds = open_fds()
        served = refused_count = 0
        for n in range(FUZZ_MUTATIONS):
            i = rng.randrange(len(live))
            item = live[i]
            mutated = _mutations_of(item.handle, [x.handle for x in live], rng)
            try:
                if isinstance(mutated, bytes):
                    mutated = FeatureHandle.from_bytes(mutated)
                if n % 2:
                    got = await asyncio.wait_for(receiver.receive(mutated), 5)  # type: ignore[arg-type]
                else:
                    async with receiver.lease(mutated) as view:  # type: ignore[arg-type]
                        got = view.clone()
            except InvalidHandleError:
                refused_count += 1
                continue
            # Served: only a mutation that changed nothing may be, and only the original bytes.
            assert mutated == item.handle, f"mutation {n} served: {mutated!r:.400}"
            assert same_bytes(got, item.want), f"mutation {n}: wrong bytes served"
            served += 1
            del got
            live[i] = await send(pooled if item.handle.where == "pool" else hosted)
        assert not opened_since(fds), "mutated handles leaked file descriptors"
        assert refused_count >= FUZZ_MUTATIONS * 0.75  # most mutations change something
        # Still usable: every genuine handle is served exactly, and nothing leaked.
        for item in live:
            assert same_bytes(await receiver.receive(item.handle), item.want)
        for tr in (pooled, hosted):
            assert await tr.sender.drain(timeout=5)
            assert tr.sender.stats().leaked_bytes == 0
        assert served + refused_count == FUZZ_MUTATIONS

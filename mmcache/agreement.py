"""Agreement: the ranks of a process group agree on every lookup's hits, one all_reduce a call.

With tensor parallelism every rank keeps its own cache, and those drift apart (an offload
that landed later on one rank, a failed copy, a discard). A rank that hit would skip the
encoder while the others run it, and the encoder's collectives would hang the group. So
each rank first reads its keys locally, holding what it read (the served tensors), then
the ranks take the MIN of their hit masks: a key is served only where every rank hit it.

The mask goes through one all_reduce of a fixed 280 bytes per 256 keys, whatever the call,
so that ranks that disagree on the number of keys get a clear error instead of a collective
of mismatched sizes (gloo aborts the process on one). Its header carries the number of keys
and a digest of them, each beside its complement, so that the MIN shows whether every rank
called with the same keys. A rank that refused a call's arguments (a bad key) sends a header
of zeros instead, so that every rank fails that call and their later calls still pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Final, NoReturn, TypeVar, final

import torch

from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    DeviceOutOfMemoryError,
    GroupError,
    InvalidValueError,
)
from mmcache.metrics import CacheMetrics
from mmcache.remote.codec import encode_key

__all__ = ["KEYS_PER_COLLECTIVE", "Agreement", "Refused", "check_group", "refused"]

log = logging.getLogger("mmcache")

_T = TypeVar("_T")
_R = TypeVar("_R")

#: Keys whose hits one all_reduce agrees on; a call with more takes one collective per 256.
KEYS_PER_COLLECTIVE: Final = 256
#: The header: the key count (4 bytes) and a digest of the keys (8 bytes), each followed by
#: its complement (255 - byte), so that the MIN of both says whether every rank sent the same.
_COUNT: Final = 4
_DIGEST: Final = 8
_HEADER: Final = 2 * (_COUNT + _DIGEST)
_SIZE: Final = _HEADER + KEYS_PER_COLLECTIVE
#: How long past the group's own timeout the loop waits for a collective before it gives up
#: on it (a backend that does not enforce its timeout, or a peer stuck inside NCCL).
_GRACE_S: Final = 5.0

#: The header of a call that a rank refused (its caller's keys or arguments): the count and
#: its complement both 0, which no call of fewer than 2**32 - 1 keys sends, so that the MIN
#: shows every rank that one refused.
_REFUSED: Final = bytes(_HEADER)

#: what the group's thread runs (a collective), the future of its result, and its loop
_Job = tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop] | None


def check_group(group: object) -> torch.distributed.ProcessGroup:
    """group, if it is a torch.distributed ProcessGroup; else InvalidValueError."""
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise InvalidValueError(
        f"group must be a torch.distributed ProcessGroup (dist.new_group(ranks, "
        f"backend='gloo'), or SGLang's get_tp_group().cpu_group), not {type(group).__name__}"
    )


def _timeout_of(group: torch.distributed.ProcessGroup, device: torch.device) -> float:
    """The group's collective timeout in seconds (torch's default where it does not say)."""
    import torch.distributed as dist

    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    if not isinstance(timeout, datetime.timedelta):
        timeout = dist.default_pg_timeout
    return float(timeout.total_seconds())


def _complemented(data: bytes) -> bytes:
    return data + bytes(255 - b for b in data)


def _agreed(field: bytearray | memoryview) -> bool:
    """Whether a header field's MIN equals 255 - the MIN of its complement: every rank's
    bytes were the same."""
    half = len(field) // 2
    return all(field[i] == 255 - field[half + i] for i in range(half))


class Refused(Exception):
    """Raised by a read (see refused): this rank refused the call's arguments; every rank
    fails the call, this one with error, and the ranks' later calls still pair."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def refused(error: Exception) -> Callable[[], Awaitable[list[Any]]]:
    """The read of a call whose arguments this rank refused with error: it takes part in
    the call's collective all the same, and every rank's call fails."""

    async def read() -> list[Any]:
        raise Refused(error)

    return read


@final
class Agreement:
    """One cache's side of its group's agreement: a lookup's hits, agreed by every rank.

    Calls are collectives: every rank makes them with the same keys in the same order.
    They are carried out one at a time, in the order they were made, and a call whose
    caller is cancelled still meets the other ranks (its answer is dropped); close() fails
    the calls not answered yet with CacheClosedError. A collective that fails or outlasts
    the group's timeout raises GroupError, and so does every later call: the ranks no
    longer know which call is which.
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        *,
        cache_name: str,
        device_name: str,
        metrics: CacheMetrics,
    ) -> None:
        import torch.distributed as dist

        check_group(group)
        self._group = group
        self._cache_name = cache_name
        backend = str(dist.get_backend(group)).lower()
        # gloo (also in "cpu:gloo,cuda:nccl") takes the mask on the host; NCCL only on the device.
        self._on = torch.device("cpu")
        if "gloo" not in backend and "nccl" in backend:
            if not device_name.startswith("cuda"):
                raise InvalidValueError(
                    f"an NCCL group agrees through the GPU, and this cache is on {device_name!r}: "
                    "pass a gloo group of the same ranks (SGLang: get_tp_group().cpu_group)"
                )
            self._on = torch.device(device_name)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = _timeout_of(group, self._on)
        self._where = (
            f"cache {cache_name!r}, rank {self.rank} of a {backend} group of {self.size} "
            f"(timeout {self.timeout:g} s)"
        )
        self._series = metrics.group()
        self.misses = 0  # local hits served as misses: another rank missed them
        self._lock = asyncio.Lock()
        self._calls: set[asyncio.Task[Any]] = set()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self._closed = False

    # --- the calls ----------------------------------------------------------------------

    async def agree(
        self,
        call: str,
        keys: Sequence[Hashable],
        read: Callable[[], Awaitable[list[_T | None]]],
    ) -> list[_T | None]:
        """read()'s results for keys, None wherever any rank of the group missed.

        read() looks the keys up in this rank's cache and returns what it would serve (a
        miss: None): what a rank holds stays valid until it is served or dropped, whatever
        the cache does meanwhile. A copy that failed is this rank's miss.
        """
        return await self.agree_then(call, keys, read, _same)

    async def agree_then(
        self,
        call: str,
        keys: Sequence[Hashable],
        read: Callable[[], Awaitable[list[_T]]],
        then: Callable[[list[_T | None]], _R],
    ) -> _R:
        """then(agree's answer), called once the ranks agreed, inside the call's shielded
        part: what then starts (get_or_compute's computation on an agreed miss) starts on
        every rank, whether or not the caller is still there."""
        self._check_usable(call)
        if self.size == 1:  # nobody to meet: the same answers, no collective
            try:
                found = await self._read_here(call, keys, read)
            except Refused as refusal:
                raise refusal.error from None
            return then(found)
        task: asyncio.Task[_R] = asyncio.get_running_loop().create_task(
            self._agree(call, keys, read, then)
        )
        self._calls.add(task)
        task.add_done_callback(self._ended)
        try:
            # Shielded: once made, a call meets the other ranks even if its caller goes away.
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._closed and task.cancelled() and not _cancelling():
                # close() cancelled the call, not its caller: the caller gets an error.
                raise CacheClosedError(
                    f"{self._where}: {call} was not answered: the cache closed while it waited "
                    "for the other ranks"
                ) from None
            raise

    async def refuse(self, call: str, read: Callable[[], Awaitable[list[Any]]]) -> NoReturn:
        """Take part in the call whose arguments this rank refused (read: refused(error),
        after the cache's start where it is not started), then raise error; the other
        ranks' call raises GroupError."""
        await self.agree(call, (), read)
        raise AssertionError("a refused call raises")  # pragma: no cover - agree raised

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._calls.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away does not need it

    async def _agree(
        self,
        call: str,
        keys: Sequence[Hashable],
        read: Callable[[], Awaitable[list[_T]]],
        then: Callable[[list[_T | None]], _R],
    ) -> _R:
        async with self._lock:  # one call at a time, in the order they were made
            self._check_usable(call)
            found: list[_T | None]
            try:
                found = await self._read_here(call, keys, read)
            except Refused as refusal:
                # Every rank fails this call: the others with GroupError, this one with its
                # caller's error; their next calls pair.
                with contextlib.suppress(GroupError):
                    await self._meet(call, (), [], refused=True)
                raise refusal.error from None
            except Exception:
                # The other ranks still get their answer (a miss), then this rank raises.
                await self._meet(call, keys, [False] * len(keys))
                raise
            hits = [value is not None for value in found]
            try:
                agreed = await self._meet(call, keys, hits)
            except BaseException:
                del found  # the error's traceback must not keep what this rank read alive
                raise
            lost = 0
            for i, ok in enumerate(agreed):
                if not ok and hits[i]:
                    found[i] = None  # this rank's hold ends here
                    lost += 1
            if lost:
                self.misses += lost
                self._series.misses.inc(lost)
            return then(found)

    async def _read_here(
        self, call: str, keys: Sequence[Hashable], read: Callable[[], Awaitable[list[_T]]]
    ) -> list[_T | None]:
        """read()'s results; a copy that failed, or no device memory for it, is this rank's
        miss of every key of the call (a group of one answers as a larger one would)."""
        try:
            return [*await read()]
        except (CopyFailedError, DeviceOutOfMemoryError) as exc:
            log.warning(
                "%s: %s of %d key(s) failed here (%s); a miss on every rank",
                self._where,
                call,
                len(keys),
                str(exc),
            )
            return [None] * len(keys)

    async def _meet(
        self, call: str, keys: Sequence[Hashable], hits: list[bool], *, refused: bool = False
    ) -> list[bool]:
        """The MIN over the group of hits, per key; GroupError where the ranks' keys differ
        or a rank refused the call (refused: this one did)."""
        n = len(keys)
        header = (
            _REFUSED
            if refused
            else _complemented(n.to_bytes(_COUNT, "little"))
            + _complemented(hashlib.blake2b(encode_key(tuple(keys)), digest_size=_DIGEST).digest())
        )
        agreed: list[bool] = []
        for start in range(0, max(n, 1), KEYS_PER_COLLECTIVE):
            part = hits[start : start + KEYS_PER_COLLECTIVE]
            buffer = bytearray(_SIZE)
            buffer[:_HEADER] = header
            buffer[_HEADER : _HEADER + len(part)] = bytes(part)
            result = await self._all_reduce(call, buffer)
            if start == 0:
                # Every rank sees the same MIN: all raise here, before any later collective.
                if not any(result[: 2 * _COUNT]):
                    raise GroupError(
                        f"{self._where}: {call} was refused on another rank of the group (a key "
                        "or argument it could not take); every rank must call it with the same "
                        "valid keys and arguments"
                    )
                if not _agreed(result[: 2 * _COUNT]):
                    raise GroupError(
                        f"{self._where}: {call} was called with different numbers of keys on "
                        f"the group's ranks ({n} here); every rank must call it with the same "
                        "keys in the same order"
                    )
                if not _agreed(result[2 * _COUNT : _HEADER]):
                    raise GroupError(
                        f"{self._where}: {call} was called with different keys on the group's "
                        "ranks; every rank must call it with the same keys in the same order"
                    )
            agreed.extend(result[_HEADER + i] == 1 for i in range(len(part)))
        return agreed

    async def _all_reduce(self, call: str, buffer: bytearray) -> bytearray:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bytearray] = loop.create_future()
        started = time.perf_counter()
        self._queue(functools.partial(self._reduce, buffer), done, loop)
        try:
            result = await asyncio.wait_for(asyncio.shield(done), self.timeout + _GRACE_S)
        except TimeoutError:
            raise self._fail(
                call, f"no answer within {self.timeout + _GRACE_S:g} s (a peer is stuck)"
            ) from None
        except Exception as exc:  # the backend's error, raised in the group's thread
            raise self._fail(call, f"{type(exc).__name__}: {exc}") from exc
        self._series.seconds.observe(time.perf_counter() - started)
        return result

    def gather_soon(self, payload: bytes) -> asyncio.Future[list[bytes]]:
        """Every rank's payload, in rank order: one all_gather, queued at once on the group's
        thread, so before any lookup made after this call (a collective: every rank calls
        it, at the same point of its calls). The node's shared host tier agrees on its
        segment so, at start."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[bytes]] = loop.create_future()
        if self.size == 1:
            done.set_result([payload])
            return done
        self._queue(functools.partial(self._gather, payload), done, loop)
        return done

    def _queue(
        self, job: Callable[[], Any], done: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"mmcache-group-{self._cache_name}", daemon=True
            )
            self._thread.start()
        self._jobs.put((job, done, loop))

    def _reduce(self, buffer: bytearray) -> bytearray:
        """The MIN over the group of buffer's bytes, in place (on the group's thread)."""
        import torch.distributed as dist

        mask = torch.frombuffer(buffer, dtype=torch.uint8)  # the buffer's own memory
        if self._on.type == "cpu":
            dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=self._group)
        else:
            on_device = mask.to(self._on)
            dist.all_reduce(on_device, op=dist.ReduceOp.MIN, group=self._group)
            mask.copy_(on_device.cpu())
        return buffer

    def _gather(self, payload: bytes) -> list[bytes]:
        """Every rank's payload (on the group's thread)."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, payload, group=self._group)
        return [bytes(item) for item in gathered]

    def _serve(self) -> None:
        """The group's thread: each collective in the order the calls reached it."""
        unusable: Exception | None = None
        if self._on.type == "cuda":
            # A new thread's current GPU is GPU 0, and torch's object collectives (the node
            # tier's all_gather_object) take the current GPU: on rank 1 of an NCCL group
            # on GPU 1 they would meet rank 0 on GPU 0.
            try:
                torch.cuda.set_device(self._on)
            except Exception as exc:  # each call fails with it, not with a timeout later
                unusable = exc
        while (job := self._jobs.get()) is not None:
            run, done, loop = job
            try:
                outcome: Any = run() if unusable is None else unusable
            except Exception as exc:
                outcome = exc
            try:
                loop.call_soon_threadsafe(_settle, done, outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            del job, run, done, loop, outcome

    # --- failure and close --------------------------------------------------------------

    def _fail(self, call: str, why: str) -> GroupError:
        """Mark the agreement failed for good; the error for the call that found out."""
        if self._failure is None:
            self._failure = f"{call}: {why}"
        return GroupError(
            f"{self._where}: {call} could not agree with the other ranks: {why}. A peer died, "
            "hung or stopped calling; close this cache and build a new group"
        )

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise GroupError(
                f"{self._where}: {call} refused: the group failed earlier ({self._failure}); "
                "close this cache and build a new group"
            )
        if self._closed:
            raise GroupError(f"{self._where}: {call} refused: the cache is closing")

    async def close(self) -> None:
        """Cancel the calls not answered yet and let the thread end (after its collective)."""
        self._closed = True
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        for task in calls:
            with contextlib.suppress(BaseException):  # cancelled or failed: closing either way
                await task
        self._jobs.put(None)


def _cancelling() -> bool:
    """Whether the running task was asked to cancel (its caller's cancel, not close's)."""
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0


def _same(found: _T) -> _T:
    return found


def _settle(done: asyncio.Future[Any], outcome: Any) -> None:
    if done.done():
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)

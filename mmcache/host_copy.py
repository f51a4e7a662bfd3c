"""Copies of host bytes for host reads: a slice per loop turn, on torch's intra-op threads
or by memcpy.

A host read copies a feature out of the pinned arena into a tensor the caller owns. One
core copies well below what memory can deliver; torch's copy_ splits the copy over its
intra-op threads (BENCHMARKS.md, "Host reads to the CPU"). Large reads go a slice at a
time, with the loop's other work running between slices, so none holds the event loop
for long.

torch sizes its thread pool by the machine's cores, not by the cores the process may
run on: in a process kept to fewer cores than torch has threads, every parallel copy
waits for threads spinning at barriers for cores they do not get. Where the process's
CPU affinity or its cgroup's CPU quota gives it fewer cores than torch has threads, and
where torch has fewer than MIN_PARALLEL_THREADS threads, the copy is one memcpy per slice
on the loop's thread. Cores busy with other work are not seen beforehand: a parallel copy
waits for its slowest thread (see the stall guard below). With few threads, one of them
held up by other work slows the copy below a plain memcpy; hence no parallel copies on
so few threads.

torch's threads go to sleep soon after a parallel copy, and waking them costs more than
a memcpy of a few MiB (back to back, awake, they copy far faster than one core). So
copies go by memcpy slices until a burst of them (each starting within BURST_GAP_S of
the last one's end, or while one is in flight) reaches BURST_PARALLEL_FROM_BYTES,
enough to repay the wake; from there on, while the burst lasts, the threads copy,
unless they stall.

Awake threads can still stall: a parallel copy waits for its slowest thread, and a
thread whose core the host gives to other work for a while holds up all of them, for
runs of copies in a row. So a parallel turn slower than one core's memcpy
(STALLED_BELOW_BYTES_PER_S, and STALL_FLOOR_S at least; a turn more than BURST_GAP_S
after the thread's last parallel one may also take WAKE_ALLOWANCE_S to wake the threads)
is a stall: the rest of its copy, and the thread's copies that start in the next
STALL_BACKOFF_S, go by memcpy slices. A stall within one back-off's length of the end of
the last back-off doubles the back-off, up to STALL_BACKOFF_MAX_S; a later one starts
again at STALL_BACKOFF_S.

Not on worker threads of our own: a worker must take the GIL back to report, and a loop
that never goes idle can keep it from the worker for seconds (see mmcache.waiting).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "BURST_GAP_S",
    "BURST_PARALLEL_FROM_BYTES",
    "MAX_THREADS_PER_TURN",
    "MIN_PARALLEL_THREADS",
    "PARALLEL_FROM_BYTES",
    "SLICE_BYTES",
    "STALLED_BELOW_BYTES_PER_S",
    "STALL_BACKOFF_MAX_S",
    "STALL_BACKOFF_S",
    "STALL_FLOOR_S",
    "WAKE_ALLOWANCE_S",
    "cgroup_cpu_quota",
    "copy_host_bytes",
    "copy_host_bytes_in_slices",
    "copy_threads",
    "quota_cores",
    "warm_up",
]

#: Bytes one thread copies between two turns of the event loop: a short hold of the loop.
SLICE_BYTES = 1 << 20
#: At most this many threads' slices per turn: memory bandwidth stops growing with more
#: threads, so more would only hold the loop longer.
MAX_THREADS_PER_TURN = 16
#: Less to copy in one turn is one memcpy: waking torch's threads would cost more.
PARALLEL_FROM_BYTES = 256 << 10
#: Fewer intra-op threads copy by memcpy (see the module's docstring).
MIN_PARALLEL_THREADS = 4

#: Copies this close (the end of one to the start of the next) form a burst, within
#: which torch's threads, once woken, are still awake (module docstring).
BURST_GAP_S = 0.002
#: A burst wakes torch's threads once its copies add up to this: by memcpy slices, this
#: much takes longer than waking the threads (BENCHMARKS.md).
BURST_PARALLEL_FROM_BYTES = 16 << 20
#: A parallel turn slower than this has stalled: about the rate of one core's memcpy as
#: part of a read, which awake threads beat several times over.
STALLED_BELOW_BYTES_PER_S = 4e9
#: ...and took this long at least: shorter holds are a preempted thread's, not a stall.
STALL_FLOOR_S = 0.0005
#: A turn more than BURST_GAP_S after the thread's last parallel one may take this much
#: more: it wakes the threads.
WAKE_ALLOWANCE_S = 0.005
#: After a stall, the thread's copies that start within this go by memcpy; a stall within
#: one back-off's length of the last back-off's end doubles it, up to STALL_BACKOFF_MAX_S.
STALL_BACKOFF_S = 0.25
STALL_BACKOFF_MAX_S = 16.0

_log = logging.getLogger(__name__)
_now: Callable[[], float] = time.perf_counter


class _Recent(threading.local):
    """The calling thread's recent sliced copies: each thread that starts parallel work
    has its own team of torch's threads."""

    copy_ended = -math.inf  # when its last copy ended
    in_flight = 0  # its copies under way (between slices)
    burst_bytes = 0  # the bytes of its current burst's copies, the latest one's included
    parallel_ended = -math.inf  # when its last parallel turn ended
    threads_off_until = -math.inf  # copies starting before then go by memcpy (a stall)
    backoff_s = STALL_BACKOFF_S  # the length of its last back-off


_recent = _Recent()


def _threads_worth_it(nbytes: int) -> bool:
    """Whether a copy of nbytes starting now should use torch's threads; counts it into
    the calling thread's burst."""
    recent, now = _recent, _now()
    if not recent.in_flight and now - recent.copy_ended > BURST_GAP_S:
        recent.burst_bytes = 0  # a new burst
    recent.burst_bytes += nbytes
    return recent.burst_bytes >= BURST_PARALLEL_FROM_BYTES and now >= recent.threads_off_until


def _copy_on_threads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One parallel turn, timed: a stalled one sends the thread's copies to memcpy for a
    while (module docstring)."""
    recent = _recent
    began = _now()
    _parallel_copy(dst, src)
    ended = _now()
    due = max(src.nbytes / STALLED_BELOW_BYTES_PER_S, STALL_FLOOR_S)
    if began - recent.parallel_ended > BURST_GAP_S:
        due += WAKE_ALLOWANCE_S  # the threads may have gone to sleep since
    recent.parallel_ended = ended
    if ended - began <= due:
        return
    if ended - recent.threads_off_until < recent.backoff_s:  # again, soon after the last
        recent.backoff_s = min(2 * recent.backoff_s, STALL_BACKOFF_MAX_S)
    else:
        recent.backoff_s = STALL_BACKOFF_S
    recent.threads_off_until = ended + recent.backoff_s
    _log.info(
        "a parallel host copy of %d bytes took %.1f ms; host copies go by memcpy for %.2f s",
        src.nbytes,
        (ended - began) * 1e3,
        recent.backoff_s,
    )


# ctypes.memmove is a foreign function: a call lets go of the GIL while it copies.
_memmove: Callable[[int, int, int], object] = ctypes.memmove


def _parallel_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)  # torch splits it over its intra-op threads


@functools.cache
def cgroup_cpu_quota() -> float | None:
    """The cores the process's cgroup may use (its CPU quota ÷ period), or None without a
    quota. Read once: containers set it at start."""
    try:
        fields = Path("/sys/fs/cgroup/cpu.max").read_text().split()  # cgroup v2
    except OSError:
        try:  # cgroup v1
            base = Path("/sys/fs/cgroup/cpu")
            fields = [
                (base / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period")
            ]
        except OSError:
            return None
    return quota_cores(fields)


def quota_cores(fields: list[str]) -> float | None:
    """Cores of a CPU quota given as [quota, period] ("max" or -1: none)."""
    try:
        quota, period = int(fields[0]), int(fields[1])
    except (IndexError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def copy_threads() -> int:
    """Threads a host copy may use: torch's intra-op threads, or 1 where they are few or
    the process may run on fewer cores than torch has threads (see the module's docstring)."""
    threads = torch.get_num_threads()
    if threads < MIN_PARALLEL_THREADS:
        return 1
    affinity = getattr(os, "sched_getaffinity", None)
    cores: float = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return threads if threads <= cores else 1


def warm_up() -> None:
    """One parallel copy on the calling thread: OpenMP sets up a thread's team on its
    first parallel region, which a first read would otherwise pay on the loop."""
    if copy_threads() > 1:
        src = torch.zeros(PARALLEL_FROM_BYTES, dtype=torch.uint8)
        _parallel_copy(torch.empty_like(src), src)


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    for tensor, role in ((dst, "destination"), (src, "source")):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"host copy {role} must be a contiguous host tensor")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"host copy of {src.nbytes} bytes into a {dst.nbytes}-byte destination")


def _check_apart(dst: torch.Tensor, src: torch.Tensor) -> None:
    # A copy in slices of overlapping ranges would read bytes it has already overwritten.
    d, s, n = dst.data_ptr(), src.data_ptr(), src.nbytes
    if n and d < s + n and s < d + n:
        raise ValueError("host copy in slices of overlapping source and destination")


def copy_host_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of src into dst, two contiguous host tensors of one size, by one
    memcpy on the calling thread. Bad arguments raise ValueError before a byte moves."""
    _check_pair(dst, src)
    if src.nbytes:
        _memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)


async def copy_host_bytes_in_slices(
    dst: torch.Tensor, src: torch.Tensor, slice_bytes: int = SLICE_BYTES
) -> None:
    """Copy the bytes of src into dst (as copy_host_bytes, but the two must not overlap),
    slice_bytes per copy thread at a time, letting the event loop run its other work
    between slices; by memcpy while torch's threads sleep, unless waking them pays, and
    after a parallel turn of the thread's stalled (module docstring). Cancelled, it stops
    between two slices (dst then holds part of src)."""
    if slice_bytes <= 0:
        raise ValueError(f"slice_bytes must be > 0, not {slice_bytes}")
    _check_pair(dst, src)
    _check_apart(dst, src)
    nbytes = src.nbytes
    if nbytes == 0:
        return
    # Counted into the burst first, always; the cores are looked up only when it pays.
    threads = copy_threads() if _threads_worth_it(nbytes) else 1
    # Flat byte views of dst and src: they stay alive in this frame.
    dst_bytes, src_bytes = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
    recent = _recent
    recent.in_flight += 1
    try:
        start = 0
        while start < nbytes:
            if start:
                await asyncio.sleep(0)
                if threads > 1 and _now() < recent.threads_off_until:
                    threads = 1  # a turn stalled: the rest goes by memcpy
            stop = min(start + slice_bytes * min(threads, MAX_THREADS_PER_TURN), nbytes)
            if threads > 1 and stop - start >= PARALLEL_FROM_BYTES:
                _copy_on_threads(dst_bytes[start:stop], src_bytes[start:stop])
            else:
                _memmove(dst_bytes.data_ptr() + start, src_bytes.data_ptr() + start, stop - start)
            start = stop
    finally:
        recent.in_flight -= 1
        recent.copy_ended = _now()

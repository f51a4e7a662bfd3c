"""Landed offloads: a put short of room uses them before the waiter thread reports them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import CacheFactory, Rig, assert_exact, feature, needs_hold

from mmcache.waiting import FenceWatcher


async def test_a_put_uses_room_whose_offload_landed_but_was_not_reported(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_hold(rig)  # the simulator: its copies finish as soon as settle() returns
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    kept = []
    for i in range(16):  # fills the GPU tier (16 KiB each)
        value = feature(rig, 16, i)
        kept.append(value.clone())
        assert await cache.put(i, value)
        del value
    # From here on the loop hears of no completion until the end of the test.
    late: list[Callable[[], None]] = []
    report = FenceWatcher._completed
    monkeypatch.setattr(FenceWatcher, "_completed", lambda self, fn: late.append(fn))
    # No room now: this put starts offloads for it and gives up without waiting.
    assert await cache.put("first", feature(rig, 16, 100), wait=False) is False
    rig.settle()  # the offloads have landed; nobody has said so
    assert late, "the device reported completions (held back here)"
    # The next put finds the landed room itself, without any report.
    assert await cache.put("second", feature(rig, 16, 101), wait=False) is True
    monkeypatch.setattr(FenceWatcher, "_completed", report)
    assert cache._watcher is not None
    for fn in late:  # the reports arrive after all: handled once, not twice
        report(cache._watcher, fn)
    await cache.drain()
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0 and s.dropped == 0
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)

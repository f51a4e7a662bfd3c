"""A "d2h" CopyPlan into a host tensor: many sources at byte offsets, one fence."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import Rig
from device_copies import copy_d2h_batch, host_arena

from mmcache.errors import InvalidValueError


def host_bytes(rig: Rig, nbytes: int) -> torch.Tensor:
    """A host tensor the batch copies may target (the device's arena kind)."""
    arena = host_arena(rig.device, nbytes)
    arena.fill_(0xAB)
    return arena


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def test_sources_land_at_their_offsets_in_any_order(rig: Rig) -> None:
    shapes = [(16, 256), (16, 256), (3, 5), (16, 256), (9,), (16, 256), (40, 256)]
    srcs = [rig.tensor(*shape, dtype=torch.float32, seed=i) for i, shape in enumerate(shapes)]
    offsets: list[int] = []
    at = 512
    for i, src in enumerate(srcs):
        at += 1024 if i == 3 else 0  # a gap: two runs of back-to-back sources
        offsets.append(at)
        at += src.nbytes
    host = host_bytes(rig, at + 512)
    order = list(range(len(srcs)))
    random.Random(1).shuffle(order)
    fence = copy_d2h_batch(
        rig.device, [srcs[i] for i in order], host, [offsets[i] for i in order], []
    )
    assert fence.wait(30) and fence.exception() is None
    for src, offset in zip(srcs, offsets, strict=True):
        assert torch.equal(host[offset : offset + src.nbytes], as_bytes(src))
    untouched = torch.ones(host.numel(), dtype=torch.bool)
    for src, offset in zip(srcs, offsets, strict=True):
        untouched[offset : offset + src.nbytes] = False
    assert bool((host[untouched] == 0xAB).all()), "bytes outside the ranges were written"


def test_a_batch_runs_after_its_producers(rig: Rig) -> None:
    srcs = [rig.tensor(8, 256, dtype=torch.float32, seed=i) for i in range(4)]
    host = host_bytes(rig, sum(s.nbytes for s in srcs))
    offsets = [i * srcs[0].nbytes for i in range(4)]
    produced = rig.device.record(rig.device.current_stream())
    with rig.hold():
        fence = copy_d2h_batch(rig.device, srcs, host, offsets, [produced])
        if rig.kind == "sim":
            assert not fence.done()
    assert fence.wait(30)
    for src, offset in zip(srcs, offsets, strict=True):
        assert torch.equal(host[offset : offset + src.nbytes], as_bytes(src))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty", "at least one source"),
        ("count", "2 sources but 1 offsets"),
        ("overlap", "overlap at offset"),
        ("negative", "falls outside"),
        ("past_end", "falls outside"),
        ("typed_host", "flat uint8 host tensor"),
    ],
)
def test_bad_batches_are_refused_before_anything_is_queued(
    rig: Rig, case: str, message: str
) -> None:
    a = rig.tensor(4, 256, dtype=torch.float32, seed=1)
    b = rig.tensor(4, 256, dtype=torch.float32, seed=2)
    host = host_bytes(rig, 3 * a.nbytes)
    srcs, offsets, target = [a, b], [0, a.nbytes], host
    if case == "empty":
        srcs, offsets = [], []
    elif case == "count":
        offsets = [0]
    elif case == "overlap":
        offsets = [0, a.nbytes - 4]
    elif case == "negative":
        offsets = [-a.nbytes, a.nbytes]
    elif case == "past_end":
        offsets = [0, 2 * a.nbytes + 8]
    elif case == "typed_host":
        target = host.view(torch.float32)
    with pytest.raises(InvalidValueError, match=message):
        copy_d2h_batch(rig.device, srcs, target, offsets, [])
    rig.settle()
    assert bool((host == 0xAB).all()), "a refused batch wrote host memory"


def test_a_source_on_another_device_is_refused(rig: Rig) -> None:
    if rig.kind == "sim":
        pytest.skip("the simulator's device tensors are CPU tensors")
    host = host_bytes(rig, 4096)
    with pytest.raises(InvalidValueError, match="not cuda"):
        copy_d2h_batch(rig.device, [torch.ones(16)], host, [0], [])

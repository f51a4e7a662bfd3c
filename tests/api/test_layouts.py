"""Tensors that are not dense and strided are refused up front, naming their layout; parts
that lie back to back are found as one run of rows."""

from __future__ import annotations

import asyncio
import gc
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

from mmcache import FeatureCache, InvalidValueError
from mmcache.layouts import check_strided, rows_back_to_back


def _dense(rig: Rig) -> torch.Tensor:
    return rig.tensor(8, 8, dtype=torch.float32, seed=7)


# Each maker builds one kind of tensor on the rig's device; the name its error must say.
LAYOUTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "sparse_coo": (lambda d: d.to_sparse(), "sparse_coo"),
    "sparse_csr": (lambda d: d.to_sparse_csr(), "sparse_csr"),
    "sparse_csc": (lambda d: d.to_sparse_csc(), "sparse_csc"),
    "sparse_bsr": (lambda d: d.to_sparse_bsr((2, 2)), "sparse_bsr"),
    "sparse_bsc": (lambda d: d.to_sparse_bsc((2, 2)), "sparse_bsc"),
    "mkldnn": (lambda d: d.to_mkldnn(), "mkldnn"),
    "nested": (lambda d: torch.nested.nested_tensor([d[:3], d[3:]]), r"nested \(strided\)"),
    "jagged": (
        lambda d: torch.nested.nested_tensor([d[:3], d[3:]], layout=torch.jagged),
        r"nested \(jagged\)",
    ),
}


def make(rig: Rig, layout: str) -> torch.Tensor:
    """A tensor of layout on the rig's device (skips where torch cannot make one there)."""
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if layout == "mkldnn" and (rig.kind != "sim" or not mkldnn):
        pytest.skip("mkldnn tensors live on the CPU (the simulator's device) only")
    with warnings.catch_warnings():  # prototype and beta layouts warn when made
        warnings.simplefilter("ignore")
        try:
            return LAYOUTS[layout][0](_dense(rig))
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"torch cannot make a {layout} tensor on {rig.kind}: {e}")


async def assert_nothing_taken(rig: Rig, cache: FeatureCache, before: int) -> None:
    """Nothing reserved, nothing cached, and the cache still takes a dense tensor."""
    await cache.drain()
    rig.settle()
    s = cache.stats()
    assert (s.gpu_bytes, s.cpu_bytes, s.leaked_bytes, len(cache)) == (0, 0, 0, 0)
    assert rig.allocated_bytes() == before
    assert await cache.put("dense", _dense(rig))
    assert_exact(await cache.get("dense"), _dense(rig))


# Each call is given the bad tensor and a dense one (put_many's other item).
CALLS: dict[str, Callable[[FeatureCache, torch.Tensor, torch.Tensor], Any]] = {
    "put": lambda c, t, d: c.put("k", t),
    "put-nowait": lambda c, t, d: c.put("k", t, wait=False),
    "put_many": lambda c, t, d: c.put_many([("a", d), ("k", t)]),
    "put_many-first": lambda c, t, d: c.put_many([("k", t), ("a", d)]),
    "put_split": lambda c, t, d: c.put_split(["a", "b"], t, [4, 4]),
    "get_or_compute": lambda c, t, d: c.get_or_compute("k", lambda: t),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("gpu_mb", [1, 0], ids=["gpu", "host-only"])
async def test_a_tensor_that_is_not_strided_is_refused_naming_its_layout(
    rig: Rig, make_cache: CacheFactory, layout: str, call: str, gpu_mb: float
) -> None:
    cache = make_cache(gpu_mb=gpu_mb, cpu_mb=1)
    assert await cache.wait_host_ready(5)
    gc.collect()  # garbage of earlier tests, freed by the collection below, is not ours
    rig.settle()
    before = rig.allocated_bytes()
    value = make(rig, layout)
    with pytest.raises(InvalidValueError, match=f"not a {LAYOUTS[layout][1]} one"):
        await CALLS[call](cache, value, rig.tensor(4, 8, dtype=torch.float32))
    dropped = weakref.ref(value)
    del value
    for _ in range(3):  # the shared computation's done callbacks run on the next turns
        await asyncio.sleep(0)
    gc.collect()
    assert dropped() is None, "the refused tensor is still referenced after the call"
    await assert_nothing_taken(rig, cache, before)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_check_strided_passes_dense_tensors_and_other_values(rig: Rig, layout: str) -> None:
    check_strided(_dense(rig), "put()")
    check_strided(_dense(rig).t(), "put()")  # a view is strided: compacted at put, not refused
    check_strided([1, 2], "put()")  # not a tensor: the caller's own check names it
    with pytest.raises(InvalidValueError, match=r"^put\(\) takes dense strided tensors"):
        check_strided(make(rig, layout), "put()")


Part = tuple[int, tuple[int, ...], Hashable]


def test_parts_back_to_back_are_one_run_of_rows_and_anything_else_is_not() -> None:
    row = 4096 * 2  # bytes of a (n, 4096) bfloat16 feature's row
    bf16 = torch.bfloat16
    run: list[Part] = [
        (256, (3, 4096), bf16),
        (256 + 3 * row, (1, 4096), bf16),
        (256 + 4 * row, (0, 4096), bf16),
    ]
    assert rows_back_to_back(run, 2) == [3, 1, 0]
    assert rows_back_to_back([(0, (2, 3), "float32"), (24, (5, 3), "float32")], 4) == [2, 5]
    not_runs: dict[str, list[Part]] = {
        "one part": run[:1],
        "a gap": [run[0], (run[1][0] + 256, (1, 4096), bf16)],
        "out of order": [run[1], run[0]],
        "another dtype": [run[0], (run[1][0], (1, 4096), torch.float16)],
        "another row shape": [run[0], (run[1][0], (2, 2048), bf16)],
        "a 0-dim first part": [(0, (), bf16), (2, (1,), bf16)],
        "a 0-dim later part": [(0, (1,), bf16), (2, (), bf16)],
    }
    for why, parts in not_runs.items():
        assert rows_back_to_back(parts, 2) is None, why

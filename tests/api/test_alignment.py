"""Every host block can be read as its dtype: host_alignment is at least the largest item size."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache, SettingsError
from mmcache.device import SimDevice

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.complex64,
    torch.complex128,
]
LARGEST_ITEM = max(d.itemsize for d in DTYPES)


def feature(dtype: torch.dtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random bytes of rows x cols items of dtype (bools are 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, cols), generator=g).to(torch.bool)
    raw = torch.randint(0, 256, (rows * cols * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).view(rows, cols)


def same_bytes(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape))
    a = got.cpu().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, want.contiguous().reshape(-1).view(torch.uint8))


Spec = tuple[torch.dtype, int, int]


async def round_trip(alignment: int, specs: list[Spec], how: str) -> None:
    """Put specs' features so that they land in the host tier; read each back three ways."""
    device = SimDevice()
    # GPU tier off ("put", "put_many"), or one so small that every feature is offloaded.
    gpu_mb = 0 if how != "evicted" else 2 / 1024  # 2 KiB: above the largest feature drawn
    s = CacheSettings(
        gpu_cache_mb=gpu_mb,
        cpu_cache_mb=1,
        host_alignment=alignment,
        promote_on_hit=False,
        evict_ahead=0,
    )
    want = {i: feature(dtype, r, c, seed=i) for i, (dtype, r, c) in enumerate(specs)}
    try:
        async with FeatureCache(s, device, registry=CollectorRegistry()) as cache:
            assert await cache.wait_host_ready(5)
            if how == "put_many":
                assert await cache.put_many([(i, t.clone()) for i, t in want.items()])
            else:
                for i, t in want.items():
                    assert await cache.put(i, t.clone())
            await cache.drain()
            for i, t in want.items():
                if i not in cache:  # dropped to make room (evicted path): a miss, never junk
                    continue
                async with cache.borrow(i) as held:
                    same_bytes(held, t)
                same_bytes(await cache.get(i, device="cpu"), t)
                same_bytes(await cache.get(i), t)
                same_bytes(await cache.get(i, rows=slice(0, 1)), t[0:1])
            assert cache.stats().leaked_bytes == 0
    finally:
        device.close()


@pytest.mark.parametrize("alignment", [1, 2, 4, 8])
def test_alignments_below_the_largest_item_size_are_refused(
    alignment: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        SettingsError, match=rf"host_alignment={alignment} is invalid: must be >= 16"
    ):
        CacheSettings(host_alignment=alignment)
    monkeypatch.setenv("MMCACHE_HOST_ALIGNMENT", str(alignment))
    with pytest.raises(SettingsError, match=rf"MMCACHE_HOST_ALIGNMENT='{alignment}' is invalid"):
        CacheSettings()


def test_the_smallest_alignment_covers_every_dtype() -> None:
    assert CacheSettings(host_alignment=LARGEST_ITEM).host_alignment == LARGEST_ITEM
    assert max(d.itemsize for d in (torch.complex128, torch.float64)) <= LARGEST_ITEM


@pytest.mark.parametrize("how", ["put", "put_many", "evicted"])
async def test_an_odd_sized_feature_then_wide_ones_read_back_exactly(how: str) -> None:
    # The case: 3 bytes, then float64 and complex128 right after it.
    specs: list[Spec] = [
        (torch.uint8, 1, 3),
        (torch.float64, 2, 3),
        (torch.uint8, 1, 5),
        (torch.complex128, 3, 1),
        (torch.bool, 1, 7),
        (torch.float16, 1, 3),
        (torch.int64, 1, 1),
    ]
    await round_trip(LARGEST_ITEM, specs, how)


@settings(max_examples=40, deadline=None)
@given(
    alignment=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 512]),
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.integers(1, 3), st.integers(1, 37)),
        min_size=1,
        max_size=12,
    ),
    how=st.sampled_from(["put", "put_many", "evicted"]),
)
def test_every_feature_cached_with_any_alignment_is_readable_or_the_setting_is_refused(
    alignment: int, specs: list[Spec], how: str
) -> None:
    try:
        CacheSettings(host_alignment=alignment)
    except SettingsError:
        return  # refused up front: nothing can be cached unreadable
    asyncio.run(round_trip(alignment, specs, how))

"""A scheduler loop that caches image features and reads them back in chunked prefill.

    .venv/bin/python examples/async_scheduler.py [--device sim|cuda] [--requests N]

Each request shows a few images. Admission fetches each image's feature, running
the encoder only on a miss (concurrent requests for one image share a single
encoder call). Prefill then walks the prompt in token chunks and reads only the
feature rows that each chunk covers. Every read is checked against the encoder's
output; the exit status is 0 when all of them match.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import sys

import torch

from mmcache import CacheSettings, FeatureCache, MMCacheError
from mmcache.device import SimDevice

HIDDEN = 3584  # Qwen2-VL-7B
TOKENS_PER_IMAGE = 1000  # a 1120x700 image, one token per 28x28 pixels
CHUNK_TOKENS = 1536


def encoder_output(image_id: int, device: str) -> torch.Tensor:
    """What the vision encoder produces for an image: deterministic, so reads can be checked."""
    generator = torch.Generator().manual_seed(image_id)
    feature = torch.randn(TOKENS_PER_IMAGE, HIDDEN, generator=generator)
    return feature.to(device=device, dtype=torch.bfloat16)


@functools.cache
def expected(image_id: int, device: str) -> torch.Tensor:
    """The encoder's output for an image, kept aside to check what the cache returns."""
    return encoder_output(image_id, device)


async def serve(cache: FeatureCache, device: str, images: list[int]) -> int:
    """Admit and prefill one request; return how many of its reads were wrong."""

    async def encode(image_id: int) -> torch.Tensor:
        await asyncio.sleep(0.005)  # the encoder's forward pass
        return encoder_output(image_id, device)

    wrong = 0

    def check(image_id: int, got: torch.Tensor, a: int, b: int) -> None:
        nonlocal wrong
        if not torch.equal(got, expected(image_id, device)[a:b]):
            print(f"mismatch: image/{image_id} rows {a}:{b}", file=sys.stderr)
            wrong += 1

    # Admission: every feature is cached (or computed) before prefill starts.
    for image_id in images:
        got = await cache.get_or_compute(f"image/{image_id}", functools.partial(encode, image_id))
        check(image_id, got, 0, TOKENS_PER_IMAGE)

    # Chunked prefill: a chunk covers token positions [start, stop) of the prompt.
    layout = [(n * (TOKENS_PER_IMAGE + 32), image_id) for n, image_id in enumerate(images)]
    total = len(images) * (TOKENS_PER_IMAGE + 32)
    for start in range(0, total, CHUNK_TOKENS):
        stop = start + CHUNK_TOKENS
        for offset, image_id in layout:
            a, b = max(start, offset) - offset, min(stop, offset + TOKENS_PER_IMAGE) - offset
            if a >= b:
                continue
            key = f"image/{image_id}"
            rows = await cache.get(key, rows=slice(a, b))
            if rows is None:  # evicted from both tiers since admission: encode again
                compute = functools.partial(encode, image_id)
                rows = await cache.get_or_compute(key, compute, rows=slice(a, b))
            check(image_id, rows, a, b)
        await asyncio.sleep(0)  # the model's forward pass over this chunk would go here
    return wrong


async def main(device_name: str, requests: int, concurrency: int) -> int:
    """Serve requests with a few workers over one cache; return the exit status."""
    device = SimDevice() if device_name == "sim" else device_name
    tensor_device = "cpu" if device_name == "sim" else device_name
    # Small tiers, so that features are offloaded to the host tier and read back from it.
    settings = CacheSettings(gpu_cache_mb=48, cpu_cache_mb=96)
    rng = random.Random(0)
    # Popular images recur across requests (weights 1, 1/2, 1/3, ...).
    catalogue = list(range(40))
    weights = [1 / (rank + 1) for rank in catalogue]
    queue = [rng.choices(catalogue, weights, k=rng.randint(1, 4)) for _ in range(requests)]
    wrong = 0

    async def worker() -> None:
        nonlocal wrong
        while queue:
            wrong += await serve(cache, tensor_device, list(dict.fromkeys(queue.pop())))

    async with FeatureCache(settings, device, name="example") as cache:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await cache.drain()
        stats = cache.stats()
    if isinstance(device, SimDevice):
        device.close()
    print(
        f"{requests} requests: hit ratio {stats.hit_ratio:.0%}, "
        f"{stats.d2h_bytes / 1e6:.0f} MB offloaded, {stats.h2d_bytes / 1e6:.0f} MB uploaded, "
        f"{wrong} wrong reads, {stats.leaked_bytes} bytes leaked"
    )
    return 0 if wrong == 0 and stats.leaked_bytes == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.device, args.requests, args.concurrency)))
    except MMCacheError as e:  # a bad setting, no GPU for --device cuda: say so, no traceback
        sys.exit(f"error: {e}")

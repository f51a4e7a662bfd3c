"""A vision encoder that runs once per request batch and caches each image's rows by key.

    .venv/bin/python examples/batch_encoder.py [--device sim|cuda] [--requests N]

Serving engines encode a request's uncached images in one forward pass: the output is
one tensor whose rows are the images' tokens, one image after another. `put_split`
caches that tensor as it is, under one key per image, with no copy and no tensor per
image; each image is then read on its own (whole, or the rows a prefill chunk needs).
Every read is checked against the encoder's output; the exit status is 0 when all of
them match and nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import torch

from mmcache import CacheSettings, FeatureCache, MMCacheError
from mmcache.device import SimDevice

HIDDEN = 1280


def tokens(image_id: int) -> int:
    """Images differ in size, so in token count (64 to 1,024 tokens)."""
    return 64 * (1 + image_id % 16)


def image_rows(image_id: int) -> torch.Tensor:
    """The encoder's rows for one image: deterministic, so reads can be checked."""
    generator = torch.Generator().manual_seed(image_id)
    return torch.randn(tokens(image_id), HIDDEN, generator=generator).to(torch.bfloat16)


async def encode_batch(image_ids: list[int], device: str) -> torch.Tensor:
    """One forward pass over several images: their rows back to back in one tensor."""
    await asyncio.sleep(0.002)  # the encoder's work
    return torch.cat([image_rows(i) for i in image_ids]).to(device)


async def serve(cache: FeatureCache, device: str, images: list[int]) -> tuple[int, int]:
    """Encode the request's uncached images in one batch, then read every image back.

    Returns the wrong reads and the images encoded.
    """
    missing = [i for i in images if f"image/{i}" not in cache]
    encoded = len(missing)
    if missing:
        batch = await encode_batch(missing, device)
        keys = [f"image/{i}" for i in missing]
        await cache.put_split(keys, batch, [tokens(i) for i in missing])
        del batch  # the cache owns it now
    wrong = 0
    for image_id in images:
        key = f"image/{image_id}"
        half = tokens(image_id) // 2
        got = await cache.get(key, rows=slice(half, None))  # a later prefill chunk's rows
        if got is None:  # evicted from both tiers meanwhile: encode it again, alone
            encoded += 1
            await cache.put_split([key], await encode_batch([image_id], device), [tokens(image_id)])
            got = await cache.get(key, rows=slice(half, None))
        want = image_rows(image_id)[half:]
        if got is None or not torch.equal(got.cpu(), want):
            print(f"mismatch: {key}", file=sys.stderr)
            wrong += 1
    return wrong, encoded


async def main(device_name: str, requests: int) -> int:
    device = SimDevice() if device_name == "sim" else device_name
    tensor_device = "cpu" if device_name == "sim" else device_name
    # Small tiers, so that batches are offloaded to the host tier and read back from it.
    settings = CacheSettings(gpu_cache_mb=16, cpu_cache_mb=48)
    rng = random.Random(0)
    catalogue = list(range(64))
    weights = [1 / (rank + 1) for rank in catalogue]  # popular images recur
    wrong = encoded = reads = 0
    async with FeatureCache(settings, device, name="batch-encoder") as cache:
        for _ in range(requests):
            images = list(dict.fromkeys(rng.choices(catalogue, weights, k=rng.randint(2, 8))))
            bad, new = await serve(cache, tensor_device, images)
            wrong, encoded, reads = wrong + bad, encoded + new, reads + len(images)
        await cache.drain()
        stats = cache.stats()
    if isinstance(device, SimDevice):
        device.close()
    print(
        f"{requests} requests: {reads} image reads, {encoded} images encoded, "
        f"{stats.d2h_bytes / 1e6:.0f} MB offloaded, {stats.h2d_bytes / 1e6:.0f} MB uploaded, "
        f"{wrong} wrong reads, {stats.leaked_bytes} bytes leaked"
    )
    return 0 if wrong == 0 and stats.leaked_bytes == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    try:
        sys.exit(asyncio.run(main(args.device, args.requests)))
    except MMCacheError as e:  # a bad setting, no GPU for --device cuda: say so, no traceback
        sys.exit(f"error: {e}")

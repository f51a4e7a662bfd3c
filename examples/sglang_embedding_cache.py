"""mmcache as SGLang's multimodal embedding cache, called as SGLang's scheduler calls it.

    .venv/bin/python examples/sglang_embedding_cache.py [--device sim|cuda] [--requests N]

In a real deployment, launch SGLang through mmcache's launcher, which takes
`python -m sglang.launch_server`'s arguments and installs the adapter in every SGLang
process, the scheduler processes SGLang spawns included:

    .venv/bin/python -m mmcache.integrations.sglang --model-path MODEL [--tp-size N ...]

or make one call at the top level of a script of your own that launches SGLang (SGLang's
scheduler processes import that script too):

    from mmcache.integrations.sglang import install
    install()  # SGLang now builds MMCacheMultimodalCache instead of MultiModalStaticCache

This script runs without a model: it builds the adapter as install() makes SGLang do
(`init_mm_embedding_cache(SGLANG_VLM_CACHE_SIZE_MB * 2**20)`) and replays SGLang's
per-image calls (get_single, then encode and set on a miss) for requests that revisit
earlier images. The GPU budget holds a few images; the pinned host tier the rest, so the
revisits hit where SGLang's own cache would have encoded them again. Every hit is
checked against the encoder's output; the exit status is 0 when all of them match.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from mmcache import CacheSettings, MMCacheError

HIDDEN = 1280
MiB = 1 << 20


def encode(image: int, device: str) -> torch.Tensor:
    """A stand-in vision encoder: the same rows whenever the same image comes back."""
    gen = torch.Generator().manual_seed(image)
    rows = torch.randn(256, HIDDEN, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    return rows.to("cpu" if device == "sim" else device)


def main(device: str, requests: int) -> int:
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

    from mmcache.integrations.sglang import MMCacheMultimodalCache

    rng = random.Random(0)
    settings = CacheSettings(cpu_cache_mb=64)
    encoded = hits = 0
    # 2 MiB: four 640 KB images on the GPU, as SGLANG_VLM_CACHE_SIZE_MB=2 would give.
    with MMCacheMultimodalCache(2 * MiB, settings=settings, device=device) as cache:
        for _ in range(requests):
            for image in rng.sample(range(24), 3):  # a request's images, some seen before
                cached = cache.get_single(image)
                if cached is None:
                    encoded += 1
                    cache.set(image, EmbeddingResult(embedding=encode(image, device)))
                    continue
                hits += 1
                if not torch.equal(cached.embedding.cpu(), encode(image, "sim")):
                    print(f"image {image}: the cached embedding differs", file=sys.stderr)
                    return 1
        stats = cache.feature_cache.stats()
    print(
        f"{requests} requests: {hits} hits ({stats.hits_gpu} on the GPU, {stats.hits_cpu} "
        f"from pinned host memory), {encoded} images encoded"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "error: CUDA is not available (no GPU, or a CPU-only torch build); use --device sim"
        )
    try:
        sys.exit(main(args.device, args.requests))
    except ImportError as e:
        sys.exit(f"error: {e}; bash scripts/install_integrations.sh installs sglang 0.5.23")
    except MMCacheError as e:
        sys.exit(f"error: {e}")

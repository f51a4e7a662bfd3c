"""Two serving nodes share image features through Redis: one encodes, the other reuses.

    redis-server --port 6379 --save '' &          # or any Redis/Valkey you can reach
    .venv/bin/python examples/two_nodes.py --remote-url redis://127.0.0.1:6379/0

Each node is a process of its own with its own FeatureCache, as two replicas of a
serving engine would be; what they share is only the remote tier (remote_url). Node 1
encodes a batch of images and puts their features (written to the server in the
background; drain() waits for the writes). Node 2 then serves requests for the same
images with get_or_compute: every feature comes from the remote tier, nothing is
encoded again, and each one is checked against the encoder's output. Keys are content
keys (mmcache.keys.feature_key), the same on every node. Without --remote-url it starts
a redis-server of its own on a free loopback port, if one is installed. The exit
status is 0 when node 2 read every feature from node 1, bit-exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import subprocess
import sys

import torch

from mmcache import CacheSettings, FeatureCache, MMCacheError
from mmcache.device import resolve_device
from mmcache.keys import feature_key
from mmcache.remote.local_server import local_redis_server
from mmcache.settings import redact_url

HIDDEN = 1024
MODEL = "example/vlm-7b"


def image_bytes(image_id: int) -> bytes:
    """An image file's bytes, as the request carries them."""
    return f"image-{image_id}".encode() * 64


def encoder_output(image_id: int, device: str) -> torch.Tensor:
    """The encoder's feature of an image: deterministic, so node 2 can check what it reads."""
    generator = torch.Generator().manual_seed(image_id)
    tokens = 64 + image_id % 8 * 64
    return torch.randn(tokens, HIDDEN, generator=generator).to(device, torch.bfloat16)


async def node(role: str, device_kind: str, url: str, images: int) -> int:
    """Run one node: "encode" puts every image's feature, "serve" reads them all back."""
    settings = CacheSettings(gpu_cache_mb=256, cpu_cache_mb=256, remote_url=url)
    keys = [feature_key(image_bytes(i), model=MODEL, revision="1") for i in range(images)]
    async with FeatureCache(settings, device_kind, name=f"node-{role}") as cache:
        await cache.wait_host_ready()  # remote hits land in the host tier
        where = "cpu" if device_kind == "sim" else cache.device.name
        encoded = 0

        async def encode(image_id: int) -> torch.Tensor:
            nonlocal encoded
            encoded += 1
            await asyncio.sleep(0.01)  # the vision encoder's forward pass
            return encoder_output(image_id, where)

        if role == "encode":
            for i, key in enumerate(keys):
                await cache.put(key, await encode(i))
            await cache.drain()  # the remote writes too
            s = cache.stats()
            print(
                f"node 1: encoded {encoded} images, wrote {s.remote_written_bytes} bytes "
                f"to the remote tier ({s.remote_dropped_writes} writes dropped)"
            )
            return 0 if s.remote_dropped_writes == 0 and s.remote_errors == 0 else 1
        exact = 0
        for i, key in enumerate(keys):
            got = await cache.get_or_compute(key, functools.partial(encode, i), device="cpu")
            exact += torch.equal(got, encoder_output(i, "cpu"))
        s = cache.stats()
        print(
            f"node 2: {exact} of {images} features exact, {s.remote_hits} from the remote "
            f"tier ({s.remote_read_bytes} bytes), {encoded} encoded again"
        )
        return 0 if exact == images and s.remote_hits == images and encoded == 0 else 1


def run_node(role: str, device: str, url: str, images: int) -> int:
    """Start one node as a process of its own and wait for it."""
    command = [sys.executable, __file__, "--role", role, "--device", device]
    command += ["--remote-url", url, "--images", str(images)]
    return subprocess.run(command, check=False, timeout=300).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--remote-url", default=None, help="Redis/Valkey URL (default: own)")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--role", choices=("encode", "serve"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        return asyncio.run(node(args.role, args.device, args.remote_url, args.images))
    if args.device == "cuda":
        resolve_device("cuda").close()  # no GPU: say so before starting anything
    with contextlib.ExitStack() as stack:
        url = args.remote_url or stack.enter_context(local_redis_server())
        print(f"remote tier: {redact_url(url)}")
        for role in ("encode", "serve"):
            status = run_node(role, args.device, url, args.images)
            if status != 0:
                print(f"node {role} failed (exit status {status})", file=sys.stderr)
                return status
    print("PASS: node 2 served every feature node 1 encoded, without encoding it again")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MMCacheError as e:  # a bad setting, no GPU, no server: say so, no traceback
        sys.exit(f"error: {e}")

"""mmcache as vLLM's encoder-cache (EC) connector: one instance encodes, another reuses.

    .venv/bin/python examples/vllm_ec_connector.py [--device sim|cuda] [--remote-url URL]

In a real deployment the connector is one flag of `vllm serve` on every instance (the
encoding ones as ec_producer, the serving ones as ec_consumer, or ec_both):

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "MMCacheECConnector",
      "ec_connector_module_path": "mmcache.integrations.vllm", "ec_role": "ec_both",
      "ec_connector_extra_config": {"remote_url": "redis://HOST:6379"}}'

This script runs without a model. It builds the connectors through vLLM's own
ECConnectorFactory from that config and drives them as vLLM 0.33.0 does: the producer's
worker saves each image's encoder output (save_caches); the consumer's scheduler asks
which outputs exist (has_cache_item), allocates them (update_state_after_alloc) and
builds the step's metadata; the consumer's worker loads them into its encoder cache
(start_load_caches). Without --remote-url it starts a redis-server of its own. The exit
status is 0 when every output came back bit-exact and the unknown image was encoded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from typing import Any

import torch

from mmcache import MMCacheError
from mmcache.device import resolve_device
from mmcache.remote.local_server import local_redis_server
from mmcache.settings import redact_url

HIDDEN = 1280
IMAGES = 6


def encoder_output(image: int, device: str) -> torch.Tensor:
    """A stand-in vision encoder: the same rows whenever the same image comes back."""
    gen = torch.Generator().manual_seed(image)
    rows = torch.randn(64 + 32 * image, HIDDEN, generator=gen).to(torch.bfloat16)
    return rows.to("cpu" if device == "sim" else device)


def launch_config(role: str, url: str, device: str) -> dict[str, Any]:
    """What --ec-transfer-config holds on one instance."""
    return {
        "ec_connector": "MMCacheECConnector",
        "ec_connector_module_path": "mmcache.integrations.vllm",
        "ec_role": role,
        "ec_connector_extra_config": {"remote_url": url, "device": device, "gpu_cache_mb": 64},
    }


def main(device: str, remote_url: str | None) -> int:
    if device == "cuda":
        resolve_device("cuda").close()  # no GPU: say so before starting anything
    try:
        from vllm.config import ECTransferConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.core.sched.output import SchedulerOutput
    except ImportError as exc:
        raise MMCacheError(
            f"vllm 0.33.0 is not installed ({exc}): bash scripts/install_vllm.sh"
        ) from None

    def connector(role: str, side: ECConnectorRole, url: str) -> Any:
        config = launch_config(role, url, device)
        print(f"--ec-transfer-config '{json.dumps(config)}'  ({side.name.lower()} side)")
        # The two parts of vLLM's VllmConfig the connector reads.
        vllm_config: Any = types.SimpleNamespace(
            ec_transfer_config=ECTransferConfig(**config),
            model_config=types.SimpleNamespace(model="example/vlm-7b"),
        )
        return ECConnectorFactory.create_connector(vllm_config, side)

    with contextlib.ExitStack() as stack:
        url = remote_url or stack.enter_context(local_redis_server())
        print(f"remote tier: {redact_url(url)}")
        producer = connector("ec_producer", ECConnectorRole.WORKER, url)
        stack.callback(producer.shutdown)
        scheduler = connector("ec_consumer", ECConnectorRole.SCHEDULER, url)
        stack.callback(scheduler.shutdown)
        consumer = connector("ec_consumer", ECConnectorRole.WORKER, url)
        stack.callback(consumer.shutdown)

        # Instance 1 encodes every image; vLLM's model runner saves each output.
        produced = {f"image-{i}": encoder_output(i, device) for i in range(IMAGES)}
        for mm_hash in produced:
            producer.save_caches(produced, mm_hash)
        producer.flush(30)  # the remote writes are in the background; wait for them here

        # Instance 2 gets a request with those images and one it has never seen.
        hashes = [*produced, "image-new"]
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=h,
                mm_position=PlaceholderRange(offset=600 * i, length=64),
            )
            for i, h in enumerate(hashes)
        ]
        request = types.SimpleNamespace(request_id="req-0", mm_features=features)
        scheduler.ensure_cache_available(request, 0)  # one batched lookup for the request
        to_encode = []
        for index, mm_hash in enumerate(hashes):
            if scheduler.has_cache_item(mm_hash):
                scheduler.update_state_after_alloc(request, index)
            else:
                to_encode.append(mm_hash)
        metadata = scheduler.build_connector_meta(SchedulerOutput.make_empty())

        encoder_cache: dict[str, torch.Tensor] = {}
        consumer.bind_connector_metadata(metadata)
        consumer.start_load_caches(encoder_cache)  # on the device, on the current stream
        consumer.clear_connector_metadata()
        exact = all(torch.equal(encoder_cache[h].cpu(), produced[h].cpu()) for h in produced)
        print(f"loaded {len(encoder_cache)} outputs from instance 1, bit-exact: {exact}")
        print(f"encoded on instance 2: {to_encode}")
        print(f"scheduler stats: {scheduler.get_ec_connector_stats()}")
        if not exact or sorted(encoder_cache) != sorted(produced) or to_encode != ["image-new"]:
            print("FAIL", file=sys.stderr)
            return 1
    print("PASS: instance 2 reused every encoder output instance 1 computed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--remote-url", default=None, help="Redis/Valkey URL (default: own)")
    args = parser.parse_args()
    try:
        sys.exit(main(args.device, args.remote_url))
    except MMCacheError as e:  # no GPU, no vLLM, no server: say so, no traceback
        sys.exit(f"error: {e}")

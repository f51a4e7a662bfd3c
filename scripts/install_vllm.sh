#!/usr/bin/env bash
# Install vLLM for tests/integrations/test_integration_vllm.py into the project's venv (.venv or
# $MMCACHE_VENV, created here if missing): vllm 0.33.0 without its dependencies (they pin
# another torch and need a GPU), plus the modules that importing vLLM's EC connector base,
# factory, config and model-runner mixin, and building a VllmConfig on vLLM's CPU platform
# (VLLM_TARGET_DEVICE=cpu), need on a CPU machine. Does nothing when they work.
set -euo pipefail
# shellcheck source=scripts/engine_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/engine_venv.sh"
probe="import vllm.distributed.ec_transfer.ec_connector.factory, vllm.v1.worker.ec_connector_model_runner_mixin
from vllm.config import VllmConfig
VllmConfig()"
export VLLM_TARGET_DEVICE=cpu
engine_venv vllm 0.33.0 "$probe" || exit 0
echo "install_vllm.sh: installing vllm 0.33.0 (--no-deps) and its imports into $venv" >&2
# The versions vLLM 0.33.0's requirements allow (transformers <5.21, oss-harmony for
# openai_harmony), pinned so CI imports the same modules every run.
"$py" -m pip install -q --disable-pip-version-check --no-deps \
  vllm==0.33.0 \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 anyio==4.16.0 \
  attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \
  frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 \
  idna==3.20 multidict==7.2.1 numpy==2.4.6 openai==3.57.0 oss-harmony==0.0.11 packaging==26.4 \
  pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic-core==2.50.5 pyyaml==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 \
  safetensors==0.8.0 sniffio==1.3.1 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2 \
  truststore==0.10.5 typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 \
  yarl==1.25.1 \
  annotated-doc==0.0.7 apache-tvm-ffi==0.1.15.post2 cloudpickle==3.1.3 fastapi==0.165.0 \
  llguidance==1.9.1 msgspec==0.23.0 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 \
  prometheus-client==0.26.0 py-cpuinfo==9.0.0 starlette==1.10.0 uvloop==0.23.0 xgrammar==0.2.9
"$py" -c "$probe"

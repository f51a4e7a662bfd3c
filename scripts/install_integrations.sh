#!/usr/bin/env bash
# Install the serving engine that tests/integrations/test_integration_sglang.py runs against,
# into the project's venv (.venv or $MMCACHE_VENV, created here if missing): sglang 0.5.23
# without its dependencies (they pin another torch and need a GPU), plus the modules that
# importing sglang.srt.mem_cache.multimodal_cache needs on a CPU machine. Does nothing when it
# imports.
set -euo pipefail
# shellcheck source=scripts/engine_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/engine_venv.sh"
probe="import sglang.srt.mem_cache.multimodal_cache"
engine_venv sglang 0.5.23 "$probe" -W error || exit 0
echo "install_integrations.sh: installing sglang 0.5.23 (--no-deps) and its imports into $venv" >&2
"$py" -m pip install -q --disable-pip-version-check --no-deps \
  sglang==0.5.23 \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anyio==4.16.0 attrs==26.1.0 \
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 frozenlist==1.8.0 idna==3.20 \
  annotated-types==0.8.0 ipython==9.18.1 msgspec==0.23.0 multidict==7.2.1 numpy==2.4.6 packaging==26.4 orjson==3.13.0 pillow==13.0.0 \
  propcache==0.5.4 psutil==7.2.2 pydantic==2.14.4 pydantic-core==2.50.5 pybase64==1.5.1 pygments==2.21.0 pyzmq==27.3.0 \
  requests==2.34.2 starlette==1.10.0 tqdm==4.70.1 traitlets==5.16.1 triton==3.9.0 \
  typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 yarl==1.25.1
"$py" -W error -c "$probe"

"""Adapters that put mmcache where serving engines look for their multimodal caches.

Each engine's adapter is a module of its own (`mmcache.integrations.sglang`), imported
only by those who use that engine: importing this package imports no engine.

SGLang starts its scheduler processes with multiprocessing's spawn, so a call made in the
process that launches SGLang does not reach them. `sglang_plugin` is registered as an
SGLang general plugin (entry point group `sglang.srt.plugins`, in mmcache's
pyproject.toml), which SGLang loads in each of its processes, every scheduler included,
before the scheduler builds its embedding cache. It installs the adapter where
MMCACHE_SGLANG_INSTALL asks for it (`python -m mmcache.integrations.sglang` sets it) and
does nothing otherwise.
"""

from __future__ import annotations

import os
import reprlib
from typing import Final

from mmcache.errors import MMCacheError

__all__ = [
    "SGLANG_INSTALL_VARIABLE",
    "SGLANG_PLUGIN",
    "SGLANG_PLUGIN_GROUP",
    "SGLANG_PLUGIN_NAME",
    "IntegrationError",
    "sglang_plugin",
]

#: The variable that makes each SGLang process install mmcache's embedding cache.
SGLANG_INSTALL_VARIABLE: Final = "MMCACHE_SGLANG_INSTALL"
#: SGLang's entry point group of general plugins, and mmcache's entry in it.
SGLANG_PLUGIN_GROUP: Final = "sglang.srt.plugins"
SGLANG_PLUGIN_NAME: Final = "mmcache"
SGLANG_PLUGIN: Final = "mmcache.integrations:sglang_plugin"
#: MMCACHE_SGLANG_INSTALL's values that install, and the device each puts the cache on.
_INSTALL_DEVICES: Final = {"1": "cuda", "cuda": "cuda", "sim": "sim"}


class IntegrationError(MMCacheError, RuntimeError):
    """The serving engine is missing, or is a version whose seam the adapter does not fit."""


def sglang_plugin() -> None:
    """Install mmcache's SGLang adapter in this process if MMCACHE_SGLANG_INSTALL says so.

    SGLang calls it as it loads its plugins. Unset, empty or "0": nothing (SGLang loads the
    plugin wherever mmcache is installed beside it). "1" or "cuda": `install()`, whose cache
    goes on the GPU current when SGLang builds it, the scheduler's own; "sim": on the
    simulator. Another value, or an install() that fails, ends the process (SystemExit,
    naming the variable): SGLang catches a plugin's exceptions and would go on with its
    own cache, which is not what was asked for.
    """
    raw = os.environ.get(SGLANG_INSTALL_VARIABLE, "").strip()
    if raw in ("", "0"):
        return
    device = _INSTALL_DEVICES.get(raw.lower())
    if device is None:
        raise SystemExit(
            f"error: {SGLANG_INSTALL_VARIABLE}={reprlib.repr(raw)}: 1 (or cuda) installs "
            "mmcache's embedding cache in each SGLang process, sim installs it on the "
            "simulator, 0 or unset leaves SGLang's own"
        )
    try:
        from mmcache.integrations.sglang import install

        install(device=device)
    except MMCacheError as exc:
        raise SystemExit(
            f"error: {SGLANG_INSTALL_VARIABLE}={raw}: mmcache could not take the place of "
            f"SGLang's embedding cache in this process: {exc}"
        ) from exc

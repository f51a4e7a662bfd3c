"""SGLang 0.5.23's own mm_schedule.py, loadable on a machine without a GPU.

`load_seam()` loads it as `sglang.srt.managers.mm_schedule`, the module install() patches,
with small stand-ins for its imports that need a GPU build of torchvision and transformers'
processors (model configs, the scheduler's batch types), as test_integration_sglang.py's
`mm_schedule` fixture does. For processes the tests start, which have no fixtures: SGLang's
scheduler processes import the seam before they build their embedding cache, and so do
the stand-in schedulers that call this.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

SEAM = "sglang.srt.managers.mm_schedule"


def _module(name: str, **attrs: object) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def seam_stand_ins() -> dict[str, ModuleType]:
    """The modules the seam imports that need a GPU build, as small stand-ins by name."""
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

    class EVSEmbeddingResult(EmbeddingResult):  # type: ignore[misc]
        pass

    return {
        "sglang.srt.managers.schedule_batch": _module("schedule_batch", MultimodalDataItem=object),
        "sglang.srt.multimodal.evs": _module("evs", EVSEmbeddingResult=EVSEmbeddingResult),
        "sglang.srt.multimodal.transport.cuda_ipc": _module(
            "cuda_ipc", BORROW_CUDA_IPC_FEATURE_KEY="borrow"
        ),
        "sglang.srt.runtime_context": _module("runtime_context", get_schedule=lambda: None),
        "sglang.srt.utils": _module(
            "utils", is_hip=lambda: False, is_npu=lambda: False, is_xpu=lambda: False
        ),
        "sglang.srt.utils.async_probe": _module("async_probe", maybe_assert_sum=lambda *a: None),
        "sglang.utils": _module("utils", logger=logging.getLogger("sglang")),
    }


def load_seam() -> ModuleType:
    """The seam module, loaded once per process and kept in sys.modules under SEAM."""
    if SEAM in sys.modules:
        return sys.modules[SEAM]
    import sglang

    stand_ins = seam_stand_ins()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        path = Path(sglang.__file__).parent / "srt" / "managers" / "mm_schedule.py"
        spec = importlib.util.spec_from_file_location(SEAM, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[SEAM] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[SEAM]
            raise
    finally:
        for name, previous in saved.items():  # SGLang's own modules for everything after
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module

"""What an error's traceback keeps alive: the check that a failed or cancelled read
leaves no tensor it read in its frames."""

from __future__ import annotations

import torch


def tensors_held_by(error: BaseException, *, chained: bool = False) -> list[str]:
    """The frames of error's traceback whose locals hold a tensor (alone or in a list);
    chained: of the errors it was raised while handling too (a cancelled task's
    CancelledError is a new one, raised while handling the one its coroutine raised)."""
    held: list[str] = []
    seen: BaseException | None = error
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None:
            for name, local in tb.tb_frame.f_locals.items():
                items = local if isinstance(local, list) else [local]
                if any(isinstance(item, torch.Tensor) for item in items):
                    held.append(f"{tb.tb_frame.f_code.co_name}: {name}")
            tb = tb.tb_next
        seen = seen.__context__ if chained else None
    return held

"""CUDA streams: making one current for a block, and the current stream's object, cheaply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, final

import torch

from mmcache.device.base import Stream
from mmcache.errors import InvalidValueError

__all__ = ["CurrentStreams", "OnStream", "as_cuda_stream", "new_stream"]

_MAX_STREAM_OBJECTS: Final = 4096

# torch.cuda.stream() builds Stream objects on entry and exit (a cost paid once per copy,
# and a large one on a busy host); these are the calls underneath it, used where they exist.
_get_current_stream: Callable[[int], tuple[int, int, int]] | None = getattr(
    torch._C, "_cuda_getCurrentStream", None
)
_set_current_stream: Callable[..., None] | None = getattr(torch._C, "_cuda_setStream", None)
_get_current_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
_set_current_device: Callable[[int], None] | None = getattr(torch._C, "_cuda_setDevice", None)


def new_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """torch.cuda.Stream(device, priority), typed."""
    return torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]


@final
class OnStream:
    """Make stream the current one for a block (and its device current), then restore both."""

    __slots__ = ("_fallback", "_prev_device", "_prev_stream", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._fallback: Any = None
        self._prev_stream: tuple[int, int, int] | None = None
        self._prev_device = 0

    def __enter__(self) -> None:
        stream = self._stream
        if (
            _get_current_stream is None
            or _set_current_stream is None
            or _get_current_device is None
            or _set_current_device is None
        ):
            self._fallback = torch.cuda.stream(stream)
            self._fallback.__enter__()
            return
        device_index = stream.device_index
        self._prev_device = _get_current_device()
        prev_stream = _get_current_stream(device_index)
        if self._prev_device == device_index and prev_stream == (
            stream.stream_id,
            device_index,
            stream.device_type,
        ):
            # Already current (the caller's own stream, most often): nothing to switch back.
            self._prev_stream = None
            return
        self._prev_stream = prev_stream
        _set_current_stream(
            stream_id=stream.stream_id,
            device_index=device_index,
            device_type=stream.device_type,
        )

    def __exit__(self, *exc_info: object) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc_info)
            return
        if self._prev_stream is None:
            return
        assert _set_current_stream is not None
        stream_id, device_index, device_type = self._prev_stream
        _set_current_stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        if self._prev_device != device_index:
            assert _set_current_device is not None
            _set_current_device(self._prev_device)


def as_cuda_stream(stream: Stream) -> torch.cuda.Stream:
    """The torch.cuda.Stream behind stream (a torch.Stream of CUDA type is converted)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, torch.Stream) and stream.device.type == "cuda":
        return torch.cuda.Stream(  # type: ignore[no-untyped-call]
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )
    raise InvalidValueError(f"expected a torch.cuda.Stream, got {type(stream).__name__}")


@final
class CurrentStreams:
    """The calling thread's current stream on one GPU, as a Stream object kept per stream."""

    __slots__ = ("_device", "_index", "_objects")

    def __init__(self, device: torch.device, index: int) -> None:
        self._device = device
        self._index = index
        self._objects: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def current(self) -> Stream:
        """The calling thread's current stream on this device."""
        if _get_current_stream is None:
            return torch.cuda.current_stream(self._device)
        # torch.cuda.current_stream() builds a new Stream object per call; streams are few
        # (pools of a fixed size), so their objects are kept.
        key = _get_current_stream(self._index)
        stream = self._objects.get(key)
        if stream is None:
            if len(self._objects) >= _MAX_STREAM_OBJECTS:
                self._objects.clear()
            stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
            self._objects[key] = stream
        return stream

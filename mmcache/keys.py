"""Content keys for features: a collision-resistant digest of a feature's source and settings.

A cached embedding is only right for the bytes it was computed from *and* for the
model revision and preprocessing that turned those bytes into it. `feature_key`
hashes all of them with BLAKE2b into a key the cache accepts as is, and
`check_feature` verifies on a hit that a feature has the shape and dtype the
caller expects.

Why at least 128 bits: with n distinct sources, the chance that two share a
b-bit digest is about n**2 / 2**(b + 1). At 64 bits that is 1 in 37 for a
billion sources (a busy fleet hashes that many images in weeks) and a
certainty for an attacker who searches for a collision (2**32 work), so a
user's upload could be served another user's embedding. Serving engines have
shipped 64-bit truncated hashes and seen exactly that. At 128 bits an
accidental collision needs ~10**16 sources for a one-in-a-million chance, and
a deliberate one ~2**64 hash evaluations; pass digest_bytes=32 (256 bits)
where users upload content and an adversary is plausible.

The encoding is canonical and injective: every field is tagged and
length-prefixed, so ("ab", "c") and ("a", "bc") differ; preprocessing
settings are sorted by name, and their values keep their type (True, 1, 1.0
and "1" are four different settings). The personalisation string versions the
encoding: changing it changes every key, as it must.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import reprlib
import struct
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple, TypeAlias, overload

import torch

from mmcache.errors import FeatureMismatchError, InvalidKeyError, InvalidValueError

__all__ = [
    "DIGEST_BYTES",
    "FeatureKey",
    "FeatureMismatchError",
    "PreprocessValue",
    "check_feature",
    "feature_key",
]

#: Default digest size: 16 bytes (128 bits); 32 is the other choice.
DIGEST_BYTES: Final = 16
_PERSON: Final = b"mmcache.key.v1"  # BLAKE2b personalisation (<= 16 bytes): the encoding version
_SHAPE_UNKNOWN: Final = b"-"

PreprocessValue: TypeAlias = (
    str
    | bytes
    | int
    | float
    | bool
    | torch.dtype
    | Sequence["PreprocessValue"]
    | Mapping[str, "PreprocessValue"]
    | None
)
Source: TypeAlias = bytes | bytearray | memoryview | torch.Tensor


class FeatureKey(NamedTuple):
    """A content key: (kind, hex digest). A tuple of str, so the cache takes it as is."""

    kind: str
    digest: str


def feature_key(
    data: Source,
    *,
    model: str,
    revision: str,
    preprocess: Mapping[str, PreprocessValue] | None = None,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    kind: str = "image",
    digest_bytes: int = DIGEST_BYTES,
) -> FeatureKey:
    """The content key of a feature computed from data by model@revision with preprocess.

    data is the source: the encoded file's bytes (cheapest to hash, and what
    identifies an upload) or a decoded tensor (hashed over its bytes on the
    host, in logical order, with its shape and dtype). shape and dtype describe
    raw bytes when those are a decoded tensor's; for a tensor they are read from
    it (and, if given, must agree). Everything that changes the embedding
    belongs in revision or preprocess (resolution, crop, normalisation, frame
    sampling, the processor's version).
    """
    if digest_bytes not in (16, 32):
        raise InvalidValueError(
            f"digest_bytes must be 16 (128-bit) or 32 (256-bit), not {digest_bytes}"
        )
    for name, text in (("kind", kind), ("model", model), ("revision", revision)):
        if not isinstance(text, str) or not text:
            raise InvalidKeyError(
                f"feature_key({name}=...) must be a non-empty str, not {reprlib.repr(text)}: a key "
                "that omits it would be shared by features it does not describe"
            )
    payload, shape, dtype, owner = _source(data, shape, dtype)
    h = hashlib.blake2b(digest_size=digest_bytes, person=_PERSON)
    _field(h, b"k", kind.encode())
    _field(h, b"m", model.encode())
    _field(h, b"r", revision.encode())
    h.update(b"p")
    _value(h, dict(preprocess) if preprocess is not None else {})
    _field(h, b"t", _dtype_name(dtype).encode() if dtype is not None else _SHAPE_UNKNOWN)
    if shape is None:
        _field(h, b"s", _SHAPE_UNKNOWN)
    else:
        _field(h, b"s", b"".join(struct.pack("<q", d) for d in shape))
    _field(h, b"d", payload)
    del payload, owner  # the view over a tensor's memory must not outlive the tensor
    return FeatureKey(kind, h.hexdigest())


@overload
def check_feature(
    feature: torch.Tensor,
    *,
    shape: Sequence[int | None] | None = ...,
    dtype: torch.dtype | None = ...,
    key: object = ...,
) -> torch.Tensor: ...


@overload
def check_feature(
    feature: None,
    *,
    shape: Sequence[int | None] | None = ...,
    dtype: torch.dtype | None = ...,
    key: object = ...,
) -> None: ...


def check_feature(
    feature: torch.Tensor | None,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | None = None,
    key: object = None,
) -> torch.Tensor | None:
    """Return feature if it has shape (None matches any size of a dimension) and dtype.

    A miss (None) passes through. On a mismatch raises FeatureMismatchError: the
    key does not cover something that changes the feature (model revision,
    preprocessing); discard the key, recompute, and add that setting to the key.
    """
    if feature is None:
        return None
    got_shape = tuple(feature.shape)
    problems: list[str] = []
    if dtype is not None and feature.dtype != dtype:
        problems.append(f"dtype {feature.dtype} (expected {dtype})")
    if shape is not None:
        want = tuple(shape)
        if len(want) != len(got_shape) or any(
            w is not None and w != g for w, g in zip(want, got_shape, strict=False)
        ):
            shown = "(" + ", ".join("*" if w is None else str(w) for w in want) + ")"
            problems.append(f"shape {got_shape} (expected {shown})")
    if problems:
        where = f"cached feature for {reprlib.repr(key)}" if key is not None else "cached feature"
        raise FeatureMismatchError(
            f"{where} has {' and '.join(problems)}; its key does not cover a setting that "
            "changes the feature (model revision, preprocessing): discard it, recompute, "
            "and pass that setting to feature_key(revision=..., preprocess=...)"
        )
    return feature


# --- canonical encoding ---------------------------------------------------------------


def _field(h: hashlib.blake2b, tag: bytes, data: bytes | memoryview) -> None:
    # Views are cast to bytes ("B") by _source, so len() is their size in bytes.
    h.update(tag + struct.pack("<Q", len(data)))
    h.update(data)


#: Deepest nesting of lists and dicts in a preprocessing value (a cycle nests for ever).
MAX_PREPROCESS_DEPTH: Final = 32


def _value(h: hashlib.blake2b, value: object, depth: int = 0) -> None:
    """Encode one preprocessing value with a type tag (bool before int: True is not 1)."""
    if depth > MAX_PREPROCESS_DEPTH:
        raise InvalidKeyError(
            f"preprocess values nest lists and dicts at most {MAX_PREPROCESS_DEPTH} deep (or "
            "contain themselves); flatten the setting"
        )
    if isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif value is None:
        h.update(b"N")
    elif isinstance(value, int):
        _field(h, b"I", str(value).encode())
    elif isinstance(value, float):
        # float.hex is exact (0.1 is not rounded); all NaNs are one setting.
        _field(h, b"F", b"nan" if math.isnan(value) else value.hex().encode())
    elif isinstance(value, str):
        _field(h, b"S", value.encode())
    elif isinstance(value, bytes | bytearray):
        _field(h, b"Y", bytes(value))
    elif isinstance(value, torch.dtype):
        _field(h, b"T", _dtype_name(value).encode())
    elif isinstance(value, Mapping):
        for name in value:
            if not isinstance(name, str):
                raise InvalidKeyError(
                    "preprocess setting names must be str, not "
                    f"{type(name).__name__} ({reprlib.repr(name)})"
                )
        h.update(b"M" + struct.pack("<Q", len(value)))
        for name in sorted(value):
            _field(h, b"S", name.encode())
            _value(h, value[name], depth + 1)
    elif isinstance(value, list | tuple):
        h.update(b"L" + struct.pack("<Q", len(value)))
        for item in value:
            _value(h, item, depth + 1)
    else:
        raise InvalidKeyError(
            f"preprocess value of type {type(value).__name__} ({reprlib.repr(value)}) has no "
            "canonical encoding; use str, bytes, int, float, bool, None, torch.dtype, or lists and "
            "str-keyed dicts of these"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    if not isinstance(dtype, torch.dtype):
        raise InvalidValueError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
    return str(dtype).removeprefix("torch.")


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous host tensor (keep the tensor alive while used)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    # ctypes rather than .numpy(): numpy is not a dependency, and has no bfloat16.
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def _source(
    data: object, shape: Sequence[int] | None, dtype: torch.dtype | None
) -> tuple[memoryview, tuple[int, ...] | None, torch.dtype | None, object]:
    """The bytes to hash, the shape and dtype they are hashed with, and their owner."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if shape is not None and tuple(shape) != tuple(t.shape):
            raise InvalidValueError(
                f"feature_key(shape={tuple(shape)}) disagrees with the tensor's {tuple(t.shape)}"
            )
        if dtype is not None and dtype != t.dtype:
            raise InvalidValueError(
                f"feature_key(dtype={dtype}) disagrees with the tensor's {t.dtype}"
            )
        if t.layout != torch.strided:
            raise InvalidValueError(f"feature_key hashes dense tensors, not {t.layout}")
        if t.device.type == "meta":
            raise InvalidValueError("a meta tensor has no bytes to hash")
        # Logical order on the host: a transposed view hashes like its contiguous copy.
        host = t.resolve_conj().resolve_neg().to("cpu").contiguous()
        return _host_bytes(host), tuple(t.shape), t.dtype, host
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        if not view.c_contiguous:
            raise InvalidValueError("feature_key needs a C-contiguous memoryview")
        view = view.cast("B")
        dims = None
        if shape is not None:
            dims = tuple(shape)
            for d in dims:
                if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                    raise InvalidValueError(f"shape must be non-negative ints, got {dims}")
        if dtype is not None:
            _dtype_name(dtype)
        if dims is not None and dtype is not None:
            want = math.prod(dims) * dtype.itemsize
            if want != view.nbytes:
                raise InvalidValueError(
                    f"{view.nbytes} bytes cannot hold shape {dims} of {dtype} ({want} bytes)"
                )
        return view, dims, dtype, data
    raise InvalidValueError(
        f"feature_key hashes bytes, bytearray, memoryview or a torch.Tensor, not "
        f"{type(data).__name__}"
    )

"""The format of a value on the server: a header (magic, version, dtype, shape, length,
checksum) and the payload, and the checks a value must pass before it is served."""

from __future__ import annotations

import ctypes
import hashlib
import struct
import zlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final, final

import torch

from mmcache.errors import MMCacheError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Header",
    "RemoteValueError",
    "checksum",
    "encode_value",
    "encode_key",
    "parse",
    "server_key",
    "supported",
]

MAGIC: Final = b"MMCF"
FORMAT_VERSION: Final = 1
#: magic, version, dtype code, number of dimensions, payload length, crc32 of the payload
_FIXED: Final = struct.Struct("<4sHBBQI")
_DIM: Final = struct.Struct("<Q")
MAX_DIMS: Final = 32
#: an encoded key longer than this is replaced by its hash, so server keys stay short
_LONGEST_PLAIN_KEY: Final = 200

# Codes are part of the format: never renumber, only append.
_DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE: Final = {dtype: code for code, dtype in enumerate(_DTYPES)}


class RemoteValueError(MMCacheError, ValueError):
    """A value on the server failed a check of its header or payload; it is never served."""


@final
@dataclass(frozen=True, slots=True)
class Header:
    """What a value's header says of its payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    length: int
    checksum: int
    #: bytes the header itself takes at the start of the value
    size: int


def checksum(payload: bytes | memoryview) -> int:
    """The checksum the header carries (CRC-32: corruption, not an adversary, is what it finds)."""
    return zlib.crc32(payload)


def supported(dtype: torch.dtype) -> bool:
    """Whether values of dtype can go to the remote tier."""
    return dtype in _DTYPE_CODE


def encode_value(tensor: torch.Tensor) -> bytearray:
    """A value for the server: the header, then the bytes of tensor (a contiguous host tensor).

    One copy of the payload, straight into the value.
    """
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise RemoteValueError(f"a tensor of {len(shape)} dimensions; at most {MAX_DIMS} go remote")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise RemoteValueError("only a contiguous host tensor can be encoded")
    size = _FIXED.size + len(shape) * _DIM.size
    length = tensor.nbytes
    value = bytearray(size + length)
    view = memoryview(value)
    if length:
        dst = ctypes.addressof(ctypes.c_char.from_buffer(value, size))
        ctypes.memmove(dst, tensor.data_ptr(), length)
    _FIXED.pack_into(
        view,
        0,
        MAGIC,
        FORMAT_VERSION,
        _DTYPE_CODE[tensor.dtype],
        len(shape),
        length,
        checksum(view[size:]),
    )
    for i, n in enumerate(shape):
        _DIM.pack_into(view, _FIXED.size + i * _DIM.size, n)
    view.release()
    return value


def parse(value: bytes | memoryview) -> tuple[Header, memoryview]:
    """The header of a value and a view of its payload, or RemoteValueError naming the check
    it failed (magic, version, dtype, shape, length or checksum)."""
    view = memoryview(value)
    if view.nbytes < _FIXED.size:
        raise RemoteValueError(f"value of {view.nbytes} bytes is shorter than a header")
    magic, version, code, ndim, length, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise RemoteValueError(f"bad magic {bytes(magic)!r}: not an mmcache value")
    if version != FORMAT_VERSION:
        raise RemoteValueError(f"format version {version}; this mmcache reads {FORMAT_VERSION}")
    if code >= len(_DTYPES):
        raise RemoteValueError(f"unknown dtype code {code}")
    if ndim > MAX_DIMS:
        raise RemoteValueError(f"{ndim} dimensions; at most {MAX_DIMS}")
    size = _FIXED.size + ndim * _DIM.size
    if view.nbytes < size:
        raise RemoteValueError("value ends inside its header")
    shape = tuple(_DIM.unpack_from(view, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    dtype = _DTYPES[code]
    expected = dtype.itemsize
    for n in shape:
        expected *= n
    if length != expected:
        raise RemoteValueError(f"payload length {length} does not match {dtype} {list(shape)}")
    payload = view[size:]
    if payload.nbytes != length:
        raise RemoteValueError(f"payload of {payload.nbytes} bytes; the header says {length}")
    if checksum(payload) != crc:
        raise RemoteValueError("payload checksum mismatch")
    return Header(dtype, shape, length, crc, size), payload


def server_key(namespace: str, key: Hashable) -> bytes:
    """The key under which the remote tier stores key's feature: <namespace>: + encode_key."""
    return namespace.encode() + b":" + encode_key(key)


def encode_key(key: Hashable) -> bytes:
    """A stable byte encoding of a cache key (str, bytes, int, tuples of these).

    Tagged and length-prefixed, so distinct keys never meet; the same in every process
    and Python version (no hash()). Long ones are replaced by a BLAKE2b digest of it.
    """
    out = bytearray()
    _encode(key, out)
    if len(out) > _LONGEST_PLAIN_KEY:
        return b"#" + hashlib.blake2b(out, digest_size=32).hexdigest().encode()
    return bytes(out)


def _encode(key: object, out: bytearray) -> None:
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")
        out += b"s%d:" % len(data) + data
    elif isinstance(key, bytes):
        out += b"b%d:" % len(key) + key
    elif isinstance(key, int):
        out += b"i%d;" % key
    elif isinstance(key, tuple):
        out += b"t%d(" % len(key)
        for part in key:
            _encode(part, out)
        out += b")"
    else:
        raise TypeError(f"cannot encode a {type(key).__name__} key")

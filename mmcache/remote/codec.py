"""The format of a value on the server, and the checks a value must pass before it is served.

A value is a header, then the payload (the tensor's bytes). The header holds the magic,
the format version, the dtype, the number of dimensions, the payload's length, a digest
of the server key it was written under, the shape, and last a CRC-32 that covers every
header byte before it and the whole payload: a value is served only as exactly the
tensor that was put under that key, or not at all.
"""

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
    "OtherVersionError",
    "RemoteValueError",
    "encode_key",
    "encode_value",
    "key_digest",
    "parse",
    "server_key",
    "supported",
]

MAGIC: Final = b"MMCF"
#: 2: the header names the key's digest, and its CRC-32 covers the header too
FORMAT_VERSION: Final = 2
#: magic and version: where every version of the format starts
_START: Final = struct.Struct("<4sH")
#: magic, version, dtype code, number of dimensions, payload length, the key's digest
_FIXED: Final = struct.Struct("<4sHBBQ16s")
_DIM: Final = struct.Struct("<Q")
#: CRC-32 of the header bytes before it and of the payload; the header's last field
_CHECK: Final = struct.Struct("<I")
MAX_DIMS: Final = 32
KEY_DIGEST_BYTES: Final = 16
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


class OtherVersionError(RemoteValueError):
    """A value of another format version (an older or newer mmcache wrote it): a miss."""


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


def key_digest(key: bytes) -> bytes:
    """The digest of a server key that a value's header carries (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(key, digest_size=KEY_DIGEST_BYTES).digest()


def supported(dtype: torch.dtype) -> bool:
    """Whether values of dtype can go to the remote tier."""
    return dtype in _DTYPE_CODE


def _header_size(ndim: int) -> int:
    return _FIXED.size + ndim * _DIM.size + _CHECK.size


def encode_value(tensor: torch.Tensor, key: bytes) -> bytearray:
    """A value for the server key key: the header, then the bytes of tensor (a contiguous
    host tensor).

    One copy of the payload, straight into the value.
    """
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise RemoteValueError(f"a tensor of {len(shape)} dimensions; at most {MAX_DIMS} go remote")
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise RemoteValueError("only a contiguous host tensor can be encoded")
    size = _header_size(len(shape))
    length = tensor.nbytes
    value = bytearray(size + length)
    view = memoryview(value)
    if length:
        dst = ctypes.addressof(ctypes.c_char.from_buffer(value, size))
        ctypes.memmove(dst, tensor.data_ptr(), length)
    code = _DTYPE_CODE[tensor.dtype]
    _FIXED.pack_into(view, 0, MAGIC, FORMAT_VERSION, code, len(shape), length, key_digest(key))
    for i, n in enumerate(shape):
        _DIM.pack_into(view, _FIXED.size + i * _DIM.size, n)
    checked = size - _CHECK.size
    _CHECK.pack_into(view, checked, _checksum(view[:checked], view[size:]))
    view.release()
    return value


def _checksum(header: memoryview, payload: memoryview) -> int:
    """CRC-32 of the header's bytes before the checksum, then of the payload (corruption,
    not an adversary, is what it finds)."""
    return zlib.crc32(payload, zlib.crc32(header))


def parse(value: bytes | memoryview, key: bytes) -> tuple[Header, memoryview]:
    """The header of a value read under the server key key and a view of its payload, or
    RemoteValueError naming the check it failed (magic, version, dtype, shape, length,
    key or checksum); OtherVersionError for a value of another format version."""
    view = memoryview(value)
    if view.nbytes < _START.size:
        raise RemoteValueError(f"value of {view.nbytes} bytes is shorter than a header")
    magic, version = _START.unpack_from(view)
    if magic != MAGIC:
        raise RemoteValueError(f"bad magic {bytes(magic)!r}: not an mmcache value")
    if version != FORMAT_VERSION:
        raise OtherVersionError(f"format version {version}; this mmcache reads {FORMAT_VERSION}")
    if view.nbytes < _FIXED.size:
        raise RemoteValueError(f"value of {view.nbytes} bytes is shorter than a header")
    _, _, code, ndim, length, digest = _FIXED.unpack_from(view)
    if code >= len(_DTYPES):
        raise RemoteValueError(f"unknown dtype code {code}")
    if ndim > MAX_DIMS:
        raise RemoteValueError(f"{ndim} dimensions; at most {MAX_DIMS}")
    size = _header_size(ndim)
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
    if digest != key_digest(key):
        raise RemoteValueError("written under another key (the header's key digest differs)")
    checked = size - _CHECK.size
    (crc,) = _CHECK.unpack_from(view, checked)
    if _checksum(view[:checked], payload) != crc:
        raise RemoteValueError("checksum mismatch (header or payload)")
    return Header(dtype, shape, length, crc, size), payload


def server_key(namespace: str, key: Hashable) -> bytes:
    """The key under which the remote tier stores key's feature in namespace.

    <length of the namespace in bytes>:<namespace>:<encode_key(key)>: the length makes
    the split unambiguous, so distinct (namespace, key) pairs never share a server key
    (a namespace may hold ':' and anything else).
    """
    ns = namespace.encode("utf-8", "surrogatepass")
    return b"%d:" % len(ns) + ns + b":" + encode_key(key)


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

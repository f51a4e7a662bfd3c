"""What crosses the process boundary: the sender's endpoint and one handle per send, as plain data.

Both are frozen records of plain fields with a versioned byte form
(to_bytes / from_bytes: a magic, a version byte and a JSON object) that
mmcache parses without ever unpickling. Pickling them works too, through the
same byte form, for callers that already pickle what they send.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Final, Literal, final

import torch

from mmcache.errors import InvalidHandleError

__all__ = [
    "FORMAT_VERSION",
    "FeatureHandle",
    "SenderEndpoint",
    "dtype_from_name",
    "dtype_name",
]

_MiB: Final = 1 << 20
#: The byte form's version; from_bytes refuses any other.
FORMAT_VERSION: Final = 1
_MAGIC: Final = b"MMCH"
_MAX_BYTES: Final = 64 << 10  # far above any real handle: a bound on what is parsed
_MAX_TEXT: Final = 4096
_MAX_BLOB: Final = 256  # CUDA IPC handles are 64 bytes
_MAX_DIMS: Final = 64
_INT64: Final = (1 << 63) - 1


def _dtype_table() -> dict[str, torch.dtype]:
    """Every torch dtype under its canonical name (aliases such as torch.float left out)."""
    table = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            table[str(value).removeprefix("torch.")] = value
    return table


_DTYPES: Final = _dtype_table()


def dtype_name(dtype: torch.dtype) -> str:
    """The name a handle carries for dtype ("bfloat16", ...); dtype_from_name reverses it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called name ("bfloat16", ...); InvalidHandleError if there is none."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise InvalidHandleError(f"{name!r} is not the name of a torch dtype")
    return dtype


def _int(value: object, what: str, low: int = 0, high: int = _INT64) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidHandleError(f"{what} must be an integer in [{low}, {high}], not {value!r:.80}")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or "\0" in value:
        raise InvalidHandleError(f"{what} must be a string of at most {_MAX_TEXT} characters")
    return value


def _blob(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) > _MAX_BLOB:
        raise InvalidHandleError(f"{what} must be at most {_MAX_BLOB} bytes")
    return value


def _hex_blob(value: object, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * _MAX_BLOB:
        raise InvalidHandleError(f"{what} must be a hex string of at most {_MAX_BLOB} bytes")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise InvalidHandleError(f"{what} is not a hex string") from None


def _digest(data: bytes) -> int:
    """A signed 64-bit digest of data (what a control-block cell holds)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _encode(fields: dict[str, object]) -> bytes:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return _MAGIC + bytes([FORMAT_VERSION]) + text.encode()


def _decode(data: object, what: str) -> dict[str, object]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidHandleError(f"{what} must be bytes, not {type(data).__name__}")
    raw = bytes(data)
    if len(raw) > _MAX_BYTES:
        raise InvalidHandleError(f"{what} of {len(raw)} bytes is longer than any valid one")
    if len(raw) < len(_MAGIC) + 1 or not raw.startswith(_MAGIC):
        raise InvalidHandleError(f"these bytes are not an mmcache {what}")
    version = raw[len(_MAGIC)]
    if version != FORMAT_VERSION:
        raise InvalidHandleError(
            f"{what} of format version {version}; this mmcache reads version {FORMAT_VERSION}: "
            "run the same mmcache version on both sides"
        )
    try:
        fields = json.loads(raw[len(_MAGIC) + 1 :].decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        raise InvalidHandleError(f"{what} bytes are truncated or corrupt") from None
    if not isinstance(fields, dict):
        raise InvalidHandleError(f"{what} bytes are not an object")
    return fields


def _exact_keys(fields: dict[str, object], keys: frozenset[str], what: str) -> None:
    if fields.keys() != keys:
        raise InvalidHandleError(f"{what} has fields {sorted(fields)}, expected {sorted(keys)}")


@final
@dataclass(frozen=True, slots=True)
class SenderEndpoint:
    """How a receiver reaches a sender: its control block and the memory it shares.

    device_kind is "sim" (the pool is a shared CPU segment at pool_path) or
    "cuda" (the pool is device memory: cuda_pool is its cuIpcMemHandle, on the
    GPU whose UUID is device_uuid). The host fallback is the segment at
    fallback_path. Empty paths and handles mean that part is off. The sender
    publishes digest() in its control block; a receiver serves nothing of an
    endpoint that does not match it.
    """

    control_path: str
    pid: int
    device_kind: Literal["sim", "cuda"]
    device_uuid: str
    pool_path: str
    pool_nbytes: int
    cuda_pool: bytes
    fallback_path: str
    fallback_nbytes: int

    def check(self) -> None:
        """Raise InvalidHandleError unless every field has its type and range."""
        if not isinstance(self, SenderEndpoint):
            raise InvalidHandleError(f"expected a SenderEndpoint, got {type(self).__name__}")
        _text(self.control_path, "control_path")
        _int(self.pid, "pid", 1, (1 << 31) - 1)
        if self.device_kind not in ("sim", "cuda"):
            raise InvalidHandleError(
                f"device_kind must be 'sim' or 'cuda', not {self.device_kind!r:.40}"
            )
        _text(self.device_uuid, "device_uuid")
        _text(self.pool_path, "pool_path")
        _int(self.pool_nbytes, "pool_nbytes")
        _blob(self.cuda_pool, "cuda_pool")
        _text(self.fallback_path, "fallback_path")
        _int(self.fallback_nbytes, "fallback_nbytes")

    def fields(self) -> dict[str, object]:
        """The endpoint as JSON-ready plain fields."""
        return {
            "control_path": self.control_path,
            "pid": self.pid,
            "device_kind": self.device_kind,
            "device_uuid": self.device_uuid,
            "pool_path": self.pool_path,
            "pool_nbytes": self.pool_nbytes,
            "cuda_pool": self.cuda_pool.hex(),
            "fallback_path": self.fallback_path,
            "fallback_nbytes": self.fallback_nbytes,
        }

    @classmethod
    def from_fields(cls, fields: object) -> SenderEndpoint:
        """The endpoint fields() made (InvalidHandleError if they are not that)."""
        if not isinstance(fields, dict):
            raise InvalidHandleError("a handle's sender must be an object")
        _exact_keys(fields, _ENDPOINT_KEYS, "sender endpoint")
        endpoint = cls(
            control_path=fields["control_path"],
            pid=fields["pid"],
            device_kind=fields["device_kind"],
            device_uuid=fields["device_uuid"],
            pool_path=fields["pool_path"],
            pool_nbytes=fields["pool_nbytes"],
            cuda_pool=_hex_blob(fields["cuda_pool"], "cuda_pool"),
            fallback_path=fields["fallback_path"],
            fallback_nbytes=fields["fallback_nbytes"],
        )
        endpoint.check()
        return endpoint

    def to_bytes(self) -> bytes:
        """The versioned byte form (from_bytes reads it back)."""
        return _encode(self.fields())

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SenderEndpoint:
        """The endpoint whose to_bytes() is data; InvalidHandleError for anything else."""
        return cls.from_fields(_decode(data, "IPC sender endpoint"))

    def digest(self) -> int:
        """A 64-bit digest of every field, as the sender publishes it."""
        return _digest(self.to_bytes())

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return _endpoint_from_bytes, (self.to_bytes(),)


_ENDPOINT_KEYS: Final = frozenset(
    (
        "control_path",
        "pid",
        "device_kind",
        "device_uuid",
        "pool_path",
        "pool_nbytes",
        "cuda_pool",
        "fallback_path",
        "fallback_nbytes",
    )
)


@final
@dataclass(frozen=True, slots=True)
class FeatureHandle:
    """One sent feature: where its bytes are, what they are, and the slot that tracks them.

    where is "pool" (a slice of the sender's IPC pool, written stream-ordered:
    wait for the slot's ready mark or for cuda_event before reading) or "host"
    (a block of the shared host fallback, written before send returned).
    """

    sender: SenderEndpoint
    seq: int
    slot: int
    where: Literal["pool", "host"]
    offset: int
    shape: tuple[int, ...]
    dtype: str
    cuda_event: bytes = b""

    @property
    def nbytes(self) -> int:
        """Bytes of the feature."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    def describe(self) -> str:
        """One line naming the handle, for logs and errors (also for a malformed one)."""
        try:
            size = f"{self.nbytes / _MiB:.2f} MiB "
        except (InvalidHandleError, TypeError, OverflowError):
            size = ""
        shape = ", ".join(map(str, self.shape)) if isinstance(self.shape, tuple) else "?"
        pid = getattr(self.sender, "pid", "?")
        return (
            f"IPC handle #{self.seq!r:.24} ({self.where!r:.24} slot {self.slot!r:.24}, offset "
            f"{self.offset!r:.24}, {size}{self.dtype!r:.24}[{shape:.80}]) of sender pid {pid!r:.24}"
        )

    def check(self) -> None:
        """Raise InvalidHandleError unless every field has its type and range.

        That a handle is well formed says nothing of whether its sender published
        it: the receiver checks that against the sender's control block.
        """
        if not isinstance(self, FeatureHandle):
            raise InvalidHandleError(f"expected a FeatureHandle, got {type(self).__name__}")
        if not isinstance(self.sender, SenderEndpoint):
            raise InvalidHandleError("a handle's sender must be a SenderEndpoint")
        self.sender.check()
        _int(self.seq, "seq", 1)
        _int(self.slot, "slot", 0, (1 << 31) - 1)
        if self.where not in ("pool", "host"):
            raise InvalidHandleError(f"where must be 'pool' or 'host', not {self.where!r:.40}")
        _int(self.offset, "offset")
        if not isinstance(self.shape, tuple) or len(self.shape) > _MAX_DIMS:
            raise InvalidHandleError(f"shape must be a tuple of at most {_MAX_DIMS} sizes")
        for size in self.shape:
            _int(size, "a shape's size")
        itemsize = dtype_from_name(self.dtype).itemsize
        if math.prod(self.shape) * itemsize > _INT64:
            raise InvalidHandleError("the handle's shape and dtype are larger than any memory")
        _blob(self.cuda_event, "cuda_event")

    def slice_digest(self) -> int:
        """A 64-bit digest of the dtype, shape and CUDA event, as the sender publishes them."""
        text = f"{self.dtype}|{','.join(map(str, self.shape))}|{self.cuda_event.hex()}"
        return _digest(text.encode())

    def to_bytes(self) -> bytes:
        """The versioned byte form (from_bytes reads it back); about 600 bytes."""
        return _encode(
            {
                "sender": self.sender.fields(),
                "seq": self.seq,
                "slot": self.slot,
                "where": self.where,
                "offset": self.offset,
                "shape": list(self.shape),
                "dtype": self.dtype,
                "cuda_event": self.cuda_event.hex(),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> FeatureHandle:
        """The handle whose to_bytes() is data; InvalidHandleError for anything else.

        Only the form is checked here; whether the sender published this slice is
        checked by the receiver that serves it.
        """
        fields = _decode(data, "IPC handle")
        _exact_keys(fields, _HANDLE_KEYS, "IPC handle")
        shape = fields["shape"]
        if not isinstance(shape, list):
            raise InvalidHandleError("a handle's shape must be a list of sizes")
        handle = cls(
            sender=SenderEndpoint.from_fields(fields["sender"]),
            seq=fields["seq"],  # type: ignore[arg-type]  # check() below
            slot=fields["slot"],  # type: ignore[arg-type]
            where=fields["where"],  # type: ignore[arg-type]
            offset=fields["offset"],  # type: ignore[arg-type]
            shape=tuple(shape),
            dtype=fields["dtype"],  # type: ignore[arg-type]
            cuda_event=_hex_blob(fields["cuda_event"], "cuda_event"),
        )
        handle.check()
        return handle

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return _handle_from_bytes, (self.to_bytes(),)


_HANDLE_KEYS: Final = frozenset(
    ("sender", "seq", "slot", "where", "offset", "shape", "dtype", "cuda_event")
)


def _handle_from_bytes(data: bytes) -> FeatureHandle:
    return FeatureHandle.from_bytes(data)


def _endpoint_from_bytes(data: bytes) -> SenderEndpoint:
    return SenderEndpoint.from_bytes(data)

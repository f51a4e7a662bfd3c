"""What crosses the process boundary: the sender's endpoint and one handle per send, as plain data.

All are frozen records of plain fields with a versioned byte form (to_bytes /
from_bytes, starting with a magic and a version byte) that mmcache parses
without ever unpickling: the endpoint as a JSON object, a handle (one feature)
or a batch handle (the features of one send_many) as packed binary fields
followed by their endpoint's bytes. A receiver parses each endpoint once and
reuses it for every handle that carries the same bytes. Pickling works too,
through the same byte form, for callers that already pickle what they send.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, final

import torch

from mmcache.errors import InvalidHandleError, InvalidValueError

if TYPE_CHECKING:
    from mmcache.device import Device

__all__ = [
    "FORMAT_VERSION",
    "DeviceKind",
    "FeatureBatch",
    "FeatureHandle",
    "SenderEndpoint",
    "device_kind",
    "dtype_from_name",
    "dtype_name",
]

_MiB: Final = 1 << 20
#: The byte form's version; from_bytes refuses any other.
FORMAT_VERSION: Final = 2
_MAGIC: Final = b"MMCH"
_MAX_BYTES: Final = 64 << 10  # far above any real handle: a bound on what is parsed
_MAX_TEXT: Final = 4096
_MAX_BLOB: Final = 256  # CUDA IPC handles are 64 bytes
_MAX_DIMS: Final = 64
_MAX_PARTS: Final = 4096  # features in one batch handle
_INT64: Final = (1 << 63) - 1


def _dtype_table() -> dict[str, torch.dtype]:
    """Every torch dtype under its canonical name (aliases such as torch.float left out)."""
    table = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            table[str(value).removeprefix("torch.")] = value
    return table


_DTYPES: Final = _dtype_table()
_DTYPE_NAMES: Final = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a handle carries for dtype ("bfloat16", ...); dtype_from_name reverses it."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


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


#: Where a sender's pool lies: a shared CPU segment ("sim") or CUDA IPC memory ("cuda").
DeviceKind = Literal["sim", "cuda"]


def device_kind(device: Device) -> DeviceKind:
    """The kind of the device a sender or receiver runs on, as its endpoint names it."""
    kind = device.kind
    if kind == "sim":
        return "sim"
    if kind == "cuda":
        return "cuda"
    raise InvalidValueError(
        f"the IPC transport runs on a 'sim' or a 'cuda' device, not {device.name} ({kind!r:.40})"
    )


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
    device_kind: DeviceKind
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
        return _digest(_endpoint_bytes(self))

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


#: Packed fields of a handle after the magic and version: kind, seq, slot, where code,
#: offset, number of parts, then the CUDA event's and the endpoint's lengths.
_FIXED: Final = struct.Struct("<BqqBqIHI")
_PART: Final = struct.Struct("<qBB")  # a part's offset in the slice, dtype name length, ndim
_SHAPES: Final = tuple(struct.Struct(f"<{ndim}q") for ndim in range(256))  # by ndim (a byte)
_KIND_HANDLE: Final = 1
_KIND_BATCH: Final = 2
_WHERE: Final = {"pool": 1, "host": 2}
_WHERE_NAMES: Final = {code: name for name, code in _WHERE.items()}
_MAX_ENDPOINTS: Final = 256  # endpoints a process keeps parsed (one per sender it hears of)
_MAX_DIGESTS: Final = 4096  # slice digests a process keeps made
_parsed_endpoints: dict[bytes, SenderEndpoint] = {}

#: One feature of a send: its offset in the slice, its shape and its dtype's name.
Part = tuple[int, tuple[int, ...], str]


@functools.lru_cache(maxsize=_MAX_ENDPOINTS)
def _endpoint_bytes(endpoint: SenderEndpoint) -> bytes:
    """endpoint.to_bytes(), made once per endpoint (a sender's handles all carry it)."""
    return endpoint.to_bytes()


def _endpoint_of(data: bytes) -> SenderEndpoint:
    """The endpoint whose bytes are data, parsed and checked once per process."""
    endpoint = _parsed_endpoints.get(data)
    if endpoint is None:
        endpoint = SenderEndpoint.from_bytes(data)
        if len(_parsed_endpoints) >= _MAX_ENDPOINTS:
            _parsed_endpoints.clear()
        _parsed_endpoints[data] = endpoint
    return endpoint


def _part_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * dtype_from_name(dtype).itemsize


def _check_slice(
    seq: object, slot: object, where: object, offset: object, cuda_event: object
) -> None:
    """The fields a handle and a batch handle share, but for the endpoint."""
    _int(seq, "seq", 1)
    _int(slot, "slot", 0, (1 << 31) - 1)
    if where not in ("pool", "host"):
        raise InvalidHandleError(f"where must be 'pool' or 'host', not {where!r:.40}")
    _int(offset, "offset")
    _blob(cuda_event, "cuda_event")


def _check_part(shape: object, dtype: str) -> tuple[int, int]:
    """Raise InvalidHandleError unless shape and dtype describe a feature; its bytes and
    its dtype's item size."""
    if not isinstance(shape, tuple) or len(shape) > _MAX_DIMS:
        raise InvalidHandleError(f"shape must be a tuple of at most {_MAX_DIMS} sizes")
    for size in shape:
        if type(size) is not int or not 0 <= size <= _INT64:
            _int(size, "a shape's size")  # raises, saying why
    itemsize = dtype_from_name(dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    if nbytes > _INT64:
        raise InvalidHandleError("the handle's shape and dtype are larger than any memory")
    return nbytes, itemsize


def _pack(
    kind: int,
    sender: SenderEndpoint,
    fields: tuple[int, int, str, int],
    parts: tuple[Part, ...],
    cuda_event: bytes,
) -> bytes:
    seq, slot, where, offset = fields
    endpoint = _endpoint_bytes(sender)
    out = [
        _MAGIC,
        bytes([FORMAT_VERSION]),
        _FIXED.pack(
            kind, seq, slot, _WHERE[where], offset, len(parts), len(cuda_event), len(endpoint)
        ),
    ]
    for at, shape, dtype in parts:
        name = dtype.encode()
        out += [_PART.pack(at, len(name), len(shape)), name, struct.pack(f"<{len(shape)}q", *shape)]
    out += [cuda_event, endpoint]
    return b"".join(out)


def _unpack(
    data: object, kind: int, what: str
) -> tuple[SenderEndpoint, tuple[int, int, str, int], tuple[Part, ...], bytes]:
    """(endpoint, (seq, slot, where, offset), parts, cuda_event) of a packed handle of kind."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidHandleError(f"{what} must be bytes, not {type(data).__name__}")
    raw = bytes(data)
    if len(raw) > _MAX_BYTES + _MAX_PARTS * (_PART.size + 32 + 8 * _MAX_DIMS):
        raise InvalidHandleError(f"{what} of {len(raw)} bytes is longer than any valid one")
    start = len(_MAGIC) + 1
    if len(raw) < start or not raw.startswith(_MAGIC):
        raise InvalidHandleError(f"these bytes are not an mmcache {what}")
    if raw[len(_MAGIC)] != FORMAT_VERSION:
        raise InvalidHandleError(
            f"{what} of format version {raw[len(_MAGIC)]}; this mmcache reads version "
            f"{FORMAT_VERSION}: run the same mmcache version on both sides"
        )
    try:
        found, seq, slot, where, offset, count, n_event, n_endpoint = _FIXED.unpack_from(raw, start)
        if found != kind:
            other = "batch handle" if found == _KIND_BATCH else "handle"
            raise InvalidHandleError(f"these bytes are an IPC {other}, not an {what}")
        if where not in _WHERE_NAMES or not 1 <= count <= _MAX_PARTS:
            raise InvalidHandleError(f"{what} bytes are corrupt")
        at = start + _FIXED.size
        parts: list[Part] = []
        for _ in range(count):
            part_offset, n_name, ndim = _PART.unpack_from(raw, at)
            at += _PART.size
            name = raw[at : at + n_name].decode("ascii")
            at += n_name
            shape = _SHAPES[ndim].unpack_from(raw, at)
            at += 8 * ndim
            parts.append((part_offset, shape, name))
    except (struct.error, UnicodeDecodeError):
        raise InvalidHandleError(f"{what} bytes are truncated or corrupt") from None
    cuda_event = raw[at : at + n_event]
    endpoint = raw[at + n_event : at + n_event + n_endpoint]
    if len(cuda_event) != n_event or at + n_event + n_endpoint != len(raw):
        raise InvalidHandleError(f"{what} bytes are truncated or corrupt")
    fields = (seq, slot, _WHERE_NAMES[where], offset)
    return _endpoint_of(endpoint), fields, tuple(parts), cuda_event


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
    # Set by from_bytes once check(endpoint_checked=True) passed: the fields cannot change
    # after, so a receiver's check of it again is skipped (a handle made otherwise, also
    # by dataclasses.replace, is checked in full).
    _formed: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the feature."""
        return _part_nbytes(self.shape, self.dtype)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The one feature, as a batch handle lists its features."""
        return ((0, self.shape, self.dtype),)

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

    def check(self, *, endpoint_checked: bool = False) -> None:
        """Raise InvalidHandleError unless every field has its type and range.

        That a handle is well formed says nothing of whether its sender published
        it: the receiver checks that against the sender's control block.
        """
        if not isinstance(self, FeatureHandle):
            raise InvalidHandleError(f"expected a FeatureHandle, got {type(self).__name__}")
        if self._formed and endpoint_checked:
            return
        if not isinstance(self.sender, SenderEndpoint):
            raise InvalidHandleError("a handle's sender must be a SenderEndpoint")
        if not endpoint_checked:
            self.sender.check()
        _check_slice(self.seq, self.slot, self.where, self.offset, self.cuda_event)
        _check_part(self.shape, self.dtype)

    def slice_digest(self) -> int:
        """A 64-bit digest of the dtype, shape and CUDA event, as the sender publishes them."""
        return _feature_digest(self.dtype, self.shape, self.cuda_event)

    def to_bytes(self) -> bytes:
        """The versioned byte form (from_bytes reads it back); about 600 bytes."""
        fields = (self.seq, self.slot, self.where, self.offset)
        return _pack(_KIND_HANDLE, self.sender, fields, self.parts, self.cuda_event)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> FeatureHandle:
        """The handle whose to_bytes() is data; InvalidHandleError for anything else.

        Only the form is checked here; whether the sender published this slice is
        checked by the receiver that serves it.
        """
        sender, (seq, slot, where, offset), parts, event = _unpack(data, _KIND_HANDLE, "IPC handle")
        if len(parts) != 1 or parts[0][0] != 0:
            raise InvalidHandleError("IPC handle bytes are corrupt")
        _, shape, dtype = parts[0]
        handle = cls(sender, seq, slot, where, offset, shape, dtype, event)  # type: ignore[arg-type]
        handle.check(endpoint_checked=True)
        object.__setattr__(handle, "_formed", True)
        return handle

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return _handle_from_bytes, (self.to_bytes(),)


@final
@dataclass(frozen=True, slots=True)
class FeatureBatch:
    """The features of one send_many: one slice, one slot, one publication, one release.

    parts lists each feature as (its offset in the slice, shape, dtype name), in
    the order they were sent; where, offset and cuda_event are as for a FeatureHandle.
    """

    sender: SenderEndpoint
    seq: int
    slot: int
    where: Literal["pool", "host"]
    offset: int
    parts: tuple[Part, ...]
    cuda_event: bytes = b""
    _formed: bool = field(default=False, init=False, repr=False, compare=False)  # as a handle's

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes of the slice the features span (from the first's offset to the last's end:
        check() refuses parts out of order)."""
        at, shape, dtype = self.parts[-1]
        return at + _part_nbytes(shape, dtype)

    def describe(self) -> str:
        """One line naming the batch, for logs and errors (also for a malformed one)."""
        try:
            size = f"{self.nbytes / _MiB:.2f} MiB"
        except (InvalidHandleError, TypeError, ValueError, OverflowError, IndexError):
            size = "?"
        count = len(self.parts) if isinstance(self.parts, tuple) else "?"
        pid = getattr(self.sender, "pid", "?")
        return (
            f"IPC batch #{self.seq!r:.24} of {count} features ({self.where!r:.24} slot "
            f"{self.slot!r:.24}, offset {self.offset!r:.24}, {size}) of sender pid {pid!r:.24}"
        )

    def check(self, *, endpoint_checked: bool = False) -> None:
        """Raise InvalidHandleError unless every field has its type and range, and the
        features lie in order without overlapping, each aligned to its dtype."""
        if not isinstance(self, FeatureBatch):
            raise InvalidHandleError(f"expected a FeatureBatch, got {type(self).__name__}")
        if self._formed and endpoint_checked:
            return
        if not isinstance(self.sender, SenderEndpoint):
            raise InvalidHandleError("a batch handle's sender must be a SenderEndpoint")
        if not endpoint_checked:
            self.sender.check()
        _check_slice(self.seq, self.slot, self.where, self.offset, self.cuda_event)
        if not isinstance(self.parts, tuple) or not 1 <= len(self.parts) <= _MAX_PARTS:
            raise InvalidHandleError(f"a batch handle holds 1 to {_MAX_PARTS} features")
        end = 0
        for part in self.parts:
            if not isinstance(part, tuple) or len(part) != 3:
                raise InvalidHandleError("a batch handle's part is (offset, shape, dtype)")
            at, shape, dtype = part
            nbytes, itemsize = _check_part(shape, dtype)
            _int(at, "a part's offset", end)
            if at % itemsize:
                raise InvalidHandleError(f"a {dtype} part at offset {at} is not aligned")
            end = at + nbytes

    def slice_digest(self) -> int:
        """A 64-bit digest of every part and the CUDA event, as the sender publishes them."""
        return _batch_digest(self.parts, self.cuda_event)

    def to_bytes(self) -> bytes:
        """The versioned byte form (from_bytes reads it back)."""
        fields = (self.seq, self.slot, self.where, self.offset)
        return _pack(_KIND_BATCH, self.sender, fields, self.parts, self.cuda_event)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> FeatureBatch:
        """The batch handle whose to_bytes() is data; InvalidHandleError for anything else."""
        sender, (seq, slot, where, offset), parts, event = _unpack(
            data, _KIND_BATCH, "IPC batch handle"
        )
        batch = cls(sender, seq, slot, where, offset, parts, event)  # type: ignore[arg-type]
        batch.check(endpoint_checked=True)
        object.__setattr__(batch, "_formed", True)
        return batch

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        return _batch_from_bytes, (self.to_bytes(),)


# A sender's sends and a receiver's handles repeat a few shapes and one event per slot: each
# digest is made once (the arguments are checked, hashable fields by then).
@functools.lru_cache(maxsize=_MAX_DIGESTS)
def _feature_digest(dtype: str, shape: tuple[int, ...], cuda_event: bytes) -> int:
    return _digest(f"{dtype}|{','.join(map(str, shape))}|{cuda_event.hex()}".encode())


@functools.lru_cache(maxsize=_MAX_DIGESTS)
def _batch_digest(parts: tuple[Part, ...], cuda_event: bytes) -> int:
    text = ";".join(f"{at}|{dtype}|{','.join(map(str, shape))}" for at, shape, dtype in parts)
    return _digest(f"{text}|{cuda_event.hex()}".encode())


def _handle_from_bytes(data: bytes) -> FeatureHandle:
    return FeatureHandle.from_bytes(data)


def _batch_from_bytes(data: bytes) -> FeatureBatch:
    return FeatureBatch.from_bytes(data)


def _endpoint_from_bytes(data: bytes) -> SenderEndpoint:
    return SenderEndpoint.from_bytes(data)

"""CacheSettings: every knob, read from MMCACHE_* and SGLang environment variables."""

from __future__ import annotations

import difflib
import logging
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, NamedTuple, final

from pydantic import Field, PrivateAttr, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mmcache.errors import SettingsError

__all__ = ["REMOTE_URL_SCHEMES", "SETTINGS_TABLE", "CacheSettings", "SettingRow", "redact_url"]

_MiB: Final = 1024**2

log = logging.getLogger("mmcache")


@final
@dataclass(frozen=True, slots=True)
class _Env:
    """The environment variables a field is read from, the winning one first."""

    names: tuple[str, ...]


@final
@dataclass(frozen=True, slots=True)
class _EnvRead:
    """The variable a field's value was taken from, and its text."""

    name: str
    raw: str


# SGLang reads these with int() (its EnvInt), so a value SGLang would reject must
# not mean something else here; the MMCACHE_ names take fractional MiB.
_SGLANG_INTEGER_NAMES: Final = frozenset({"SGLANG_VLM_CACHE_SIZE_MB", "SGLANG_MM_FEATURE_CACHE_MB"})

#: The longest remote_ttl_sec: Redis and Valkey keep a key's expiry time as milliseconds since
#: 1970 in a signed 64-bit integer, and refuse a SET whose EX or PX would take it past that.
_REMOTE_TTL_MAX_S: Final = 9e15

#: URL schemes of remote_url: one Redis/Valkey server (TCP, TLS, Unix socket) or a cluster
REMOTE_URL_SCHEMES: Final = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class CacheSettings(BaseSettings):
    """Settings of the cache, from keyword arguments, else the environment, else defaults.

    Each field is read from its MMCACHE_ variable, else from the SGLang variable
    of the same knob (see SETTINGS_TABLE). Names are matched exactly (upper
    case, as SGLang does), a variable set to an empty string counts as unset,
    and only the value that wins is validated: an invalid SGLang value is
    ignored when the MMCACHE_ variable or a keyword argument is given. An
    MMCACHE_* variable that is not a setting is ignored, with a warning on the
    mmcache logger (once per variable) naming the setting's variable nearest to
    it; unknown keyword arguments are refused.
    Every invalid value raises SettingsError naming the variable it came from.
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    gpu_cache_mb: Annotated[float, _Env(("MMCACHE_GPU_CACHE_MB", "SGLANG_VLM_CACHE_SIZE_MB"))] = (
        Field(default=1024, ge=0, description="GPU tier budget in MiB; 0 turns the GPU tier off")
    )
    cpu_cache_mb: Annotated[float, _Env(("MMCACHE_CPU_CACHE_MB",))] = Field(
        default=4096, ge=0, description="pinned host tier budget in MiB; 0 turns the host tier off"
    )
    ipc_pool_mb: Annotated[float, _Env(("MMCACHE_IPC_POOL_MB", "SGLANG_MM_FEATURE_CACHE_MB"))] = (
        Field(default=512, ge=0, description="CUDA IPC pool size in MiB; 0 turns the pool off")
    )
    use_cuda_ipc: Annotated[
        bool, _Env(("MMCACHE_USE_CUDA_IPC", "SGLANG_USE_CUDA_IPC_TRANSPORT"))
    ] = Field(default=False, description="hand features to other processes through CUDA IPC")
    ipc_recycle_interval_s: Annotated[
        float,
        _Env(
            (
                "MMCACHE_IPC_RECYCLE_INTERVAL_SEC",
                "SGLANG_MM_ITEM_MEM_POOL_RECYCLE_INTERVAL_SEC",
            )
        ),
    ] = Field(
        default=0.1, gt=0, description="seconds between sweeps that recycle released IPC blocks"
    )
    ipc_lease_timeout_s: Annotated[float, _Env(("MMCACHE_IPC_LEASE_TIMEOUT_SEC",))] = Field(
        default=30.0,
        gt=0,
        description="seconds before an IPC block a consumer never released is reclaimed",
    )
    ipc_fallback_mb: Annotated[float, _Env(("MMCACHE_IPC_FALLBACK_MB",))] = Field(
        default=1024, ge=0, description="host memory in MiB for IPC handoffs when the pool is full"
    )
    ipc_pool_wait_s: Annotated[float, _Env(("MMCACHE_IPC_POOL_WAIT_SEC",))] = Field(
        default=0.002,
        ge=0,
        description="seconds a send waits for receivers to free pool room before the host fallback",
    )
    promote_on_hit: Annotated[bool, _Env(("MMCACHE_PROMOTE_ON_HIT",))] = Field(
        default=True,
        description="move host tier hits back to the GPU tier (promote_policy says which, "
        "when it is full); a promoted feature keeps its host copy",
    )
    promote_policy: Annotated[Literal["tinylfu", "room"], _Env(("MMCACHE_PROMOTE_POLICY",))] = (
        Field(
            default="tinylfu",
            description="which host tier hits a full GPU tier takes: tinylfu (one used more often "
            "lately than the GPU entries it displaces, by a count-min sketch of uses, TinyLFU's "
            "rule; those go back to the host tier, with no copy where they kept a host copy) or "
            "room (none: hits are promoted only into free room)",
        )
    )
    host_share: Annotated[Literal["rank", "node"], _Env(("MMCACHE_HOST_SHARE",))] = Field(
        default="rank",
        description="who shares a host tier: rank (each cache its own) or node (the ranks of "
        "the cache's group= on one machine share one, in /dev/shm: each feature's bytes once "
        "per node; cpu_cache_mb is then the node's, the largest of its ranks')",
    )
    metrics_port: Annotated[int | None, _Env(("MMCACHE_METRICS_PORT",))] = Field(
        default=None,
        ge=0,
        le=65535,
        description="port of the Prometheus HTTP server; unset: no server, 0: any free port",
    )
    metrics_addr: Annotated[str, _Env(("MMCACHE_METRICS_ADDR",))] = Field(
        default="0.0.0.0",
        min_length=1,
        description="address the Prometheus HTTP server binds, the cache's (metrics_port) "
        "and the demo's (--metrics-port) alike; 0.0.0.0: every interface",
    )
    small_copy_bytes: Annotated[int, _Env(("MMCACHE_SMALL_COPY_BYTES",))] = Field(
        default=4 * _MiB,
        ge=0,
        description=(
            "features smaller than this many bytes are offloaded in batched copies and, "
            "as host hits not promoted, uploaded on the reader's stream"
        ),
    )
    host_alignment: Annotated[int, _Env(("MMCACHE_HOST_ALIGNMENT",))] = Field(
        default=512,
        ge=16,
        le=_MiB,
        description="alignment in bytes of host tier blocks; a power of two from 16 (the "
        "largest item size of a dtype, so every block can be read as its dtype) up to 1 MiB",
    )
    evict_ahead: Annotated[float, _Env(("MMCACHE_EVICT_AHEAD",))] = Field(
        default=0.125,
        ge=0,
        le=0.5,
        description="fraction of the GPU tier offloaded beyond what a put needs, so the "
        "next puts find room while copies run",
    )
    copy_timeout_s: Annotated[float, _Env(("MMCACHE_COPY_TIMEOUT_SEC",))] = Field(
        default=60.0, gt=0, description="seconds before a copy still pending is quarantined"
    )
    eviction_policy: Annotated[
        Literal["lru", "lfu", "fifo", "cost"], _Env(("MMCACHE_EVICTION_POLICY",))
    ] = Field(
        default="lru",
        description="which entry each tier gives up first: lru (least recently used), "
        "lfu (least frequently used), fifo (first put) or cost (fewest compute seconds "
        "saved per byte, aged: GreedyDual-Size-Frequency over put's cost= and "
        "get_or_compute's measured time)",
    )
    remote_url: Annotated[str | None, _Env(("MMCACHE_REMOTE_URL",))] = Field(
        default=None,
        description="Redis/Valkey URL of the shared remote tier (redis://, rediss://, unix://, "
        "redis+cluster://host:port,...); unset: no remote tier",
    )
    remote_namespace: Annotated[str, _Env(("MMCACHE_REMOTE_NAMESPACE",))] = Field(
        default="mmcache",
        min_length=1,
        description="names every key on the remote server (<length>:<namespace>:<key>); "
        "caches with different namespaces never see each other's values",
    )
    remote_write: Annotated[Literal["put", "evict", "off"], _Env(("MMCACHE_REMOTE_WRITE",))] = (
        Field(
            default="put",
            description="what goes to the remote tier, in the background: put (every put), "
            "evict (what leaves the host tier) or off (read only)",
        )
    )
    remote_ttl_sec: Annotated[float | None, _Env(("MMCACHE_REMOTE_TTL_SEC",))] = Field(
        default=3600,
        gt=0,
        description="seconds a remote value lives (remote_ttl_sec=None: until the server "
        "evicts it)",
    )
    remote_timeout_sec: Annotated[float, _Env(("MMCACHE_REMOTE_TIMEOUT_SEC",))] = Field(
        default=0.5,
        gt=0,
        description="seconds before a remote operation gives up (a get then misses), "
        "plus remote_timeout_per_mib_sec for each MiB it moves",
    )
    remote_timeout_per_mib_sec: Annotated[float, _Env(("MMCACHE_REMOTE_TIMEOUT_PER_MIB_SEC",))] = (
        Field(
            default=0.05,
            ge=0,
            description="seconds a remote operation may take beyond remote_timeout_sec for "
            "each MiB of the value it moves",
        )
    )
    remote_max_value_mb: Annotated[float, _Env(("MMCACHE_REMOTE_MAX_VALUE_MB",))] = Field(
        default=64, gt=0, description="largest feature in MiB that goes to the remote tier"
    )
    remote_queue_mb: Annotated[float, _Env(("MMCACHE_REMOTE_QUEUE_MB",))] = Field(
        default=256,
        ge=0,
        description="MiB of remote writes queued at most; writes past it are dropped (counted)",
    )

    # Which variable each field was read from, for env_name().
    _env_reads: dict[str, _EnvRead] = PrivateAttr(default_factory=dict)

    if not TYPE_CHECKING:
        # Hidden from type checkers, which then check keyword arguments against the fields.
        def __init__(self, **values: Any) -> None:
            """Validate keyword arguments over the environment over the defaults."""
            self._validate_over_environment(values)

    def _validate_over_environment(self, values: Mapping[str, Any]) -> None:
        """Validate values over the environment over the defaults; remember what was read."""
        _warn_unknown(type(self), os.environ)
        reads = _read_environment(type(self), os.environ, skip=values.keys())
        problems: list[str] = []
        merged: dict[str, Any] = {}
        for field, read in reads.items():
            if read.name in _SGLANG_INTEGER_NAMES:
                try:
                    merged[field] = int(read.raw)
                except ValueError:
                    problems.append(
                        f"{read.name}={_shown(read.raw)} is invalid: must be an integer, as SGLang "
                        f"reads it; set {type(self).env_names(field)[0]} for fractional MiB"
                    )
            else:
                # pydantic strips spaces around numbers but not around booleans.
                merged[field] = read.raw.strip()
        merged.update(values)
        try:
            super().__init__(**merged)
        except ValidationError as exc:
            problems.extend(_explain(type(self), error, reads) for error in exc.errors())
        if problems:
            raise SettingsError("\n".join(problems)) from None
        self._env_reads = reads

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Take values from the constructor only: __init__ reads the environment itself."""
        # pydantic-settings' env source reports an alias by its first name, not the
        # variable it actually read, and cannot apply SGLang's integer rule.
        return (init_settings,)

    @field_validator("host_alignment")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        """Refuse alignments that are not a power of two."""
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @field_validator("metrics_addr")
    @classmethod
    def _bindable_address(cls, value: str) -> str:
        """Refuse addresses that do not resolve: the metrics server would fail at start."""
        try:
            socket.getaddrinfo(value, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (OSError, ValueError) as exc:  # gaierror; UnicodeError for a malformed name
            raise ValueError(
                f"does not resolve to an address to bind ({exc}); give an IP address "
                "(IPv6 without brackets) or a host name"
            ) from None
        return value

    @field_validator("remote_url")
    @classmethod
    def _remote_url(cls, value: str | None) -> str | None:
        """Refuse URLs the remote tier cannot use (an empty string means unset)."""
        if value is not None:
            _check_remote_url(value)
        return value

    @field_validator("remote_ttl_sec")
    @classmethod
    def _ttl_the_server_takes(cls, value: float | None) -> float | None:
        """Refuse times to live the server would refuse on every write."""
        if value is not None and value > _REMOTE_TTL_MAX_S:
            raise ValueError(
                f"must be at most {_REMOTE_TTL_MAX_S:g} s (about 285 million years), the "
                "longest expiry Redis and Valkey accept; unset it for no expiry"
            )
        return value

    @classmethod
    def env_names(cls, field: str) -> tuple[str, ...]:
        """All environment variables field is read from, the winning one first."""
        info = cls.model_fields.get(field)
        if info is None:
            raise SettingsError(
                f"{_shown(field)} is not a setting; settings are {', '.join(cls.model_fields)}"
            )
        for marker in info.metadata:
            if isinstance(marker, _Env):
                return marker.names
        raise AssertionError(f"setting {field!r} declares no environment variable")

    @classmethod
    def env_sets(cls, field: str, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the environment sets field: one of its variables is set and not empty
        (an empty one is unset, as when settings are built)."""
        env = os.environ if environ is None else environ
        return any((env.get(name) or "").strip() for name in cls.env_names(field))

    def env_name(self, field: str) -> str:
        """The environment variable field was read from, else its MMCACHE_ name."""
        read = self._env_reads.get(field)
        return read.name if read is not None else type(self).env_names(field)[0]

    def how_to_change(self, field: str) -> str:
        """How a user changes field: the variable it was read from, the keyword it was given
        as, or (a default) both ways."""
        read = self._env_reads.get(field)
        if read is not None:
            return read.name
        if field in self.model_fields_set:
            return f"CacheSettings({field}=...)"
        return f"{' or '.join(type(self).env_names(field))} (or CacheSettings({field}=...))"

    @property
    def gpu_cache_bytes(self) -> int:
        """GPU tier budget in bytes (rounded down)."""
        return int(self.gpu_cache_mb * _MiB)

    @property
    def cpu_cache_bytes(self) -> int:
        """Pinned host tier budget in bytes (rounded down)."""
        return int(self.cpu_cache_mb * _MiB)

    @property
    def ipc_pool_bytes(self) -> int:
        """CUDA IPC pool size in bytes (rounded down)."""
        return int(self.ipc_pool_mb * _MiB)

    @property
    def remote_max_value_bytes(self) -> int:
        """Largest feature in bytes that goes to the remote tier (rounded down)."""
        return int(self.remote_max_value_mb * _MiB)

    @property
    def remote_queue_bytes(self) -> int:
        """Bytes of remote writes queued at most (rounded down)."""
        return int(self.remote_queue_mb * _MiB)

    @property
    def ipc_fallback_bytes(self) -> int:
        """Host memory bound of the IPC fallback in bytes (rounded down)."""
        return int(self.ipc_fallback_mb * _MiB)


def _check_remote_url(url: str) -> None:
    """Raise ValueError saying why the remote tier cannot use url: its scheme, a port that is
    not one, a cluster seed without a port, a database that is not a number, or anything
    else redis-py's URL parser refuses (when it is installed)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in REMOTE_URL_SCHEMES:
        raise ValueError(
            f"must start with one of {', '.join(s + '://' for s in REMOTE_URL_SCHEMES)}"
        )
    if scheme.endswith("+cluster"):
        for node in split_cluster_url(url).nodes:  # never the password: errors name nodes
            host, colon, port = node.rpartition(":")
            if not colon or not host or node.endswith("]"):
                raise ValueError(f"cluster node {_shown(node)} is not host:port")
            _check_port(port, f"of cluster node {_shown(node)} ")
        return  # the cluster client takes no database, and its own query options
    parts = urllib.parse.urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    if scheme != "unix":
        port = hosts.rpartition("]")[2] if hosts.startswith("[") else hosts
        if ":" in port:
            _check_port(port.rpartition(":")[2], "")
        database = parts.path.strip("/")
        if database and not (database.isascii() and database.isdigit()):
            raise ValueError(f"database {_shown(database)} is not a number (redis://host:port/0)")
    try:
        import redis.connection
    except ImportError:
        return  # FeatureCache says the redis package is missing
    parse_url: Callable[[str], object] = redis.connection.parse_url  # untyped in redis-py
    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"redis-py refuses it: {exc}") from None


class ClusterUrl(NamedTuple):
    """The parts of a redis+cluster:// URL the cluster client takes."""

    username: str | None
    password: str | None
    nodes: list[str]  # "host:port" each, as written
    query: str


def split_cluster_url(url: str) -> ClusterUrl:
    """url's parts, split by hand: urlsplit of Python 3.12 refuses a bracketed host that
    follows another (`redis+cluster://a:7000,[::1]:7001`)."""
    rest = url.partition("://")[2]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    query = rest.partition("?")[2].partition("#")[0]
    userinfo, at, hosts = netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return ClusterUrl(
        username=urllib.parse.unquote(user) if at and user else None,
        password=urllib.parse.unquote(password) if colon else None,
        nodes=[item.strip() for item in hosts.split(",")],
        query=query,
    )


def _check_port(text: str, where: str) -> None:
    """Raise ValueError unless text is a TCP port a server can listen on, 1 to 65535."""
    if not (len(text) <= 5 and text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise ValueError(f"port {_shown(text)} {where}is not a port number from 1 to 65535")


#: MMCACHE_ variables that are not settings: those of the project's scripts and tests, and
#: the one that installs the SGLang adapter in SGLang's processes (mmcache.integrations).
_NOT_SETTINGS: Final = frozenset(
    {
        "MMCACHE_VENV",
        "MMCACHE_TORCH",
        "MMCACHE_GRAFANA_SCHEMA_DIR",
        "MMCACHE_STATEFUL_EXAMPLES",
        "MMCACHE_SGLANG_INSTALL",
    }
)
_PREFIX: Final = len("MMCACHE_")
#: Variables already warned about: each is, once per process.
_warned: set[str] = set()


def _warn_unknown(settings_cls: type[CacheSettings], environ: Mapping[str, str]) -> None:
    """Warn once about each MMCACHE_ variable set that is not a setting's (a misspelt name
    would otherwise be ignored in silence), naming the setting's variable nearest to it."""
    known = [
        name
        for field in settings_cls.model_fields
        for name in settings_cls.env_names(field)
        if name.startswith("MMCACHE_")
    ]
    for name, raw in environ.items():
        if (
            not name.upper().startswith("MMCACHE_")
            or name in known
            or name in _NOT_SETTINGS
            or name in _warned
            or not raw.strip()  # set to nothing counts as unset
        ):
            continue
        _warned.add(name)
        # Past the prefix, which every name shares and which would make any two look alike.
        nearest = difflib.get_close_matches(name.upper()[_PREFIX:], [k[_PREFIX:] for k in known], 1)
        hint = f"did you mean MMCACHE_{nearest[0]}?" if nearest else "`mmcache settings` lists them"
        log.warning("%s is not a setting's variable and is ignored; %s", _cut(name), hint)


def _read_environment(
    settings_cls: type[CacheSettings], environ: Mapping[str, str], skip: Collection[str]
) -> dict[str, _EnvRead]:
    """For each field not in skip, the first of its variables that is set and not empty."""
    reads: dict[str, _EnvRead] = {}
    for field in settings_cls.model_fields:
        if field in skip:
            continue
        for name in settings_cls.env_names(field):
            raw = environ.get(name)
            if raw is not None and raw.strip():
                reads[field] = _EnvRead(name, raw)
                break
    return reads


_REASONS: Final[Mapping[str, str]] = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "finite_number": "must be a finite number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "int_type": "must be an integer",
    "bool_parsing": "must be a boolean (1/0, true/false, yes/no, on/off)",
    "bool_type": "must be a boolean",
    "literal_error": "must be one of {expected}",
    "value_error": "{error}",
}


def _explain(
    settings_cls: type[CacheSettings], error: ErrorDetails, reads: Mapping[str, _EnvRead]
) -> str:
    """One line that names where a bad value came from, the value, and what is expected."""
    field = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "extra_forbidden":
        known = ", ".join(settings_cls.model_fields)
        return f"{_cut(field)}={_shown(error['input'])} is not a setting; settings are {known}"
    read = reads.get(field)
    url = field == "remote_url"  # errors end up in logs: never a password
    if read is not None:
        given = f"{read.name}={_shown(read.raw, url=url)}"
    else:
        given = f"{field}={_shown(error['input'], url=url)}"
    template = _REASONS.get(error["type"])
    ctx = {key: _plain(value) for key, value in error.get("ctx", {}).items()}
    reason = template.format(**ctx) if template else error["msg"]
    info = settings_cls.model_fields.get(field)
    meaning = f" ({info.description})" if info is not None and info.description else ""
    return f"{given} is invalid: {reason}{meaning}"


#: Characters of a value that an error repeats: a longer value is cut, and its length given.
_SHOWN_CHARS: Final = 80


def _shown(value: object, *, url: bool = False) -> str:
    """value as an error repeats it: its repr (with url, any password in it ***), cut to
    _SHOWN_CHARS characters if longer."""
    text = repr(value)
    if url:
        text = redact_url(text)  # before cutting, which could leave part of a password
    return _cut(text, len(value) if isinstance(value, str | bytes) else len(text))


def _cut(text: str, length: int | None = None) -> str:
    """text, or its first _SHOWN_CHARS characters and the length of the whole (length, else
    len(text)) when longer."""
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}… ({len(text) if length is None else length} characters)"


# user:password@ (or :password@) after a URL's scheme
_PASSWORD_IN_URL: Final = re.compile(r"(//[^:/@]*:)[^@/]*@")


def redact_url(text: str) -> str:
    """text with the password of any URL in it replaced by ***, for logs and errors."""
    return _PASSWORD_IN_URL.sub(r"\1***@", text)


def _plain(value: object) -> object:
    """A bound as a user wrote it: pydantic turns ge=0 on a float field into 0.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class SettingRow(NamedTuple):
    """One setting, as docs/reference.md and `mmcache settings` list it."""

    field: str
    env_names: tuple[str, ...]
    default: float | int | bool | None
    description: str


def _settings_table() -> tuple[SettingRow, ...]:
    """Rows for every CacheSettings field, in declaration order."""
    return tuple(
        SettingRow(field, CacheSettings.env_names(field), info.default, info.description or "")
        for field, info in CacheSettings.model_fields.items()
    )


#: Every setting: field, environment variables (winning first), default, meaning.
SETTINGS_TABLE: Final[tuple[SettingRow, ...]] = _settings_table()

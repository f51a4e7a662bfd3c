"""MMCacheECConnector: mmcache as vLLM's encoder-cache connector (vLLM 0.33.0).

vLLM loads an EC connector by name from `--ec-transfer-config` and runs one instance per
process: the scheduler side decides which encoder outputs come from the connector instead
of the encoder, the worker side saves the outputs it computed and loads the ones the
scheduler named. Here a producer's worker puts each encoder output into a `FeatureCache`
whose remote tier (`remote_url`) shares it through Redis/Valkey; a consumer's scheduler
asks that server which outputs exist, and its worker reads them back onto its device.

    --ec-transfer-config '{"ec_connector": "MMCacheECConnector",
      "ec_connector_module_path": "mmcache.integrations.vllm", "ec_role": "ec_both",
      "ec_connector_extra_config": {"remote_url": "redis://host:6379", "gpu_cache_mb": 2048}}'

`ec_connector_extra_config` holds `CacheSettings` fields, plus `device` (the cache's
device, "cuda" by default; "sim" runs without a GPU) and `model` (the key namespace,
by default the served model's name).

With tensor parallelism each worker runs its own connector and cache, and needs no
agreement between them (unlike SGLang's ranks, see FeatureCache's group=): vLLM's
scheduler decides once which outputs are loaded and which are encoded, and sends every
worker the same step. Each worker loads its outputs from the remote tier by itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import reprlib
import threading
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeGuard, final

import torch

from mmcache.cache import FeatureCache
from mmcache.core.entry import check_key
from mmcache.errors import InvalidKeyError, MMCacheError, SettingsError
from mmcache.integrations import IntegrationError
from mmcache.integrations.loop_thread import LoopThread
from mmcache.remote.codec import server_key
from mmcache.remote.faults import Faults
from mmcache.settings import CacheSettings, redact_url

try:
    import vllm
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
        ECConnectorWorkerMetadata,
    )
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorPromMetrics,
        ECConnectorStats,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise IntegrationError(
        f"mmcache.integrations.vllm needs vllm 0.33.0 ({exc}); "
        "install it with `pip install vllm==0.33.0` (bash scripts/install_vllm.sh on a CPU machine)"
    ) from exc

if TYPE_CHECKING:
    from mmcache.remote.store import RemoteStore

__all__ = [
    "MAX_PENDING_SAVES",
    "TESTED_VERSION",
    "MMCacheECConnector",
    "MMCacheECConnectorMetadata",
    "MMCacheECConnectorStats",
    "MMCacheECWorkerMetadata",
]

log = logging.getLogger("mmcache")

#: The vLLM release whose ECConnectorBase the connector was written and tested against.
TESTED_VERSION: Final = "0.33.0"
#: ec_connector_extra_config keys the connector reads itself; every other key is a setting.
_OWN_KEYS: Final = frozenset({"device", "model"})
#: Counters of MMCacheECConnectorStats, summed across workers and intervals.
STAT_NAMES: Final = (
    "lookups",
    "lookup_hits",
    "lookup_errors",
    "saves",
    "save_failures",
    "loads",
    "load_misses",
    "load_bytes",
)
#: Saves handed to the cache's loop and not done yet, at most; past it a save is dropped
#: (counted in save_failures) so that a slow cache cannot pin the runner's outputs unbounded.
MAX_PENDING_SAVES: Final = 64


@final
@dataclasses.dataclass(frozen=True, slots=True)
class LoadItem:
    """One encoder output the worker loads: its mm hash and the request that needs it."""

    mm_hash: str
    request_id: str


@final
@dataclasses.dataclass
class MMCacheECConnectorMetadata(ECConnectorMetadata):
    """What the scheduler side tells the worker side for one step: the outputs to load."""

    loads: list[LoadItem] = dataclasses.field(default_factory=list)


@final
@dataclasses.dataclass
class MMCacheECWorkerMetadata(ECConnectorWorkerMetadata):
    """What a worker tells the scheduler: requests whose outputs it could not load."""

    unavailable: set[str] = dataclasses.field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """The union of both workers' unavailable requests."""
        assert isinstance(other, MMCacheECWorkerMetadata)
        return MMCacheECWorkerMetadata(self.unavailable | other.unavailable)


@final
@dataclasses.dataclass
class MMCacheECConnectorStats(ECConnectorStats):
    """The connector's counters for an interval (STAT_NAMES), summed when aggregated."""

    def reset(self) -> None:
        """Zero every counter."""
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        """Add other's counters to these."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, as logged."""
        return {name: self.data.get(name, 0) for name in STAT_NAMES}

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())


class _PromMetrics(ECConnectorPromMetrics):
    """One Prometheus counter per STAT_NAMES entry, labelled by engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:mmcache_ec_{name}",
                documentation=f"MMCacheECConnector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            for name in STAT_NAMES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add an interval's counters to the engine's series."""
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)


def _bad_identifier(identifier: object) -> None:
    log.warning(
        "MMCacheECConnector: %s is not an mm hash (a str): answered as not cached",
        reprlib.repr(identifier),
    )


class MMCacheECConnector(ECConnectorBase):
    """vLLM's EC connector on mmcache: encoder outputs shared through its remote tier.

    Scheduler side: has_cache_item asks the remote server (the items of a request in one
    batch, within remote_timeout_sec; a server that fails answers False and is backed off
    from). Worker side: save_caches hands the output to the cache's loop without waiting;
    start_load_caches reads the outputs the scheduler named onto the device, ordered on
    the caller's current stream. Each instance owns a loop on a thread of its own.
    """

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        extra = dict(transfer.ec_connector_extra_config)
        device = str(extra.get("device", "cuda"))
        model = extra.get("model") or getattr(vllm_config.model_config, "model", None)
        if not model:
            raise SettingsError(
                "MMCacheECConnector needs the model's name for its key namespace: serve a "
                'model, or set "model" in ec_connector_extra_config'
            )
        self._model = str(model)
        try:
            self._settings = CacheSettings(**{k: v for k, v in extra.items() if k not in _OWN_KEYS})
        except ValueError as exc:
            raise SettingsError(
                f"ec_connector_extra_config holds CacheSettings fields plus 'device' and "
                f"'model': {exc}"
            ) from exc
        self._name = f"vllm-ec-{role.name.lower()}-{transfer.engine_id}"
        self._loop = LoopThread(f"mmcache-{self._name}")
        self._lock = threading.Lock()  # counters are bumped from the loop and vLLM's thread
        self._stats: dict[str, int] = {}
        self._closed = False
        # Scheduler side.
        self._store: RemoteStore | None = None
        self._known: dict[str, bool] = {}  # this step's answers of the remote server
        # Backs off from a server that fails; logs each outage when it starts and ends.
        self._faults = Faults(
            f"{redact_url(self._settings.remote_url or '')} ({self._name})",
            lambda kind: None,
            self._settings.remote_timeout_sec,
        )
        self._loads: list[LoadItem] = []
        self._unavailable: set[str] = set()
        # Worker side.
        self._cache: FeatureCache | None = None
        self._saving: set[concurrent.futures.Future[None]] = set()
        self._loaded: set[str] = set()
        self._missed: set[str] = set()
        try:
            if role == ECConnectorRole.WORKER:
                self._cache = FeatureCache(self._settings, device=device, name=self._name)
                self._loop.run(self._cache.start())
            elif self._settings.remote_url is not None and self.is_consumer:
                from mmcache.remote.redis_store import RedisStore

                self._store = RedisStore(
                    self._settings.remote_url, self._settings.remote_timeout_sec
                )
        except BaseException:
            self._loop.stop()
            raise

    # --- keys and stats -----------------------------------------------------------------

    def cache_key(self, mm_hash: str) -> Hashable:
        """The cache key of an encoder output: its mm hash, namespaced by model."""
        return ("vllm-ec", self._model, mm_hash)

    def _is_mm_hash(self, mm_hash: object) -> TypeGuard[str]:
        """Whether mm_hash is one the connector can share: a str (as vLLM's mm hashes and
        identifiers are) whose cache key the cache can hold."""
        if not isinstance(mm_hash, str):
            return False
        try:
            check_key(self.cache_key(mm_hash))
        except InvalidKeyError:
            return False
        return True

    @property
    def cache(self) -> FeatureCache | None:
        """The worker side's cache (None on the scheduler side)."""
        return self._cache

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + n

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        """The counters since the last call (None if nothing happened), then zeroed."""
        with self._lock:
            data, self._stats = self._stats, {}
        return MMCacheECConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_ec_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ECConnectorStats | None:
        """Stats from the dict vLLM aggregated across workers."""
        return MMCacheECConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics | None:
        """Counters vllm:mmcache_ec_<name> for each of STAT_NAMES."""
        return _PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- worker side --------------------------------------------------------------------

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Put encoder_cache[mm_hash] into the cache on its loop; returns without waiting.

        The cache holds the tensor itself (vLLM only reads it): on a GPU it counts against
        gpu_cache_mb, memory vLLM's own profiling does not see. Never raises: an mm_hash that
        is not an mm hash (a str), or that encoder_cache holds no tensor under, is counted in
        save_failures and logged; other saves go on.
        """
        if not self.is_producer or self._cache is None or self._closed:
            return
        if not self._is_mm_hash(mm_hash):
            self._refuse_save(mm_hash, "is not an mm hash (a str)")
            return
        value = encoder_cache.get(mm_hash)
        if not isinstance(value, torch.Tensor):
            where = "not in" if value is None else f"a {type(value).__name__}, not a tensor, in"
            self._refuse_save(mm_hash, f"is {where} the encoder cache")
            return
        with self._lock:
            full = len(self._saving) >= MAX_PENDING_SAVES
        if full:
            self._count("save_failures")
            return
        stream = self._cache.device.current_stream()  # the runner's: streams are per thread
        future = asyncio.run_coroutine_threadsafe(
            self._save(self._cache, self.cache_key(mm_hash), value, stream),
            self._loop.loop,
        )
        with self._lock:
            self._saving.add(future)
        future.add_done_callback(self._saved)

    async def _save(
        self, cache: FeatureCache, key: Hashable, value: torch.Tensor, stream: Any
    ) -> None:
        try:
            done = await cache.put(key, value, stream=stream)
        except MMCacheError as exc:
            log.warning("MMCacheECConnector: saving %r failed: %s", key, str(exc))
            done = False
        self._count("saves" if done else "save_failures")

    def _refuse_save(self, mm_hash: object, why: str) -> None:
        log.warning("MMCacheECConnector: not saving %s: it %s", reprlib.repr(mm_hash), why)
        self._count("save_failures")

    def _saved(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._saving.discard(future)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every save so far is in the cache and written to the remote tier."""
        with self._lock:
            pending = list(self._saving)
        concurrent.futures.wait(pending, timeout)
        if self._cache is not None and not self._closed:
            self._loop.run(asyncio.wait_for(self._cache.drain(), timeout))

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Fill encoder_cache with the outputs the step's metadata names, on the device.

        Each tensor is usable on the caller's current stream. An output the cache no longer
        has is left out and its request reported unavailable (vLLM fails it; re-issued, it
        is encoded again). So is a malformed load item's (its mm hash not a str, say),
        logged: the step's other requests are served. Metadata that is not this
        connector's raises IntegrationError.
        """
        metadata = self._connector_metadata
        if not isinstance(metadata, MMCacheECConnectorMetadata):
            raise IntegrationError(
                f"MMCacheECConnector's worker was given {type(metadata).__name__} as the step's "
                "connector metadata, not MMCacheECConnectorMetadata: the scheduler's "
                "ec_connector must be MMCacheECConnector as well"
            )
        if self._cache is None or not metadata.loads:
            return
        wanted: list[tuple[str, str]] = []  # (mm hash, request id)
        for item in metadata.loads:
            mm_hash = getattr(item, "mm_hash", None)
            request_id = getattr(item, "request_id", None)
            if not isinstance(request_id, str):
                log.warning("MMCacheECConnector: a load item of no request: %s", reprlib.repr(item))
                self._count("load_misses")
            elif not self._is_mm_hash(mm_hash):
                log.warning(
                    "MMCacheECConnector: request %s names %s, not an mm hash (a str), to load",
                    request_id,
                    reprlib.repr(mm_hash),
                )
                self._count("load_misses")
                self._missed.add(request_id)
            elif mm_hash not in encoder_cache:
                wanted.append((mm_hash, request_id))
        hashes = list(dict.fromkeys(mm_hash for mm_hash, _ in wanted))
        if not hashes:
            return
        found = self._load(self._cache, hashes)
        for mm_hash, tensor in zip(hashes, found, strict=True):
            if tensor is not None:
                encoder_cache[mm_hash] = tensor
                self._count("loads")
                self._count("load_bytes", tensor.nbytes)
            else:
                self._count("load_misses")
        for mm_hash, request_id in wanted:
            if mm_hash in encoder_cache:
                self._loaded.add(request_id)
            else:
                self._missed.add(request_id)

    def _load(self, cache: FeatureCache, hashes: list[str]) -> list[torch.Tensor | None]:
        """The outputs of hashes on the device (None where missed), read in one batch; where
        the batch fails, read one by one, so that a failure misses only its own output."""
        stream = cache.device.current_stream()
        keys = [self.cache_key(h) for h in hashes]
        try:
            return self._loop.run(cache.get_many(keys, stream=stream))
        except MMCacheError as exc:
            log.warning(
                "MMCacheECConnector: loading %d outputs together failed: %s", len(keys), str(exc)
            )
            if len(keys) == 1:
                return [None]
        found: list[torch.Tensor | None] = []
        for mm_hash, key in zip(hashes, keys, strict=True):
            try:
                found.append(self._loop.run(cache.get(key, stream=stream)))
            except MMCacheError as exc:
                log.warning("MMCacheECConnector: loading %s failed: %s", mm_hash, str(exc))
                found.append(None)
        return found

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose loads finished since the last call): saves never hold
        a request back, and loads finish inside start_load_caches."""
        loaded, self._loaded = self._loaded, set()
        return None, loaded or None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """The requests whose outputs could not be loaded this step, if any."""
        if not self._missed:
            return None
        missed, self._missed = self._missed, set()
        return MMCacheECWorkerMetadata(missed)

    # --- scheduler side -----------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the remote server holds this output (False when it cannot say in time).

        Never raises: an identifier that is not an mm hash (a str) is False, logged, and
        never asked of the server. A producer-only instance answers False without asking:
        vLLM encodes what it answers False for, and it loads nothing.
        """
        if not self.is_consumer:
            return False
        if not self._is_mm_hash(identifier):
            _bad_identifier(identifier)
            return False
        known = self._known.get(identifier)
        if known is None:
            known = self._lookup([identifier])[identifier]
        return known

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Ask the server about all of request's items in one batch; never defers it.

        Items whose identifier is not an mm hash are left out (has_cache_item answers False
        for them); the others are asked. A producer-only instance asks nothing.
        """
        if self.is_consumer:
            self._lookup(getattr(f, "identifier", None) for f in request.mm_features)
        return True

    def _lookup(self, identifiers: Iterable[object]) -> dict[str, bool]:
        """The server's answers for identifiers not asked this step, remembered for the step;
        identifiers that are not mm hashes are left out."""
        ids = [i for i in identifiers if self._is_mm_hash(i)]
        ids = [i for i in dict.fromkeys(ids) if i not in self._known]
        if ids:
            answers = self._ask(ids)
            self._count("lookups", len(ids))
            self._count("lookup_hits", sum(answers))
            self._known.update(zip(ids, answers, strict=True))
        return self._known

    def _ask(self, ids: list[str]) -> list[bool]:
        store = self._store
        if store is None or self._closed or not self._faults.available():
            return [False] * len(ids)
        keys = [server_key(self._settings.remote_namespace, self.cache_key(i)) for i in ids]

        async def ask() -> list[bool]:
            found = asyncio.gather(*(store.exists(k) for k in keys))
            return list(await asyncio.wait_for(found, self._settings.remote_timeout_sec))

        try:
            answers = self._loop.run(ask())
        except Exception as exc:  # a server down, slow or failing: every answer is False
            self._count("lookup_errors")
            self._faults.failed("exists", exc)
            return [False] * len(ids)
        self._faults.succeeded()
        return answers

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """Schedule a load of the request's index-th item if this consumer can get it."""
        mm_hash = request.mm_features[index].identifier
        if self.is_consumer and self.has_cache_item(mm_hash):
            self._loads.append(LoadItem(mm_hash, request.request_id))

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        """The step's loads for the worker; the next step starts with none and asks anew."""
        metadata = MMCacheECConnectorMetadata(self._loads)
        self._loads = []
        self._known = {}
        return metadata

    def update_connector_output(self, connector_output: Any) -> None:
        """Take note of the requests the workers could not load."""
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, MMCacheECWorkerMetadata):
            self._unavailable |= meta.unavailable

    def take_unavailable_requests(self) -> set[str]:
        """The requests whose outputs a worker could not load (vLLM fails them)."""
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    # --- lifecycle ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish pending saves, close the cache or the server connection, stop the loop."""
        if self._closed:
            return
        try:
            with self._lock:
                pending = list(self._saving)
            concurrent.futures.wait(pending, self._settings.remote_timeout_sec + 1)
            if self._cache is not None:
                self._loop.run(self._cache.close())
            if self._store is not None:
                self._loop.run(self._store.close())
        finally:
            self._closed = True
            self._loop.stop()


# The version check runs at import so that a mismatch is clear before vLLM calls anything.
if vllm.__version__ != TESTED_VERSION:  # pragma: no cover - depends on the environment
    log.warning(
        "mmcache.integrations.vllm was tested with vllm %s; this is %s",
        TESTED_VERSION,
        vllm.__version__,
    )

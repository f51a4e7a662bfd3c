"""MMCacheMultimodalCache: mmcache as SGLang's multimodal embedding cache (sglang 0.5.23).

SGLang's scheduler keeps one `MultimodalCache` in `sglang.srt.managers.mm_schedule`
(`embedding_cache`, built by `init_mm_embedding_cache(max_size)`) and calls it
synchronously from its own thread. The adapter behaves as SGLang's own
`MultiModalStaticCache` does for those callers (LRU within `max_size` bytes, views stored
compact, an existing key refreshed on set), and adds the pinned host tier: what SGLang
would drop is offloaded and comes back on a hit. `install()` puts it in SGLang's place.

With tensor parallelism every rank's scheduler builds its own cache, and every rank's
model runner looks the same items up. Given the ranks' group (install() finds SGLang's
attention-TP group), `get` and `get_single` are collectives whose hits every rank agrees
on, so that no rank skips the vision encoder while the others run it.

Install SGLang with `pip install sglang==0.5.23` into mmcache's environment on a GPU
machine: it brings the torch it pins, which mmcache takes (any torch 2.4 or later). In a
checkout without a GPU, `bash scripts/install_integrations.sh` puts sglang 0.5.23 into
.venv without its dependencies (they pin another torch and need a GPU): enough for
examples/sglang_embedding_cache.py and the tests, not to serve a model.

Launch SGLang with `python -m mmcache.integrations.sglang <launch_server's arguments>`
(see `launch`): SGLang spawns its scheduler processes, and each of them installs the
adapter through mmcache's SGLang plugin before it builds its embedding cache.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import logging
import numbers
import os
import reprlib
import runpy
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Literal, final

import torch
from prometheus_client import CollectorRegistry

from mmcache.agreement import check_group
from mmcache.cache import FeatureCache
from mmcache.core.entry import check_key
from mmcache.device import Device, Stream
from mmcache.errors import InvalidKeyError, InvalidValueError, SettingsError
from mmcache.integrations import (
    SGLANG_INSTALL_VARIABLE,
    SGLANG_PLUGIN,
    SGLANG_PLUGIN_GROUP,
    SGLANG_PLUGIN_NAME,
    IntegrationError,
)
from mmcache.integrations.loop_thread import LoopThread
from mmcache.settings import CacheSettings

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:
    import sglang
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult, MultimodalCache
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise IntegrationError(
        f"mmcache.integrations.sglang needs sglang 0.5.23 ({exc}); install it with "
        "`pip install sglang==0.5.23` (bash scripts/install_integrations.sh on a CPU machine)"
    ) from exc

__all__ = ["TESTED_VERSION", "Installation", "MMCacheMultimodalCache", "install", "launch", "main"]

#: The SGLang release whose seam and cache semantics the adapter was tested against.
TESTED_VERSION: Final = "0.5.23"
_MiB: Final = 1024 * 1024
_SEAM_MODULE: Final = "sglang.srt.managers.mm_schedule"
#: MultimodalCache's abstract methods in the tested release: the adapter implements these.
_ABSTRACT: Final = frozenset({"__init__", "get", "set", "has", "free", "clear", "available_size"})
_counter = iter(range(1, sys.maxsize))
_UNKNOWN: Final = object()  # no shell kept for a key: the adapter has not cached it
log = logging.getLogger("mmcache")


def _data_bytes(tensor: torch.Tensor) -> int:
    """The bytes SGLang charges an embedding before storing it (its data, not a whole batch)."""
    return min(tensor.untyped_storage().nbytes(), tensor.element_size() * tensor.numel())


def _cache_key(mm_hash: object) -> Hashable | None:
    """mm_hash as the cache's key, or None where the cache cannot hold it.

    An integer of another type (numpy's, a bool) is the int it equals: SGLang's dict finds
    np.int64(5) under 5.
    """
    if type(mm_hash) is not int and isinstance(mm_hash, numbers.Integral):
        mm_hash = int(mm_hash)
    try:
        check_key(mm_hash)
    except InvalidKeyError:
        return None
    return mm_hash  # check_key passed: a str, bytes, int, or a tuple of these


def _check_max_size(max_size: object) -> None:
    """Refuse a max_size that is not a byte count (InvalidValueError)."""
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
        raise InvalidValueError(
            f"max_size is a byte count >= 0 (SGLANG_VLM_CACHE_SIZE_MB * 2**20), not {max_size!r}"
        )


def _check_settings(settings: object) -> None:
    """Refuse settings that are neither None nor a CacheSettings (SettingsError)."""
    if settings is not None and not isinstance(settings, CacheSettings):
        raise SettingsError(
            f"settings is a CacheSettings (or None), not {type(settings).__name__}: "
            "build one with CacheSettings(**values)"
        )


def _adapter_settings(max_size: int, settings: CacheSettings | None) -> CacheSettings:
    """The cache's settings: a GPU tier of exactly max_size bytes, the rest from settings."""
    base = settings if settings is not None else CacheSettings()
    values = base.model_dump()
    values["gpu_cache_mb"] = max_size / _MiB  # exact: MiB is a power of two
    if base.cpu_cache_bytes == 0:
        # Evicting ahead helps only where a host tier takes the victims: without one it
        # would drop entries SGLang keeps.
        values["evict_ahead"] = 0.0
    return CacheSettings(**values)


class MMCacheMultimodalCache(MultimodalCache):  # type: ignore[misc]
    """SGLang's multimodal embedding cache, kept by mmcache's GPU and pinned host tiers.

    Every method is synchronous and may be called from any thread: the cache's event loop
    runs on a thread the adapter owns. A returned embedding is ordered on the calling
    thread's current stream (no host synchronisation on a GPU hit). A hit on the GPU tier
    is served from the calling thread (FeatureCache.get_resident_threadsafe); every other
    call waits for the loop's thread. `close()` stops it.

    With group= (the TP ranks' gloo group, SGLang's `attn_tp_group.cpu_group`), `get` and
    `get_single` are collectives: every rank calls them for the same items in the same
    order, as SGLang's model runners do, and every rank gets the same hits. `set`, `has`,
    `free` and `clear` stay local.
    """

    def __init__(
        self,
        max_size: int,
        *,
        settings: CacheSettings | None = None,
        device: str | Device = "cuda",
        name: str | None = None,
        registry: CollectorRegistry | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        _check_max_size(max_size)
        _check_settings(settings)
        super().__init__()
        self.max_size = max_size
        name = name if name is not None else f"sglang-{next(_counter)}"
        self._cache = FeatureCache(
            _adapter_settings(max_size, settings),
            device,
            name=name,
            registry=registry,
            group=group,
        )
        self._device = self._cache.device
        # Per key, the caller's EmbeddingResult less its tensor, where it is a subclass that
        # carries more (EVS's frame counts); also the keys clear() must discard. Changed on
        # the loop's thread only; read by callers' threads for their GPU hits, under
        # _shells with the read of the tensor, which a set() takes to forget a key's old
        # shell before it puts the key again: so a hit never pairs one value's tensor with
        # another's shell.
        self._known: dict[Hashable, EmbeddingResult | None] = {}
        self._shells = threading.Lock()
        self._thread_hits = group is None  # with a group, a get is a collective: the loop's
        self._loop = LoopThread(f"mmcache-{name}")
        try:
            self._loop.run(self._cache.start())
        except BaseException:
            self._loop.stop()
            raise
        self._close_lock = threading.Lock()
        self._closed = False

    @property
    def feature_cache(self) -> FeatureCache:
        """The FeatureCache underneath (its stats(), metrics); call it on its loop only."""
        return self._cache

    # --- SGLang's MultimodalCache API ------------------------------------------------------

    def get(self, mm_hashes: list[int], combined_hash: int | None = None) -> EmbeddingResult | None:
        """The embedding cached under the combined hash of mm_hashes, or None.

        As SGLang's static cache does, combined_hash is recomputed from mm_hashes
        (combine_hashes) and individual hashes are not looked up. mm_hashes that do not
        combine (not a list, or holding an unhashable item) are a miss.
        """
        try:
            key = self.combine_hashes(mm_hashes)
        except TypeError:
            return None  # nothing can be cached under them
        if key is None:
            return None
        stream = self._device.current_stream()
        hit = self._resident(key, stream)
        if hit is not None:
            return hit
        return self._loop.run(self._get(key, stream), eager=True)

    def get_single(self, mm_hash: int) -> EmbeddingResult | None:
        """The embedding cached under mm_hash, or None; a hit refreshes its recency.

        An mm_hash that is not a key the cache can hold (see set) is a miss.
        """
        key = _cache_key(mm_hash)
        if key is None:
            return None
        stream = self._device.current_stream()
        hit = self._resident(key, stream)
        if hit is not None:
            return hit
        return self._loop.run(self._get(key, stream), eager=True)

    def set(
        self, mm_hash: int, embedding: EmbeddingResult, loc: torch.Tensor | None = None
    ) -> bool:
        """Cache embedding under mm_hash; True if cached (or already there, refreshed).

        False, storing nothing, when it is larger than max_size, empty, not on the cache's
        device, or not a dense strided tensor (sparse, nested, mkldnn): SGLang's caller then
        uses it uncached. A view is stored compact. The caller may keep using
        embedding.embedding but must not write to it. Raises InvalidValueError, storing
        nothing, where embedding is not an EmbeddingResult or its embedding not a tensor.

        mm_hash is an int, as SGLang's hashes are; an integer of another type (numpy's, a
        bool) is the int it equals, as in SGLang's dict. A str, bytes or a tuple of these
        is a key too. Any other mm_hash (None, a float, a list) answers False, logged:
        the cache cannot hold it, and every lookup of it is a miss.
        """
        if not isinstance(embedding, EmbeddingResult):
            raise InvalidValueError(
                f"set() takes an sglang EmbeddingResult, not {type(embedding).__name__}"
            )
        tensor = embedding.embedding
        if not isinstance(tensor, torch.Tensor):
            raise InvalidValueError(
                "set() takes an EmbeddingResult whose embedding is a torch.Tensor, not "
                f"{type(tensor).__name__}"
            )
        shell: EmbeddingResult | None = None
        if type(embedding) is not EmbeddingResult:
            shell = copy.copy(embedding)
            object.__setattr__(shell, "embedding", None)
        key = _cache_key(mm_hash)
        if key is None:
            log.warning(
                "MMCacheMultimodalCache: not caching under %s: an mm_hash is an int",
                reprlib.repr(mm_hash),
            )
            return False
        stream = self._device.current_stream()
        return self._loop.run(self._set(key, tensor, shell, stream), eager=True)

    def has(self, mm_hash: int) -> bool:
        """Whether mm_hash is cached (in either tier); does not refresh its recency.

        False for an mm_hash that is not a key the cache can hold (see set).
        """
        key = _cache_key(mm_hash)
        return key is not None and self._loop.run(self._has(key), eager=True)

    def free(self, mm_hash: int, mm_embedding_allocator: object = None) -> bool:
        """Remove mm_hash; True if it was cached. The allocator is not used (as in SGLang).

        False for an mm_hash that is not a key the cache can hold (see set).
        """
        key = _cache_key(mm_hash)
        return key is not None and self._loop.run(self._free(key), eager=True)

    def clear(self) -> None:
        """Remove every entry."""
        self._loop.run(self._clear(), eager=True)

    def available_size(self) -> int:
        """The number of cached entries, which is what SGLang's static cache reports."""
        return len(self)

    def __len__(self) -> int:
        return self._loop.run(self._len(), eager=True)

    def close(self) -> None:
        """Close the cache (finishing its copies) and stop its loop thread; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._loop.alive:
                self._loop.run(self._cache.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> MMCacheMultimodalCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- on the caller's thread -------------------------------------------------------------

    def _resident(self, key: Hashable, stream: Stream) -> EmbeddingResult | None:
        """key's embedding if it is resident on the device, read from this thread; None:
        ask the loop (a miss, a host hit, or anything the thread path leaves to it)."""
        if not self._thread_hits:
            return None
        with self._shells:
            shell = self._known.get(key, _UNKNOWN)
            if shell is _UNKNOWN:
                return None
            tensor = self._cache.get_resident_threadsafe(key, stream=stream)
        if tensor is None:
            return None
        return self._result(tensor, shell)

    # --- on the loop's thread --------------------------------------------------------------

    async def _get(self, key: Hashable, stream: Stream) -> EmbeddingResult | None:
        if not self._thread_hits:  # a group: a collective, whose hits every rank agreed on
            return await self._agreed_get(key, stream)
        shell = self._known.get(key, _UNKNOWN)
        tensor = await self._cache.get(key, stream=stream)
        if tensor is None:
            if key not in self._cache:  # with a group, a miss may still be held here
                self._known.pop(key, None)
            return None
        if self._known.get(key, _UNKNOWN) is not shell:
            # Freed or set again while the get waited (a host hit's upload): the tensor
            # may be either value, so neither shell can be told to be its. A miss: SGLang
            # encodes the image again.
            return None
        return self._result(tensor, None if shell is _UNKNOWN else shell)

    async def _agreed_get(self, key: Hashable, stream: Stream) -> EmbeddingResult | None:
        """_get with a group: the shell is read with the tensor, inside the agreement, so that
        an agreed hit is served here too, though its key is freed or set meanwhile."""
        tensor, shell = await self._cache._get_noting(
            key, stream, functools.partial(self._known.get, key, _UNKNOWN)
        )
        if tensor is None:
            if key not in self._cache:  # a miss may still be held here
                self._known.pop(key, None)
            return None
        return self._result(tensor, None if shell is _UNKNOWN else shell)

    @staticmethod
    def _result(tensor: torch.Tensor, shell: EmbeddingResult | None) -> EmbeddingResult:
        """The EmbeddingResult of a hit: the caller's subclass, where it gave one."""
        if shell is None:
            return EmbeddingResult(embedding=tensor)
        out = copy.copy(shell)
        object.__setattr__(out, "embedding", tensor)
        return out

    async def _set(
        self,
        key: Hashable,
        tensor: torch.Tensor,
        shell: EmbeddingResult | None,
        stream: Stream,
    ) -> bool:
        cache = self._cache
        if cache.touch(key):  # refreshes its recency, as SGLang's does; never a collective
            return True
        if tensor.layout is not torch.strided or tensor.is_nested:
            # The cache holds dense strided tensors only; such a tensor has no storage of
            # its size to charge (sizing a sparse one raises inside torch).
            log.warning(
                "MMCacheMultimodalCache: not caching %r: its embedding is a %s tensor, not a "
                "dense strided one",
                key,
                "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch."),
            )
            return False
        nbytes = _data_bytes(tensor)
        if nbytes == 0 or nbytes > self.max_size or not self._device.is_device_tensor(tensor):
            return False  # SGLang's caller then uses the embedding it has, uncached
        with self._shells:
            # The key is not cached (touch said so): a shell kept for it is an earlier
            # value's, which a thread's hit on the new one must not take (see __init__).
            self._known.pop(key, None)
        if not await cache.put(key, tensor, stream=stream):
            return False
        self._known[key] = shell
        self._forget_evicted()
        return True

    async def _has(self, key: Hashable) -> bool:
        return key in self._cache

    async def _free(self, key: Hashable) -> bool:
        self._known.pop(key, None)
        return self._cache.discard(key)

    async def _clear(self) -> None:
        known, self._known = self._known, {}
        for key in known:
            self._cache.discard(key)

    async def _len(self) -> int:
        return len(self._cache)

    def _forget_evicted(self) -> None:
        """Drop what is kept for keys the cache has since evicted, once they outnumber it."""
        cache = self._cache
        if len(self._known) > 2 * len(cache) + 1024:
            self._known = {key: shell for key, shell in self._known.items() if key in cache}


# --- install ---------------------------------------------------------------------------------


@final
@dataclasses.dataclass(slots=True, eq=False)
class Installation:
    """What install() changed in SGLang; uninstall() puts SGLang's own cache back."""

    module: ModuleType
    original: Callable[..., None]
    rebound: list[ModuleType]
    settings: CacheSettings | None
    device: str | Device
    tp_group: object = "auto"
    cache: MMCacheMultimodalCache | None = None

    def init_cache(self, max_size: int = 0) -> None:
        """SGLang's init_mm_embedding_cache(max_size), building the adapter instead.

        A max_size that is not a byte count raises InvalidValueError and leaves the cache
        already built in place.
        """
        _check_max_size(max_size)
        group = _resolve_group(self.tp_group)
        old, self.cache = self.cache, None
        if old is not None:
            old.close()
        self.cache = MMCacheMultimodalCache(
            max_size, settings=self.settings, device=self.device, group=group
        )
        seam: Any = self.module
        seam.embedding_cache = self.cache

    def uninstall(self) -> None:
        """Restore SGLang's init_mm_embedding_cache and its own cache; close the adapter."""
        module: Any = self.module
        for owner in (module, *self.rebound):
            if getattr(owner, "init_mm_embedding_cache", None) == self.init_cache:
                owner.init_mm_embedding_cache = self.original
        cache, self.cache = self.cache, None
        if cache is not None:
            if module.embedding_cache is cache:
                self.original(cache.max_size)
            cache.close()


def install(
    *,
    settings: CacheSettings | None = None,
    device: str | Device = "cuda",
    module: ModuleType | None = None,
    tp_group: ProcessGroup | Literal["auto"] | object | None = "auto",
) -> Installation:
    """Make SGLang build MMCacheMultimodalCache wherever it builds its embedding cache.

    Replaces `init_mm_embedding_cache` in `sglang.srt.managers.mm_schedule` (and in the
    SGLang modules that imported it by name), and the `embedding_cache` it already built,
    if any. Call it in the process that runs SGLang's scheduler before the model loads:
    at the top level of the launch script, which SGLang's spawned processes import too.
    `python -m mmcache.integrations.sglang` (`launch`) calls it in every SGLang process.
    Raises IntegrationError where the installed SGLang's seam differs from 0.5.23's, and
    SettingsError where settings is not a CacheSettings, changing nothing.

    tp_group: the group whose ranks agree on every lookup's hits, found when SGLang builds
    the cache. "auto" (the default): SGLang's attention-TP group (the ranks that run one
    batch: its TP group unless --enable-dp-attention), where it has more than one rank;
    None: no agreement; else a ProcessGroup, or an SGLang GroupCoordinator (its gloo
    cpu_group is taken).
    """
    _check_settings(settings)
    _check_group_spec(tp_group)
    if module is None:
        try:
            module = importlib.import_module(_SEAM_MODULE)
        except ImportError as exc:
            raise IntegrationError(
                f"cannot import {_SEAM_MODULE} ({exc}); install() needs sglang {TESTED_VERSION} "
                "with its dependencies"
            ) from exc
    original = _check_seam(module)
    seam: Any = module
    current = getattr(seam.init_mm_embedding_cache, "__self__", None)
    if isinstance(current, Installation):
        current.uninstall()  # installing again replaces the earlier installation
        original = seam.init_mm_embedding_cache
    rebound = [
        owner
        for name, owner in list(sys.modules.items())
        if name.startswith("sglang.")
        and owner is not module
        and getattr(owner, "init_mm_embedding_cache", None) is original
    ]
    done = Installation(module, original, rebound, settings, device, tp_group)
    owner: Any
    for owner in (module, *rebound):
        owner.init_mm_embedding_cache = done.init_cache
    built = seam.embedding_cache
    if built is not None:
        done.init_cache(int(built.max_size))  # SGLang built its own already: take its place
    return done


def _check_group_spec(spec: object) -> None:
    """Refuse a tp_group that is none of "auto", None, a ProcessGroup or a GroupCoordinator
    (InvalidValueError), before install() changes anything."""
    if spec is None or spec == "auto":
        return
    check_group(getattr(spec, "cpu_group", spec))


def _resolve_group(spec: object) -> ProcessGroup | None:
    """The ProcessGroup tp_group names, now that SGLang's groups exist (None: no group)."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec == "auto":
        return _sglang_tp_group()
    return check_group(getattr(spec, "cpu_group", spec))  # a GroupCoordinator: its gloo twin


def _sglang_tp_group() -> ProcessGroup | None:
    """SGLang's attention-TP group (gloo), where this process has one of several ranks."""
    try:
        from sglang.srt.runtime_context import get_parallel

        coordinator = get_parallel().attn_tp_group
    except (ImportError, AttributeError, RuntimeError):
        return None  # not inside SGLang's distributed set-up: every rank for itself
    if coordinator is None or getattr(coordinator, "world_size", 1) <= 1:
        return None
    return check_group(getattr(coordinator, "cpu_group", None))


def _check_seam(module: ModuleType) -> Callable[..., None]:
    """SGLang's init_mm_embedding_cache, if module is the seam the adapter was built for."""
    version = getattr(sglang, "__version__", "unknown")

    def refuse(what: str) -> IntegrationError:
        return IntegrationError(
            f"sglang {version} differs from {TESTED_VERSION}, the version mmcache's SGLang "
            f"adapter fits: {what}. Install sglang=={TESTED_VERSION}, or leave SGLang's own "
            "embedding cache in place"
        )

    init = getattr(module, "init_mm_embedding_cache", None)
    if not callable(init):
        raise refuse(f"{module.__name__} has no init_mm_embedding_cache()")
    if not hasattr(module, "embedding_cache"):
        raise refuse(f"{module.__name__} has no embedding_cache global")
    try:
        params = list(inspect.signature(init).parameters.values())
    except (TypeError, ValueError) as exc:
        raise refuse(f"init_mm_embedding_cache has no readable signature ({exc})") from exc
    if [p.name for p in params] != ["max_size"]:
        raise refuse(
            f"init_mm_embedding_cache takes ({', '.join(p.name for p in params)}), not (max_size)"
        )
    static = getattr(module, "MultiModalStaticCache", None)
    if not (isinstance(static, type) and issubclass(static, MultimodalCache)):
        raise refuse(f"{module.__name__}.MultiModalStaticCache is not a MultimodalCache")
    abstract = set(getattr(MultimodalCache, "__abstractmethods__", ()))
    if abstract != _ABSTRACT:
        raise refuse(
            f"MultimodalCache's abstract methods are {sorted(abstract)}, not {sorted(_ABSTRACT)}"
        )
    return init  # type: ignore[no-any-return]


# --- the launcher: python -m mmcache.integrations.sglang <launch_server's arguments> ---------


def launch(argv: Sequence[str], *, server: str = "sglang.launch_server") -> None:
    """Run SGLang's launcher (the module server) with argv, each SGLang process on mmcache.

    SGLang spawns its scheduler processes, so an install() here would not reach them.
    Instead the launcher sets MMCACHE_SGLANG_INSTALL=1 (kept where it already says 1, cuda
    or sim), which the processes SGLang starts inherit, and mmcache's SGLang plugin runs
    install() in each process as SGLang loads its plugins: this one first, at the top of
    launch_server, then every scheduler before it builds its embedding cache. Where
    SGLANG_PLUGINS restricts SGLang's plugins, mmcache's is added to it. Then server runs
    as `python -m server argv...` would run it, and this returns when it does.

    Raises IntegrationError where the plugin is not registered in this environment
    (mmcache imported from a path, not installed): SGLang would not find it.
    """
    if not _plugin_registered():
        raise IntegrationError(
            f"mmcache's SGLang plugin ({SGLANG_PLUGIN}, entry point group "
            f"{SGLANG_PLUGIN_GROUP}) is not registered in this environment, so SGLang's "
            "scheduler processes would keep their own cache: install mmcache into it "
            "(pip install /path/to/checkout, or bash scripts/run in a checkout)"
        )
    if os.environ.get(SGLANG_INSTALL_VARIABLE, "").strip() in ("", "0"):
        os.environ[SGLANG_INSTALL_VARIABLE] = "1"
    allowed = [name.strip() for name in os.environ.get("SGLANG_PLUGINS", "").split(",")]
    allowed = [name for name in allowed if name]
    if allowed and SGLANG_PLUGIN_NAME not in allowed:
        os.environ["SGLANG_PLUGINS"] = ",".join([*allowed, SGLANG_PLUGIN_NAME])
    sys.argv = [server, *argv]
    runpy.run_module(server, run_name="__main__", alter_sys=True)


def _plugin_registered() -> bool:
    """Whether an installed distribution registers mmcache's SGLang plugin."""
    return any(
        entry.value.replace(" ", "") == SGLANG_PLUGIN
        for entry in importlib.metadata.entry_points(group=SGLANG_PLUGIN_GROUP)
    )


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m mmcache.integrations.sglang [launch_server's arguments]`: launch()."""
    try:
        launch(sys.argv[1:] if argv is None else argv)
    except IntegrationError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()

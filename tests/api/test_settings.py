"""CacheSettings: environment names, SGLang aliases, precedence and error messages."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

import mmcache.settings as settings_module
from mmcache.cache import FeatureCache
from mmcache.device import Device, SimDevice
from mmcache.device.base import host_memory_bytes
from mmcache.errors import MMCacheError, SettingsError
from mmcache.remote.redis_store import _seeds
from mmcache.settings import (
    SETTINGS_TABLE,
    CacheSettings,
    ClusterUrl,
    SettingRow,
    split_cluster_url,
)

MiB = 1024**2

FIELDS = list(CacheSettings.model_fields)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run each test without any MMCACHE_* or SGLANG_* variable of the caller, and with no
    variable warned about yet."""
    for name in list(os.environ):
        if name.upper().startswith(("MMCACHE_", "SGLANG_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_warned", set())
    yield


def test_defaults() -> None:
    settings = CacheSettings()
    assert settings.gpu_cache_mb == 1024
    assert settings.cpu_cache_mb == 4096
    assert settings.ipc_pool_mb == 512
    assert settings.use_cuda_ipc is False
    assert settings.ipc_recycle_interval_s == 0.1
    assert settings.ipc_lease_timeout_s == 30.0
    assert settings.ipc_fallback_mb == 1024
    assert settings.promote_on_hit is True
    assert settings.promote_policy == "tinylfu"
    assert settings.metrics_port is None
    assert settings.small_copy_bytes == 4 * MiB
    assert settings.host_alignment == 512
    assert settings.copy_timeout_s == 60.0
    assert settings.evict_ahead == 0.125
    assert settings.eviction_policy == "lru"
    assert settings.host_share == "rank"
    assert settings.gpu_cache_bytes == 1024 * MiB
    assert settings.cpu_cache_bytes == 4096 * MiB
    assert settings.ipc_pool_bytes == 512 * MiB
    assert settings.ipc_fallback_bytes == 1024 * MiB


OWN_NAMES: list[tuple[str, str, str, object]] = [
    ("gpu_cache_mb", "MMCACHE_GPU_CACHE_MB", "64.5", 64.5),
    ("cpu_cache_mb", "MMCACHE_CPU_CACHE_MB", "256", 256.0),
    ("ipc_pool_mb", "MMCACHE_IPC_POOL_MB", "32.25", 32.25),
    ("use_cuda_ipc", "MMCACHE_USE_CUDA_IPC", "true", True),
    ("ipc_recycle_interval_s", "MMCACHE_IPC_RECYCLE_INTERVAL_SEC", "0.5", 0.5),
    ("ipc_lease_timeout_s", "MMCACHE_IPC_LEASE_TIMEOUT_SEC", "5", 5.0),
    ("ipc_fallback_mb", "MMCACHE_IPC_FALLBACK_MB", "128", 128.0),
    ("ipc_pool_wait_s", "MMCACHE_IPC_POOL_WAIT_SEC", "0.01", 0.01),
    ("promote_on_hit", "MMCACHE_PROMOTE_ON_HIT", "0", False),
    ("promote_policy", "MMCACHE_PROMOTE_POLICY", "room", "room"),
    ("host_share", "MMCACHE_HOST_SHARE", "node", "node"),
    ("metrics_port", "MMCACHE_METRICS_PORT", "9090", 9090),
    ("small_copy_bytes", "MMCACHE_SMALL_COPY_BYTES", "4096", 4096),
    ("host_alignment", "MMCACHE_HOST_ALIGNMENT", "4096", 4096),
    ("copy_timeout_s", "MMCACHE_COPY_TIMEOUT_SEC", "2.5", 2.5),
    ("eviction_policy", "MMCACHE_EVICTION_POLICY", "lfu", "lfu"),
    ("remote_url", "MMCACHE_REMOTE_URL", "redis://h:6379/0", "redis://h:6379/0"),
    ("remote_namespace", "MMCACHE_REMOTE_NAMESPACE", "model-a", "model-a"),
    ("remote_write", "MMCACHE_REMOTE_WRITE", "evict", "evict"),
    ("remote_ttl_sec", "MMCACHE_REMOTE_TTL_SEC", "3600", 3600.0),
    ("remote_timeout_sec", "MMCACHE_REMOTE_TIMEOUT_SEC", "0.25", 0.25),
    ("remote_timeout_per_mib_sec", "MMCACHE_REMOTE_TIMEOUT_PER_MIB_SEC", "0.01", 0.01),
    ("remote_max_value_mb", "MMCACHE_REMOTE_MAX_VALUE_MB", "8", 8.0),
    ("remote_queue_mb", "MMCACHE_REMOTE_QUEUE_MB", "32", 32.0),
    ("evict_ahead", "MMCACHE_EVICT_AHEAD", "0.25", 0.25),
    ("metrics_addr", "MMCACHE_METRICS_ADDR", "127.0.0.1", "127.0.0.1"),
]

SGLANG_NAMES: list[tuple[str, str, str, object]] = [
    ("gpu_cache_mb", "SGLANG_VLM_CACHE_SIZE_MB", "100", 100.0),
    ("ipc_pool_mb", "SGLANG_MM_FEATURE_CACHE_MB", "2048", 2048.0),
    ("use_cuda_ipc", "SGLANG_USE_CUDA_IPC_TRANSPORT", "1", True),
    ("ipc_recycle_interval_s", "SGLANG_MM_ITEM_MEM_POOL_RECYCLE_INTERVAL_SEC", "0.05", 0.05),
]


def test_every_field_is_tested_by_its_own_name() -> None:
    assert sorted(field for field, *_ in OWN_NAMES) == sorted(FIELDS)


@pytest.mark.parametrize(("field", "name", "raw", "expected"), OWN_NAMES + SGLANG_NAMES)
def test_each_variable_is_read(
    monkeypatch: pytest.MonkeyPatch, field: str, name: str, raw: str, expected: object
) -> None:
    monkeypatch.setenv(name, raw)
    settings = CacheSettings()
    assert getattr(settings, field) == expected
    assert settings.env_name(field) == name


@pytest.mark.parametrize(("field", "sglang_name", "raw", "expected"), SGLANG_NAMES)
def test_mmcache_name_wins_over_sglang_name(
    monkeypatch: pytest.MonkeyPatch, field: str, sglang_name: str, raw: str, expected: object
) -> None:
    own_name = CacheSettings.env_names(field)[0]
    own_raw, own_value = {
        "gpu_cache_mb": ("7", 7.0),
        "ipc_pool_mb": ("7", 7.0),
        "use_cuda_ipc": ("0", False),
        "ipc_recycle_interval_s": ("7", 7.0),
    }[field]
    assert own_value != expected
    monkeypatch.setenv(sglang_name, raw)
    monkeypatch.setenv(own_name, own_raw)
    settings = CacheSettings()
    assert getattr(settings, field) == own_value
    assert settings.env_name(field) == own_name


def test_losing_sglang_value_is_not_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "-5")
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "64")
    assert CacheSettings().gpu_cache_mb == 64


def test_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "")
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "100")
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", " ")
    settings = CacheSettings()
    assert settings.gpu_cache_mb == 100
    assert settings.env_name("gpu_cache_mb") == "SGLANG_VLM_CACHE_SIZE_MB"
    assert settings.cpu_cache_mb == 4096


def test_names_are_case_sensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("mmcache_gpu_cache_mb", "64")
    assert CacheSettings().gpu_cache_mb == 1024


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "mmcache" and r.levelname == "WARNING"
    ]


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("MMCACHE_GPU_CACHE", "MMCACHE_GPU_CACHE_MB"),
        ("MMCACHE_GPU_MB", "MMCACHE_GPU_CACHE_MB"),
        ("MMCACHE_CPU_MB", "MMCACHE_CPU_CACHE_MB"),
        ("mmcache_gpu_cache_mb", "MMCACHE_GPU_CACHE_MB"),
        ("MMCACHE_REMOTE_TTL", "MMCACHE_REMOTE_TTL_SEC"),
        ("MMCACHE_METRIC_PORT", "MMCACHE_METRICS_PORT"),
    ],
)
def test_a_misspelt_variable_is_ignored_with_one_warning_naming_the_nearest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str, nearest: str
) -> None:
    monkeypatch.setenv(name, "not a number")
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        assert CacheSettings().gpu_cache_mb == 1024
        assert CacheSettings().cpu_cache_mb == 4096  # warned about once, not per build
    assert warnings_of(caplog) == [
        f"{name} is not a setting's variable and is ignored; did you mean {nearest}?"
    ]


def test_a_variable_like_no_setting_is_warned_about_without_a_guess(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MMCACHE_FOO", "1")
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        CacheSettings()
    assert warnings_of(caplog) == [
        "MMCACHE_FOO is not a setting's variable and is ignored; `mmcache settings` lists them"
    ]


def test_settings_and_the_projects_other_variables_are_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for _, name, raw, _ in OWN_NAMES + SGLANG_NAMES:
        monkeypatch.setenv(name, raw)
    for name in ("MMCACHE_VENV", "MMCACHE_TORCH", "MMCACHE_GRAFANA_SCHEMA_DIR"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("MMCACHE_STATEFUL_EXAMPLES", "1")
    monkeypatch.setenv("MMCACHE_GPU_MB", " ")  # set to nothing counts as unset
    monkeypatch.setenv("SGLANG_SOMETHING_ELSE", "1")  # SGLang's own variables are many
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        CacheSettings()
    assert warnings_of(caplog) == []


@pytest.mark.parametrize(
    ("name", "field", "property_name"),
    [
        ("MMCACHE_GPU_CACHE_MB", "gpu_cache_mb", "gpu_cache_bytes"),
        ("SGLANG_VLM_CACHE_SIZE_MB", "gpu_cache_mb", "gpu_cache_bytes"),
        ("MMCACHE_CPU_CACHE_MB", "cpu_cache_mb", "cpu_cache_bytes"),
        ("MMCACHE_IPC_POOL_MB", "ipc_pool_mb", "ipc_pool_bytes"),
        ("SGLANG_MM_FEATURE_CACHE_MB", "ipc_pool_mb", "ipc_pool_bytes"),
        ("MMCACHE_IPC_FALLBACK_MB", "ipc_fallback_mb", "ipc_fallback_bytes"),
    ],
)
def test_zero_budget_is_allowed(
    monkeypatch: pytest.MonkeyPatch, name: str, field: str, property_name: str
) -> None:
    monkeypatch.setenv(name, "0")
    settings = CacheSettings()
    assert getattr(settings, field) == 0
    assert getattr(settings, property_name) == 0


def test_bytes_of_fractional_mib() -> None:
    settings = CacheSettings(gpu_cache_mb=0.5, cpu_cache_mb=1.5, ipc_pool_mb=2, ipc_fallback_mb=3)
    assert settings.gpu_cache_bytes == MiB // 2
    assert settings.cpu_cache_bytes == 3 * MiB // 2
    assert settings.ipc_pool_bytes == 2 * MiB
    assert settings.ipc_fallback_bytes == 3 * MiB
    assert isinstance(settings.gpu_cache_bytes, int)


@pytest.mark.parametrize(
    "name",
    [
        "MMCACHE_GPU_CACHE_MB",
        "SGLANG_VLM_CACHE_SIZE_MB",
        "MMCACHE_CPU_CACHE_MB",
        "MMCACHE_IPC_POOL_MB",
        "SGLANG_MM_FEATURE_CACHE_MB",
        "MMCACHE_IPC_FALLBACK_MB",
    ],
)
def test_negative_budget_names_the_variable_read(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, "-5")
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value).startswith(f"{name}='-5' is invalid: must be >= 0 (")
    assert "MiB" in str(caught.value)


def test_sglang_budget_error_does_not_name_the_mmcache_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "-5")
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value) == (
        "SGLANG_VLM_CACHE_SIZE_MB='-5' is invalid: must be >= 0"
        " (GPU tier budget in MiB; 0 turns the GPU tier off)"
    )


@pytest.mark.parametrize(
    ("sglang_name", "own_name", "field"),
    [
        ("SGLANG_VLM_CACHE_SIZE_MB", "MMCACHE_GPU_CACHE_MB", "gpu_cache_mb"),
        ("SGLANG_MM_FEATURE_CACHE_MB", "MMCACHE_IPC_POOL_MB", "ipc_pool_mb"),
    ],
)
def test_sglang_budgets_take_integers_only(
    monkeypatch: pytest.MonkeyPatch, sglang_name: str, own_name: str, field: str
) -> None:
    monkeypatch.setenv(sglang_name, "100.5")
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    message = str(caught.value)
    assert message.startswith(f"{sglang_name}='100.5' is invalid: must be an integer")
    assert own_name in message  # it tells the user where fractional MiB are accepted

    monkeypatch.setenv(sglang_name, "100")
    assert getattr(CacheSettings(), field) == 100

    monkeypatch.delenv(sglang_name)
    monkeypatch.setenv(own_name, "100.5")
    assert getattr(CacheSettings(), field) == 100.5


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        (" 1 ", True),
        ("0", False),
        ("false", False),
        ("no", False),
    ],
)
def test_sglang_cuda_ipc_flag(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("SGLANG_USE_CUDA_IPC_TRANSPORT", raw)
    assert CacheSettings().use_cuda_ipc is expected


def test_invalid_flag_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_USE_CUDA_IPC_TRANSPORT", "maybe")
    with pytest.raises(SettingsError, match=r"^SGLANG_USE_CUDA_IPC_TRANSPORT='maybe' is invalid"):
        CacheSettings()


def test_keyword_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", "100")
    monkeypatch.setenv("SGLANG_MM_FEATURE_CACHE_MB", "not a number")  # loses, so not validated
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "300")
    settings = CacheSettings(gpu_cache_mb=64, ipc_pool_mb=8)
    assert settings.gpu_cache_mb == 64
    assert settings.ipc_pool_mb == 8
    assert settings.cpu_cache_mb == 300  # the environment still fills what was not given
    assert settings.env_name("gpu_cache_mb") == "MMCACHE_GPU_CACHE_MB"
    assert settings.env_name("cpu_cache_mb") == "MMCACHE_CPU_CACHE_MB"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"gpu_cache_mb": -1}, "gpu_cache_mb=-1 is invalid: must be >= 0"),
        ({"gpu_cache_mb": "lots"}, "gpu_cache_mb='lots' is invalid: must be a number"),
        ({"cpu_cache_mb": float("inf")}, "cpu_cache_mb=inf is invalid: must be a finite number"),
        ({"copy_timeout_s": 0}, "copy_timeout_s=0 is invalid: must be > 0"),
        ({"host_alignment": 24}, "host_alignment=24 is invalid: must be a power of two"),
        ({"host_alignment": 0}, "host_alignment=0 is invalid: must be >= 16"),
        ({"host_alignment": 2 * MiB}, "host_alignment=2097152 is invalid: must be <= 1048576"),
        ({"small_copy_bytes": -1}, "small_copy_bytes=-1 is invalid: must be >= 0"),
        ({"use_cuda_ipc": "maybe"}, "use_cuda_ipc='maybe' is invalid: must be a boolean"),
        (
            {"eviction_policy": "random"},
            "eviction_policy='random' is invalid: must be one of 'lru', 'lfu', 'fifo' or 'cost'",
        ),
        (
            {"promote_policy": "lru"},
            "promote_policy='lru' is invalid: must be one of 'tinylfu' or 'room'",
        ),
        (
            {"remote_url": "http://h:6379"},
            "remote_url='http://h:6379' is invalid: must start with one of redis://, rediss://, ",
        ),
        (
            {"remote_write": "always"},
            "remote_write='always' is invalid: must be one of 'put', 'evict' or 'off'",
        ),
        ({"remote_namespace": ""}, "remote_namespace='' is invalid: "),
        (
            {"remote_url": "http://user:s3cret@h:6379"},
            "remote_url='http://user:***@h:6379' is invalid: must start with one of",
        ),
        ({"gpu_cache": 64}, "gpu_cache=64 is not a setting; settings are gpu_cache_mb, "),
    ],
)
def test_bad_keyword_argument_names_the_field(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        CacheSettings(**kwargs)
    assert str(caught.value).startswith(expected)


BAD_REMOTE_URLS: list[tuple[str, str]] = [
    ("redis://h:notaport", "port 'notaport' is not a port number from 1 to 65535"),
    ("redis://h:99999", "port '99999' is not a port number from 1 to 65535"),
    ("rediss://h:0/0", "port '0' is not a port number from 1 to 65535"),
    ("redis://[::1]:65536/0", "port '65536' is not a port number from 1 to 65535"),
    ("redis://h:6379/x", "database 'x' is not a number"),
    ("redis+cluster://a:7000,b", "cluster node 'b' is not host:port"),
    ("redis+cluster://a:7000,[::1]", "cluster node '[::1]' is not host:port"),
    ("rediss+cluster://a:99999", "port '99999' of cluster node 'a:99999' is not a port number"),
    ("redis://[::1:6379", "Invalid IPv6 URL"),
    ("REDIS://h:6379", "must start with one of redis://, "),
]


@pytest.mark.parametrize(("url", "reason"), BAD_REMOTE_URLS)
def test_a_remote_url_the_tier_cannot_use_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, url: str, reason: str
) -> None:
    with pytest.raises(SettingsError) as caught:
        CacheSettings(remote_url=url)
    assert str(caught.value).startswith(f"remote_url={url!r} is invalid: {reason}")
    monkeypatch.setenv("MMCACHE_REMOTE_URL", url)
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value).startswith(f"MMCACHE_REMOTE_URL={url!r} is invalid: {reason}")


def test_a_remote_url_redis_py_refuses_is_refused_when_settings_are_built() -> None:
    pytest.importorskip("redis")
    with pytest.raises(SettingsError, match=r"Invalid value for 'db' in connection URL"):
        CacheSettings(remote_url="unix:///tmp/redis.sock?db=x")


def test_a_bad_port_after_a_password_does_not_show_the_password() -> None:
    with pytest.raises(SettingsError) as caught:
        CacheSettings(remote_url="redis://user:s3cret@h:notaport/0")
    assert "s3cret" not in str(caught.value)
    assert "port 'notaport' is not a port number" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h",
        "redis://h:6379/0",
        "rediss://user:pw@h:6380/15",
        "redis://[::1]:6379/0",
        "redis://[::1]/0",
        "unix:///run/redis.sock?db=0",
        "unix://:pw@/run/redis.sock",
        "redis+cluster://a:7000,b:7001",
        "rediss+cluster://user:pw@[::1]:7000,h:7001",
        "redis+cluster://a:7000,[::1]:7001",
    ],
)
def test_remote_urls_the_tier_can_use_are_taken(url: str) -> None:
    assert CacheSettings(remote_url=url).remote_url == url


def test_a_cluster_url_is_split_into_what_the_cluster_client_takes() -> None:
    # A bracketed host after another: urlsplit of Python 3.12 refuses the whole URL.
    url = "rediss+cluster://us%40er:p%3Aw@h:7001, [::1]:7000/?ssl_cert_reqs=none#frag"
    parts = split_cluster_url(url)
    assert parts == ClusterUrl("us@er", "p:w", ["h:7001", "[::1]:7000"], "ssl_cert_reqs=none")
    assert _seeds(parts.nodes) == [("h", 7001), ("::1", 7000)]
    assert split_cluster_url("redis+cluster://:pw@a:1,b:2") == ClusterUrl(
        None, "pw", ["a:1", "b:2"], ""
    )


@pytest.mark.parametrize("raw", ["1e30", "9.1e15"])
def test_a_remote_ttl_the_server_refuses_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    reason = "must be at most 9e+15 s (about 285 million years), the longest expiry"
    with pytest.raises(SettingsError) as caught:
        CacheSettings(remote_ttl_sec=float(raw))
    assert str(caught.value).startswith(f"remote_ttl_sec={float(raw)!r} is invalid: {reason}")
    monkeypatch.setenv("MMCACHE_REMOTE_TTL_SEC", raw)
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value).startswith(f"MMCACHE_REMOTE_TTL_SEC='{raw}' is invalid: {reason}")


def test_the_longest_remote_ttl_is_taken() -> None:
    assert CacheSettings(remote_ttl_sec=9e15).remote_ttl_sec == 9e15


LONG = 100_000


def long_bad_value(field: str) -> str:
    """A value of LONG characters that field refuses."""
    if field == "remote_url":
        return "http://" + "x" * (LONG - len("http://"))
    return "x" * LONG


#: remote_namespace takes any text that is not empty: no long value of it is refused.
LONG_FIELDS = [field for field in FIELDS if field != "remote_namespace"]


def assert_cut(message: str, name: str) -> None:
    """message names name, repeats at most 80 characters of the value and says its length."""
    assert message.startswith(f"{name}=")
    assert f"… ({LONG} characters) is invalid: " in message
    assert "x" * 81 not in message
    assert len(message) < 600


@pytest.mark.parametrize("field", LONG_FIELDS)
def test_a_long_value_is_cut_in_the_error(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    value = long_bad_value(field)
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(SettingsError) as caught:
        CacheSettings(**kwargs)
    assert_cut(str(caught.value), field)
    for name in CacheSettings.env_names(field):
        monkeypatch.setenv(name, value)
        with pytest.raises(SettingsError) as caught:
            CacheSettings()
        assert_cut(str(caught.value), name)
        monkeypatch.delenv(name)


def test_a_long_unknown_keyword_is_cut_in_the_error() -> None:
    with pytest.raises(SettingsError) as caught:
        CacheSettings(**cast(dict[str, Any], {"x" * LONG: "y" * LONG}))
    message = str(caught.value)
    assert message.startswith("x" * 80 + f"… ({LONG} characters)='" + "y" * 79)
    assert f"… ({LONG} characters) is not a setting; settings are gpu_cache_mb, " in message
    assert len(message) < 800


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis://h:" + "9" * LONG, "port '" + "9" * 79 + f"… ({LONG} characters) is not a port"),
        ("redis://h/" + "x" * LONG, "database '" + "x" * 79 + f"… ({LONG} characters) is not a"),
    ],
)
def test_a_long_part_of_a_remote_url_is_cut_in_the_error(url: str, reason: str) -> None:
    with pytest.raises(SettingsError) as caught:
        CacheSettings(remote_url=url)
    assert reason in str(caught.value)
    assert len(str(caught.value)) < 600


def test_a_long_remote_url_is_cut_after_its_password_is_hidden() -> None:
    url = "http://user:" + "S" * 100 + "@h:6379/" + "x" * LONG
    with pytest.raises(SettingsError) as caught:
        CacheSettings(remote_url=url)
    assert str(caught.value).startswith("remote_url='http://user:***@h:6379/xxx")
    assert "SS" not in str(caught.value)


def test_every_bad_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "1.5")
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "-1")
    with pytest.raises(SettingsError) as caught:
        CacheSettings(copy_timeout_s=-1)
    lines = str(caught.value).splitlines()
    assert [line.split("=")[0] for line in lines] == [
        "SGLANG_VLM_CACHE_SIZE_MB",
        "MMCACHE_CPU_CACHE_MB",
        "copy_timeout_s",
    ]


def test_settings_error_is_an_mmcache_error() -> None:
    with pytest.raises(MMCacheError):
        CacheSettings(gpu_cache_mb=-1)
    assert issubclass(SettingsError, ValueError)


@pytest.mark.parametrize("port", [0, 1, 9090, 65535])
def test_metrics_port_in_range(port: int) -> None:
    assert CacheSettings(metrics_port=port).metrics_port == port


@pytest.mark.parametrize(("port", "reason"), [(-1, "must be >= 0"), (65536, "must be <= 65535")])
def test_metrics_port_out_of_range(monkeypatch: pytest.MonkeyPatch, port: int, reason: str) -> None:
    with pytest.raises(SettingsError, match=f"^metrics_port={port} is invalid: {reason}"):
        CacheSettings(metrics_port=port)
    monkeypatch.setenv("MMCACHE_METRICS_PORT", str(port))
    with pytest.raises(SettingsError, match=f"^MMCACHE_METRICS_PORT='{port}' is invalid: {reason}"):
        CacheSettings()


@pytest.mark.parametrize("addr", ["bad..name", "x" * 64, "[::1]"])
def test_a_metrics_addr_that_does_not_resolve_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, addr: str
) -> None:
    reason = "does not resolve to an address to bind ("
    with pytest.raises(SettingsError) as caught:
        CacheSettings(metrics_addr=addr)
    assert str(caught.value).startswith(f"metrics_addr={addr!r} is invalid: {reason}")
    monkeypatch.setenv("MMCACHE_METRICS_ADDR", addr)
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value).startswith(f"MMCACHE_METRICS_ADDR={addr!r} is invalid: {reason}")


def test_a_host_name_the_resolver_does_not_know_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unknown(host: str, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    monkeypatch.setenv("MMCACHE_METRICS_ADDR", "metrics.example")
    with pytest.raises(SettingsError) as caught:
        CacheSettings()
    assert str(caught.value).startswith(
        "MMCACHE_METRICS_ADDR='metrics.example' is invalid: does not resolve to an address to "
        "bind ([Errno -2] Name or service not known)"
    )


@pytest.mark.parametrize("addr", ["0.0.0.0", "127.0.0.1", "::", "::1", "localhost"])
def test_metrics_addresses_that_resolve_are_taken(addr: str) -> None:
    assert CacheSettings(metrics_addr=addr).metrics_addr == addr


def test_settings_cannot_be_changed_after_start() -> None:
    settings = CacheSettings()
    with pytest.raises(ValidationError):
        settings.gpu_cache_mb = 1
    assert settings.gpu_cache_mb == 1024


def test_env_names() -> None:
    assert CacheSettings.env_names("gpu_cache_mb") == (
        "MMCACHE_GPU_CACHE_MB",
        "SGLANG_VLM_CACHE_SIZE_MB",
    )
    assert CacheSettings.env_names("cpu_cache_mb") == ("MMCACHE_CPU_CACHE_MB",)
    for field in FIELDS:
        assert CacheSettings.env_names(field)[0].startswith("MMCACHE_")
    with pytest.raises(SettingsError, match="'gpu_cache' is not a setting"):
        CacheSettings.env_names("gpu_cache")


def test_env_name_of_a_default_is_the_mmcache_name() -> None:
    settings = CacheSettings()
    assert settings.env_name("gpu_cache_mb") == "MMCACHE_GPU_CACHE_MB"
    assert settings.env_name("ipc_pool_mb") == "MMCACHE_IPC_POOL_MB"


def test_settings_table() -> None:
    defaults = CacheSettings()
    assert [row.field for row in SETTINGS_TABLE] == FIELDS
    for row in SETTINGS_TABLE:
        assert isinstance(row, SettingRow)
        assert row.env_names == CacheSettings.env_names(row.field)
        assert row.default == getattr(defaults, row.field)
        assert row.description and "\n" not in row.description


def test_how_to_change_names_the_source_of_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*CacheSettings.env_names("gpu_cache_mb"), "MMCACHE_CPU_CACHE_MB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "64")
    settings = CacheSettings(cpu_cache_mb=8)
    assert settings.how_to_change("gpu_cache_mb") == "SGLANG_VLM_CACHE_SIZE_MB"
    assert settings.how_to_change("cpu_cache_mb") == "CacheSettings(cpu_cache_mb=...)"
    assert settings.how_to_change("ipc_pool_mb") == (
        "MMCACHE_IPC_POOL_MB or SGLANG_MM_FEATURE_CACHE_MB (or CacheSettings(ipc_pool_mb=...))"
    )


# --- budgets against the machine: checked when a cache is made on its device ---------------


def make_cache(
    settings: CacheSettings,
    device: str | Device,
    name: str = "machine",
    registry: CollectorRegistry | None = None,
) -> None:
    """Make a cache (never started), and close the device it made itself."""
    cache = FeatureCache(settings, device, name=name, registry=registry or CollectorRegistry())
    if isinstance(device, str):
        cache.device.close()


@pytest.mark.parametrize(
    ("name", "source"),
    [
        (None, "CacheSettings(gpu_cache_mb=...)"),
        ("MMCACHE_GPU_CACHE_MB", "MMCACHE_GPU_CACHE_MB"),
        ("SGLANG_VLM_CACHE_SIZE_MB", "SGLANG_VLM_CACHE_SIZE_MB"),
    ],
)
def test_a_gpu_tier_larger_than_the_device_is_refused_naming_its_source(
    monkeypatch: pytest.MonkeyPatch, name: str | None, source: str
) -> None:
    if name is None:
        settings = CacheSettings(gpu_cache_mb=3)
    else:
        monkeypatch.setenv(name, "3")
        settings = CacheSettings()
    device = SimDevice(memory_bytes=2 * MiB)
    try:
        with pytest.raises(SettingsError) as caught:
            make_cache(settings, device)
        assert str(caught.value) == (
            f"a GPU tier of 3 MB exceeds the memory of sim (2.0 MB); lower {source}"
        )
        make_cache(CacheSettings(gpu_cache_mb=2), device)  # all of it is not more than it has
    finally:
        device.close()


@pytest.mark.parametrize("name", [None, "MMCACHE_CPU_CACHE_MB"])
def test_a_host_tier_larger_than_the_machine_is_refused_naming_its_source(
    monkeypatch: pytest.MonkeyPatch, name: str | None
) -> None:
    ram = host_memory_bytes()
    assert ram is not None and ram > 0
    too_much = (ram // MiB + 1) * 2
    if name is None:
        settings, source = CacheSettings(cpu_cache_mb=too_much), "CacheSettings(cpu_cache_mb=...)"
    else:
        monkeypatch.setenv(name, str(too_much))
        settings, source = CacheSettings(), name
    with pytest.raises(SettingsError) as caught:
        make_cache(settings, "sim")
    assert str(caught.value) == (
        f"a host tier of {too_much:g} MB exceeds this machine's memory "
        f"({ram / MiB:.1f} MB); lower {source}"
    )


def test_budgets_beyond_the_machine_are_refused_before_the_cache_takes_its_name() -> None:
    registry = CollectorRegistry()
    with pytest.raises(SettingsError) as caught:
        make_cache(CacheSettings(gpu_cache_mb=1e12, cpu_cache_mb=1e12), "sim", "big", registry)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("a GPU tier of 1e+12 MB exceeds the memory of sim (")
    assert lines[1].startswith("a host tier of 1e+12 MB exceeds this machine's memory (")
    # Nothing was registered: the name is still free.
    make_cache(CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1), "sim", "big", registry)

"""The connector's settings from ``kv_connector_extra_config``: defaults, and clear refusals."""

from __future__ import annotations

import pytest

from kvdock.errors import ConfigError
from kvdock.integrations.vllm.config import ConnectorConfig

BASE = {"kvdock.url": "tcp://127.0.0.1:5555", "kvdock.http_url": "http://127.0.0.1:9000"}


def test_defaults_and_the_served_model_name() -> None:
    cfg = ConnectorConfig.from_extra(BASE, "Qwen/Qwen3-8B")
    assert cfg == ConnectorConfig(
        url="tcp://127.0.0.1:5555", http_url="http://127.0.0.1:9000", model_name="Qwen/Qwen3-8B",
        cache_decode=False, timeout=5.0, lookup_wait=0.05, retry_s=2.0, admin_token="", load_failure="recompute",
        load_async=True, save_buffer_mb=256.0,
    )  # fmt: skip


def test_every_key_is_read() -> None:
    cfg = ConnectorConfig.from_extra(
        {
            **BASE,
            "kvdock.model_name": "mine",
            "kvdock.cache_decode": "true",
            "kvdock.timeout": "0.5",
            "kvdock.lookup_wait": 0,
            "kvdock.retry_s": 3,
            "kvdock.admin_token": "s3cret",
            "kvdock.load_failure": "fail",
            "kvdock.server_key": "/keys/server.key",
            "kvdock.client_key": "/keys/engine.key_secret",
            "kvdock.token": "a-tenant-token-1234",
            "kvdock.load_async": "false",
            "kvdock.save_buffer_mb": 64,
            "other.connector.key": 1,  # not ours: ignored
        },
        "served",
    )
    assert (cfg.model_name, cfg.cache_decode, cfg.timeout, cfg.retry_s) == ("mine", True, 0.5, 3.0)
    assert (cfg.admin_token, cfg.load_failure, cfg.lookup_wait) == ("s3cret", "fail", 0.0)
    assert (cfg.load_async, cfg.save_buffer_mb) == (False, 64.0)
    assert cfg.keys == {
        "server_key": "/keys/server.key",
        "client_key": "/keys/engine.key_secret",
        "token": "a-tenant-token-1234",
    }
    assert ConnectorConfig.from_extra(BASE, "x").keys == {"server_key": None, "client_key": None, "token": None}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "needs kvdock.url"),
        ({"kvdock.url": "tcp://x:1"}, "needs kvdock.http_url"),
        ({**BASE, "kvdock.timout": 1}, r"unknown kv_connector_extra_config key\(s\) \['kvdock.timout'\]"),
        ({**BASE, "kvdock.timeout": "abc"}, "kvdock.timeout must be a positive number of seconds, got 'abc'"),
        ({**BASE, "kvdock.timeout": 0}, "kvdock.timeout must be a positive"),
        ({**BASE, "kvdock.retry_s": float("inf")}, "kvdock.retry_s must be a positive"),
        ({**BASE, "kvdock.lookup_wait": -0.1}, "kvdock.lookup_wait must be a non-negative number of seconds, got -0.1"),
        ({**BASE, "kvdock.lookup_wait": "nan"}, "kvdock.lookup_wait must be a non-negative number of seconds"),
        ({**BASE, "kvdock.cache_decode": "maybe"}, "kvdock.cache_decode must be a boolean"),
        ({**BASE, "kvdock.load_async": 2}, "kvdock.load_async must be a boolean, got 2"),
        ({**BASE, "kvdock.save_buffer_mb": -1}, "kvdock.save_buffer_mb must be a non-negative number of MiB, got -1"),
        ({**BASE, "kvdock.load_failure": "ignore"}, "kvdock.load_failure must be 'recompute' or 'fail'"),
        ({**BASE, "kvdock.model_name": 7}, "kvdock.model_name must be a string of 1 to 200 characters, got 7"),
        ({**BASE, "kvdock.model_name": ""}, "kvdock.model_name must be a string of 1 to 200"),
        ({**BASE, "kvdock.model_name": "m" * 201}, "kvdock.model_name must be a string of 1 to 200"),
        ({**BASE, "kvdock.url": "localhost:5555"}, "kvdock.url must be a tcp:// or ipc:// URL, got 'localhost:5555'"),
        ({**BASE, "kvdock.url": "tcp://"}, "kvdock.url must be a tcp:// or ipc:// URL"),
        ({**BASE, "kvdock.http_url": "tcp://127.0.0.1:9000"}, "kvdock.http_url must be a http:// or https:// URL"),
        ({**BASE, "kvdock.admin_token": None}, "kvdock.admin_token must be a string, got NoneType"),
        ({**BASE, "kvdock.server_key": 1}, "kvdock.server_key must be a string, got int"),
        ({**BASE, "kvdock.token": ["x"]}, "kvdock.token must be a string, got list"),
        ({**BASE, "kvdock.timeout": True}, "kvdock.timeout must be a positive number of seconds, got True"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_extra(extra, "served")

"""kvdock.config: sizes, precedence CLI > env > file > default, and error reporting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvdock.config import (
    DEFAULT_HTTP_PORT,
    DEFAULT_PORT,
    ServerConfig,
    format_size,
    load_server_config,
    parse_size,
)
from kvdock.errors import ConfigError, KVDockError

# ---------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("4096", 4096),
        ("4096B", 4096),
        ("0", 0),
        ("1KiB", 1024),
        ("1k", 1000),
        ("10kb", 10_000),
        ("3M", 3_000_000),
        ("1Ti", 2**40),
        ("2T", 2 * 10**12),
        ("1.5GiB", 3 * 2**29),
        ("512mib", 512 * 2**20),
        ("  64 MiB  ", 64 * 2**20),
        ("2gi", 2 * 2**30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    got = parse_size(text)
    assert got == expected
    assert isinstance(got, int)


def test_parse_size_passes_ints_through() -> None:
    assert parse_size(12345) == 12345


@pytest.mark.parametrize("text", ["", "abc", "GiB", "-1", "-1GiB", "1.5.5G", "2XB", "2 GiBs", "1e9", "0x10", "1,5G"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_size(text)


def test_config_error_is_a_value_error_and_kvdock_error() -> None:
    with pytest.raises(ValueError):
        parse_size("nope")
    with pytest.raises(KVDockError):
        parse_size("nope")


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * 2**19, "1.50 MiB"), (2**31, "2.00 GiB")]
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


# ---------------------------------------------------------------- defaults and dataclass


def test_defaults_with_nothing_given() -> None:
    cfg = load_server_config({}, env={})
    assert cfg == ServerConfig()
    assert cfg.host == "127.0.0.1"
    assert cfg.port == DEFAULT_PORT == 5555
    assert cfg.http_port == DEFAULT_HTTP_PORT == 9000
    assert cfg.chunk_size == 256
    assert cfg.l1_size == 0
    assert cfg.no_shm is False
    assert cfg.session_ttl == 30.0
    assert cfg.client_ttl == 300.0
    assert cfg.max_models == 64
    assert cfg.max_request_tokens == 1_048_576 == 2**20
    assert cfg.admin_token == ""
    assert cfg.log_level == "INFO"


def test_config_is_frozen() -> None:
    cfg = load_server_config({}, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    assert cfg.port == DEFAULT_PORT


def test_zmq_url() -> None:
    assert ServerConfig(host="0.0.0.0", port=7000).zmq_url == "tcp://0.0.0.0:7000"
    assert ServerConfig(host="::1", port=7000).zmq_url == "tcp://[::1]:7000"


# ---------------------------------------------------------------- precedence


def _write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "kvdock.toml"
    p.write_text(body)
    return p


def test_file_over_default(tmp_path: Path) -> None:
    path = _write(tmp_path, 'port = 6000\nl1_size = "64MiB"\nno_shm = true\nsession_ttl = 5\nlog_level = "DEBUG"\n')
    cfg = load_server_config({}, env={}, config_file=path)
    assert cfg.port == 6000
    assert cfg.l1_size == 64 * 2**20
    assert cfg.no_shm is True
    assert cfg.session_ttl == 5.0 and isinstance(cfg.session_ttl, float)
    assert cfg.log_level == "DEBUG"
    assert cfg.http_port == DEFAULT_HTTP_PORT  # not in the file: default


def test_env_over_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = 6000\nchunk_size = 64\n")
    env = {"KVDOCK_PORT": "6001", "KVDOCK_NO_SHM": "yes", "KVDOCK_L1_SIZE": "1GiB"}
    cfg = load_server_config({}, env=env, config_file=path)
    assert cfg.port == 6001
    assert cfg.chunk_size == 64  # only in the file
    assert cfg.no_shm is True
    assert cfg.l1_size == 2**30


def test_cli_over_env_over_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = 6000\nhttp_port = 9100\nchunk_size = 64\n")
    env = {"KVDOCK_PORT": "6001", "KVDOCK_HTTP_PORT": "9101"}
    cli = {"port": 6002, "http_port": None, "chunk_size": None}
    cfg = load_server_config(cli, env=env, config_file=path)
    assert cfg.port == 6002  # CLI
    assert cfg.http_port == 9101  # env (CLI None = not given)
    assert cfg.chunk_size == 64  # file


def test_cli_false_overrides_env_true() -> None:
    cfg = load_server_config({"no_shm": False}, env={"KVDOCK_NO_SHM": "1"})
    assert cfg.no_shm is False


def test_cli_strings_are_coerced() -> None:
    cfg = load_server_config({"port": "7001", "l1_size": "2MiB", "session_ttl": "2.5"}, env={})
    assert (cfg.port, cfg.l1_size, cfg.session_ttl) == (7001, 2 * 2**20, 2.5)


def test_cli_ignores_keys_that_are_not_fields() -> None:
    cfg = load_server_config({"config": "/nonexistent.toml", "verbose": True}, env={})
    assert cfg == ServerConfig()


def test_config_file_from_env_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_size = 32\n")
    cfg = load_server_config({}, env={"KVDOCK_CONFIG": str(path)})
    assert cfg.chunk_size == 32


def test_explicit_config_file_beats_env_config_path(tmp_path: Path) -> None:
    a = tmp_path / "a.toml"
    a.write_text("chunk_size = 32\n")
    b = tmp_path / "b.toml"
    b.write_text("chunk_size = 48\n")
    cfg = load_server_config({}, env={"KVDOCK_CONFIG": str(a)}, config_file=b)
    assert cfg.chunk_size == 48


def test_unrelated_env_variables_are_ignored() -> None:
    cfg = load_server_config({}, env={"KVDOCK_BOGUS": "1", "PORT": "1", "kvdock_port": "1"})
    assert cfg == ServerConfig()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("", False),
    ],
)
def test_bool_env_values(value: str, expected: bool) -> None:
    assert load_server_config({}, env={"KVDOCK_NO_SHM": value}).no_shm is expected


def test_env_string_fields_taken_verbatim() -> None:
    env = {"KVDOCK_ADMIN_TOKEN": "s3cr3t", "KVDOCK_HOST": "0.0.0.0", "KVDOCK_INSECURE_ALLOW_REMOTE": "1"}
    cfg = load_server_config({}, env=env)
    assert (cfg.admin_token, cfg.host, cfg.insecure_allow_remote) == ("s3cr3t", "0.0.0.0", True)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "kvdock.example.com"])
def test_a_non_loopback_bind_needs_insecure_allow_remote(host: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config({"host": host}, env={})
    assert str(err.value).startswith(f"host {host!r} is not a loopback address: every client that reaches it")
    assert "--insecure-allow-remote (KVDOCK_INSECURE_ALLOW_REMOTE=1)" in str(err.value)
    assert load_server_config({"host": host, "insecure_allow_remote": True}, env={}).host == host
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert load_server_config({"host": loopback}, env={}).host == loopback


def test_curve_opens_zmq_to_the_network_but_http_stays_on_loopback() -> None:
    """(review) HTTP is plain text: CURVE lets zmq bind a non-loopback host, not HTTP."""
    curve = {"curve_secret_key": "/keys/server.key_secret"}
    cfg = load_server_config({"host": "0.0.0.0", **curve}, env={})
    assert (cfg.zmq_url, cfg.http_bind_host) == ("tcp://0.0.0.0:5555", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"http_host '0\.0\.0\.0' is not a loopback address, and HTTP is plain"):
        load_server_config({"host": "0.0.0.0", "http_host": "0.0.0.0", **curve}, env={})
    both = load_server_config({"host": "0.0.0.0", "http_host": "10.0.0.1", "insecure_allow_remote": True}, env={})
    assert both.http_bind_host == "10.0.0.1"
    assert load_server_config({"host": "0.0.0.0", "insecure_allow_remote": True}, env={}).http_bind_host == "0.0.0.0"
    assert load_server_config({"host": "::1"}, env={}).http_bind_host == "::1"


# ---------------------------------------------------------------- errors


def test_unknown_file_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = 6000\nchunksize = 64\nzzz = 1\n")
    with pytest.raises(ConfigError, match=r"unknown keys in .*kvdock\.toml: chunksize, zzz"):
        load_server_config({}, env={}, config_file=path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_server_config({}, env={}, config_file=tmp_path / "missing.toml")


def test_malformed_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, "port = = 1\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_server_config({}, env={}, config_file=path)


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"KVDOCK_PORT": "abc"}, "invalid value for port: 'abc'"),
        ({"KVDOCK_PORT": "5.5"}, "invalid value for port"),
        ({"KVDOCK_CHUNK_SIZE": ""}, "invalid value for chunk_size"),
        ({"KVDOCK_SESSION_TTL": "soon"}, "invalid value for session_ttl: 'soon'"),
        ({"KVDOCK_NO_SHM": "maybe"}, "invalid value for no_shm: 'maybe'"),
        ({"KVDOCK_L1_SIZE": "lots"}, "not a size: 'lots'"),
        ({"KVDOCK_CLIENT_TTL": "never"}, "invalid value for client_ttl: 'never'"),
        ({"KVDOCK_MAX_REQUEST_TOKENS": "1e6"}, "invalid value for max_request_tokens: '1e6'"),
        ({"KVDOCK_MAX_MODELS": "many"}, "invalid value for max_models: 'many'"),
    ],
)
def test_bad_env_values(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_server_config({}, env=env)


@pytest.mark.parametrize(
    ("cli", "pattern"),
    [
        ({"chunk_size": 0}, "chunk_size must be positive, got 0"),
        ({"chunk_size": -16}, "chunk_size must be positive"),
        ({"session_ttl": 0}, "session_ttl must be positive"),
        ({"session_ttl": -1.0}, "session_ttl must be positive"),
        ({"l1_size": -1}, "l1_size"),
        ({"port": 65536}, "port out of range: 65536"),
        ({"port": -1}, "port out of range"),
        ({"http_port": 70000}, "http_port out of range: 70000"),
        ({"client_ttl": 0}, "client_ttl must be positive, got 0"),
        ({"client_ttl": -5}, "client_ttl must be positive, got -5.0"),
        ({"max_models": 0}, "max_models must be positive, got 0"),
        ({"max_request_tokens": 0}, "max_request_tokens must be positive, got 0"),
        ({"max_request_tokens": -1}, "max_request_tokens must be positive, got -1"),
    ],
)
def test_values_that_cannot_work(cli: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_server_config(cli, env={})


def test_port_zero_is_allowed() -> None:
    assert load_server_config({"port": 0, "http_port": 0}, env={}).port == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('chunk_size = "abc"', "chunk_size"),
        ("session_ttl = [1]", "session_ttl"),
        ('l1_size = "huge"', "l1_size"),
        ('no_shm = "maybe"', "no_shm"),
    ],
)
def test_bad_file_values(tmp_path: Path, body: str, field: str) -> None:
    path = _write(tmp_path, body + "\n")
    with pytest.raises(ConfigError, match=field):
        load_server_config({}, env={}, config_file=path)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("port = true", "port"),  # a TOML bool silently becomes port 1
        ("port = 5.7", "port"),  # a TOML float silently truncated to port 5
        ("chunk_size = 16.9", "chunk_size"),  # silently truncated to 16
        ("l1_size = true", "l1_size"),  # a TOML bool silently becomes a 1-byte pool
    ],
)
def test_wrongly_typed_file_values_are_config_errors(tmp_path: Path, body: str, field: str) -> None:
    path = _write(tmp_path, body + "\n")
    with pytest.raises(ConfigError, match=field):
        load_server_config({}, env={}, config_file=path)


def test_integral_float_size_in_file_is_accepted(tmp_path: Path) -> None:
    cfg = load_server_config({}, env={}, config_file=_write(tmp_path, "l1_size = 1.5e9\n"))
    assert cfg.l1_size == 1_500_000_000 and type(cfg.l1_size) is int


@pytest.mark.parametrize("body", ["no_shm = 1", "no_shm = 0", "admin_token = 5"])
def test_non_boolean_numbers_for_flags_are_config_errors(tmp_path: Path, body: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid value for (no_shm|admin_token): .* \(expected (bool|str)\)"):
        load_server_config({}, env={}, config_file=_write(tmp_path, body + "\n"))


# ---------------------------------------------------------------- registration and request limits


def test_limits_from_file_env_and_cli(tmp_path: Path) -> None:
    path = _write(tmp_path, "client_ttl = 60\nmax_models = 8\nmax_request_tokens = 4096\n")
    cfg = load_server_config({}, env={}, config_file=path)
    assert (cfg.client_ttl, cfg.max_models, cfg.max_request_tokens) == (60.0, 8, 4096)
    assert isinstance(cfg.client_ttl, float)
    env = {"KVDOCK_CLIENT_TTL": "1.5", "KVDOCK_MAX_MODELS": "9", "KVDOCK_MAX_REQUEST_TOKENS": "8192"}
    cfg = load_server_config({}, env=env, config_file=path)
    assert (cfg.client_ttl, cfg.max_models, cfg.max_request_tokens) == (1.5, 9, 8192)
    cli = {"client_ttl": "2", "max_models": None, "max_request_tokens": 16384}
    cfg = load_server_config(cli, env=env, config_file=path)
    assert (cfg.client_ttl, cfg.max_models, cfg.max_request_tokens) == (2.0, 9, 16384)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("max_request_tokens = 1.5", "max_request_tokens"),
        ('client_ttl = "soon"', "client_ttl"),
        ("max_models = true", "max_models"),
    ],
)
def test_wrongly_typed_limits_in_file(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid value for {field}"):
        load_server_config({}, env={}, config_file=_write(tmp_path, body + "\n"))


def test_cluster_urls_are_taken_apart_or_refused() -> None:
    from kvdock.redisurl import ClusterURL, parse_cluster_url

    assert parse_cluster_url("redis+cluster://h1:7000,h2:7001/") == ClusterURL(
        (("h1", 7000), ("h2", 7001)), None, None, False
    )
    assert parse_cluster_url("rediss+cluster://u:p%40ss@h:1") == ClusterURL((("h", 1),), "u", "p@ss", True)
    assert parse_cluster_url("redis+cluster://:secret@h:1").password == "secret"
    for bad, part in [
        ("redis+cluster://h1,h2:1", "'h1'"),
        ("redis+cluster://h:0/", "'h:0'"),
        ("redis+cluster:///", "''"),
    ]:
        with pytest.raises(ConfigError, match=f"{part} is not HOST:PORT"):
            ServerConfig(redis_url=bad).validate()
    with pytest.raises(ConfigError, match="redis_url must start with one of redis://"):
        ServerConfig(redis_url="cluster://h:1").validate()
    assert ServerConfig(redis_url="redis+cluster://127.0.0.1:7000").validate().redis_url


def test_the_l3_budget_is_a_size() -> None:
    assert load_server_config({"redis_max_bytes": "2GiB"}, env={}).redis_max_bytes == 2 * 2**30
    assert load_server_config({}, env={"KVDOCK_REDIS_MAX_BYTES": "1MiB"}).redis_max_bytes == 2**20
    assert load_server_config({}, env={}).redis_max_bytes == 0


def test_cluster_urls_with_ipv6_start_nodes_and_ports_that_collide() -> None:
    from kvdock.redisurl import parse_cluster_url

    assert parse_cluster_url("redis+cluster://[::1]:7000,10.0.0.2:7001/").nodes == (("::1", 7000), ("10.0.0.2", 7001))
    with pytest.raises(ConfigError, match="'::1:7000' is not HOST:PORT"):
        parse_cluster_url("redis+cluster://::1:7000")  # ambiguous without brackets
    with pytest.raises(ConfigError, match="kv_events_port 5555 must differ"):
        ServerConfig(kv_events_port=5555).validate()
    assert ServerConfig(kv_events_port=5557).validate().kv_events_url == "tcp://127.0.0.1:5557"


def test_events_name_the_host_when_the_server_binds_every_address() -> None:
    import socket

    from kvdock.server.events import advertised_url

    assert advertised_url(ServerConfig(host="0.0.0.0", port=6000)) == f"tcp://{socket.getfqdn()}:6000"
    assert advertised_url(ServerConfig(host="10.1.2.3", port=6000)) == "tcp://10.1.2.3:6000"

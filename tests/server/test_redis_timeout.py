"""``--redis-timeout-s`` (ServerConfig.redis_timeout_s): how long this server waits on Redis for a
connect or a reply before it takes L3 as down. Default 5 s, as before the setting existed."""

from __future__ import annotations

import signal
import time

import pytest

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for
from kvdock.config import ServerConfig, load_server_config
from kvdock.errors import ConfigError


def test_the_default_is_five_seconds_and_it_must_be_positive() -> None:
    assert ServerConfig().redis_timeout_s == 5.0
    assert load_server_config({"redis_timeout_s": "0.25"}, env={}).redis_timeout_s == 0.25
    assert load_server_config({}, env={"KVDOCK_REDIS_TIMEOUT_S": "2"}).redis_timeout_s == 2.0
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="redis_timeout_s must be positive"):
            ServerConfig(redis_timeout_s=bad).validate()


def test_a_stopped_redis_is_given_up_on_after_the_timeout_given(make_server, redis_server) -> None:
    """Redis stopped (SIGSTOP: connections are accepted, nothing is answered): an L1 miss asks L3
    and waits the timeout given (0.5 s here, not the default 5 s), then L3 is down and the lookup a
    miss; L3 is up again after SIGCONT."""
    srv = make_server("--no-disk", "--redis-url", redis_server.url, "--redis-timeout-s", "0.5")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        assert kvd.store(c, make_kv(2 * CHUNK, seed=1), make_tokens(2 * CHUNK))
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert kvd.lookup(c, make_tokens(2 * CHUNK, start=70_000)) == 0  # an L1 miss: asks L3
            took = time.monotonic() - t0
            wait_for(lambda: not srv.get("/status")["tiers"]["l3"]["up"], "L3 marked down", timeout=10)
            assert 0.4 < took < 4.0, f"the lookup waited {took:.2f} s on a stopped Redis (timeout 0.5 s)"
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: srv.get("/status")["tiers"]["l3"]["up"], "L3 back after SIGCONT", timeout=30)
        assert kvd.lookup(c, make_tokens(2 * CHUNK)) == 2 * CHUNK

"""Garbage on the kvdock command line (review R2 of issue 27): each is one clear error line and exit
code 2, never a traceback, and nothing that cannot work starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_cli_light import _env, _run

import kvdock.sdk as kvd
from helpers import CHUNK, make_tokens


def kvdock(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvdock ARGS`` in a fresh interpreter (what a user runs)."""
    cmd = [sys.executable, "-m", "kvdock.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--log-level", "foo"], "log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'foo'"),
        # nan passed every "> 0" check: a server whose sessions' pins are never released
        (["--session-ttl", "nan"], "session_ttl must be a finite number, got nan"),
        (["--l3-coherence-ms", "inf"], "l3_coherence_ms must be a finite number, got inf"),
        (["--writeback-wait-s", "inf"], "writeback_wait_s must be a finite number, got inf"),
    ],
)
def test_serve_refuses_values_that_cannot_work(flags: list[str], message: str) -> None:
    r = kvdock("serve", "--l1-size", "16MiB", "--no-disk", "--port", "1", "--http-port", "2", *flags)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"kvdock serve: error: {message}", r.stderr
    assert "serving" not in r.stderr


def test_status_of_a_url_that_is_not_http() -> None:
    for url in ("notaurl", "file:///etc"):
        r = kvdock("status", "--http-url", url)
        assert r.returncode == 2, (url, r.stderr)
        assert r.stderr.strip() == f"kvdock status: error: not an HTTP URL: {url!r} (e.g. http://127.0.0.1:9000)"


def test_import_register_with_a_wrong_admin_token(make_server, tmp_path) -> None:
    a = make_server()
    kv = torch.randn(2, 3, CHUNK, 16).to(torch.bfloat16)
    tokens = make_tokens(CHUNK, start=7)
    out = str(tmp_path / "p.kvb")
    with kvd.connect(a.url, a.http_url, "tiny", timeout=10) as c:
        kvd.store(c, kv, tokens)
        assert kvd.export_bundle(c, tokens, out) is not None
    b = make_server("--admin-token", "s3cret", register=None)
    dst = ["import", "--url", b.url, "--http-url", b.http_url, out, "--register"]
    r = _run(*dst, "--admin-token", "wrong", env=_env())
    assert r.returncode == 2 and "admin token" in r.stderr and r.stdout == "", r.stderr
    r = _run(*dst, env=_env(KVDOCK_ADMIN_TOKEN="wrong"))
    assert r.returncode == 2 and "admin token" in r.stderr and r.stdout == "", r.stderr
    assert b.get("/status")["cache_context_meta"] == []  # nothing registered, nothing stored


def test_the_startup_line_says_private_memory_with_tenants() -> None:
    """With tenants nobody maps the shared rest of L1 (a tenant's clients map their tenant's pool):
    the startup line said 'of shared memory'."""
    from kvdock.config import ServerConfig, startup_line

    given = ServerConfig(l1_size=2**23, no_disk=True, tenants="tenants.toml")
    assert "L1 size: 8.00 MiB (given) of tenants' pools and private memory, pre-faulted" in startup_line(given, given)
    given = ServerConfig(l1_size=2**23, no_disk=True, no_shm=True)
    assert "L1 size: 8.00 MiB (given) of private memory, pre-faulted" in startup_line(given, given)

"""The HTTP API: discovery documents, health, Prometheus metrics, guarded admin actions."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, L1_SIZE, MODEL, make_kv, make_tokens
from kvdock.protocol.messages import PROTOCOL_VERSION
from kvdock.sizes import parse_size


def test_config_and_status_documents(server, ctx) -> None:
    cfg = server.get("/config")
    assert cfg["chunk_size"] == CHUNK and cfg["protocol_version"] == PROTOCOL_VERSION
    assert cfg["zmq_url"] == server.url and cfg["transports"] == ["shm", "inline"]
    pool = parse_size(L1_SIZE)
    assert cfg["l1"]["shm_enabled"] is True and cfg["l1"]["size_bytes"] == pool
    assert kvd.store(ctx, make_kv(2 * CHUNK), make_tokens(2 * CHUNK))
    st = server.get("/status")
    assert st["health"] == "ok" and st["sessions"] == 0 and st["clients"] == 1
    assert st["l1"] == {
        "capacity_bytes": pool,
        "used_bytes": 8192,
        "free_bytes": pool - 8192,
        "objects": 2,
        "evictions": 0,
        "quarantined_bytes": 0,
        "unsent_reply_bytes": 0,
        "eviction": {
            "eviction_policy": "s3fifo",
            "evicted_clean": 0,
            "evicted_dirty": 0,
            "evicted_dirty_bytes": 0,
            "throttled_stores": 0,
            "throttle_seconds": 0.0,
            "throttle_timeouts": 0,
            "dirty_objects": 0,
            "dirty_bytes": 0,
            "writeback_wait_s": 2.0,
            "writeback_dirty_limit": 0.5,
        },
    }
    (meta,) = st["cache_context_meta"]
    assert meta["model_name"] == MODEL and meta["world_size"] == 1
    assert meta["kv_cache_layout"] == {
        "num_layers": 3,
        "dtype": "bfloat16",
        "tokens_per_block": 16,
        "engine_kv_format": "NHD",
        "engine_kv_concrete_shape": [2, 1, 16, 2, 8],
    }
    assert meta["chunk_nbytes"] == 3072
    assert meta["layout"] == {
        "model_name": MODEL,
        "geometry": {
            "num_layers": 3,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "bfloat16",
            "kv_kind": "pair",
            "world_size": 1,
            "rank": 0,
            "total_kv_heads": 0,
            "pp_size": 1,
            "pp_rank": 0,
        },
        "tokens_per_block": 16,
        "engine": {
            "name": "sdk",
            "version": "",
            "attention_backend": "",
            "kv_cache_layout": "NHD",
            "view_shape": [2, 1, 16, 2, 8],
            "view_strides": [],
            "pp_rank": 0,
            "pp_size": 1,
        },
        "fingerprint": "",  # none given: the SDK's registration asserts nothing
    }
    assert set(meta) == {"model_name", "world_size", "kv_cache_layout", "layout", "chunk_nbytes"}


def test_healthz_and_metrics(server, ctx) -> None:
    assert server.text("/healthz") == "ok"
    kv = make_kv(3 * CHUNK)
    assert kvd.store(ctx, kv, make_tokens(3 * CHUNK))
    assert kvd.store(ctx, kv, make_tokens(3 * CHUNK)) is False
    assert kvd.retrieve(ctx, make_tokens(5 * CHUNK)) is not None
    assert kvd.lookup(ctx, make_tokens(2 * CHUNK)) == 2 * CHUNK
    # reads answered from the pool directory are reported to the server a moment later, and at
    # the latest before the next request
    assert kvd.check_server_integrity(ctx) == []
    text = server.text("/metrics")
    expected = [
        "kvdock_stores_total 1.0",
        "kvdock_retrieves_total 1.0",
        "kvdock_lookups_total 1.0",
        f"kvdock_hit_tokens_total {5.0 * CHUNK}",  # 3 chunks retrieved + 2 looked up
        f"kvdock_miss_tokens_total {2.0 * CHUNK}",
        "kvdock_stored_chunks_total 3.0",
        "kvdock_deduped_chunks_total 3.0",
        f"kvdock_stored_bytes_total {3.0 * 3072}",
        f"kvdock_retrieved_bytes_total {3.0 * 3072}",
        "kvdock_l1_used_bytes 12288.0",
        "kvdock_l1_objects 3.0",
        'kvdock_requests_total{op="PrepareStore"} 2.0',
    ]
    for line in expected:
        assert line in text.splitlines(), line


def _post(url: str, token: str | None = None, authorization: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, method="POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if authorization is not None:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_admin_clear_needs_the_token(make_server) -> None:
    srv = make_server("--admin-token", "s3cret", register=None)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token="s3cret")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        kv = make_kv(2 * CHUNK)
        assert kvd.store(c, kv, make_tokens(2 * CHUNK))
        assert _post(srv.http_url + "/admin/clear")[0] == 401
        assert _post(srv.http_url + "/admin/clear", "wrong")[0] == 401
        assert torch.equal(kvd.retrieve(c, make_tokens(2 * CHUNK)), kv)
        assert _post(srv.http_url + "/admin/clear", "s3cret") == (200, '{"removed": 2, "removed_l2": 0}')
        assert kvd.lookup(c, make_tokens(2 * CHUNK)) == 0
        assert kvd.check_server_integrity(c) == []


def test_admin_clear_one_tier(make_server, tmp_path) -> None:
    import time

    srv = make_server("--disk-dir", str(tmp_path / "l2"))
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        kv = make_kv(2 * CHUNK)
        assert kvd.store(c, kv, make_tokens(2 * CHUNK))
        deadline = time.monotonic() + 10
        while srv.get("/status")["tiers"]["l2"]["objects"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _post(srv.http_url + "/admin/clear?tier=bogus")[0] == 400
        assert _post(srv.http_url + "/admin/clear?tier=l1") == (200, '{"removed": 2, "removed_l2": 0}')
        assert srv.get("/status")["l1"]["objects"] == 0
        assert torch.equal(kvd.retrieve(c, make_tokens(2 * CHUNK)), kv)  # back from L2
        assert _post(srv.http_url + "/admin/clear?tier=l2") == (200, '{"removed": 0, "removed_l2": 2}')
        assert srv.get("/status")["tiers"]["l2"]["objects"] == 0
        assert list((tmp_path / "l2").glob("*/*.kv")) == []
        assert kvd.lookup(c, make_tokens(2 * CHUNK)) == 2 * CHUNK  # still in L1
        assert kvd.check_server_integrity(c) == []


@pytest.mark.parametrize("path", ["/status", "/config"])
def test_http_binds_loopback_by_default(server, path: str) -> None:
    assert server.get(path)  # reachable on 127.0.0.1
    assert "--host" not in server.args
    assert server.get("/config")["zmq_url"].startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize(
    "authorization",
    ["s3cret", "bearer s3cret", "Bearer  s3cret", "Bearer:s3cret", "Basic s3cret", "Bearer", "Bearer s3cret2", ""],
)
def test_admin_token_must_be_given_exactly_as_bearer(make_server, authorization: str) -> None:
    srv = make_server("--admin-token", "s3cret", register=None)
    assert _post(srv.http_url + "/admin/clear", authorization=authorization) == (
        401,
        "admin token required (Authorization: Bearer <token>)",
    )
    assert _post(srv.http_url + "/admin/clear", authorization="Bearer s3cret") == (
        200,
        '{"removed": 0, "removed_l2": 0}',
    )


def _raw_http(port: int, request: bytes) -> tuple[bytes, int]:
    """Send raw bytes, return (the reply, how many tries it took). The server answers a request it
    cannot parse before reading all of it and then closes, so the kernel may reset the connection
    and lose the reply: try again (each try is one more request in the server's log)."""
    for tries in range(1, 6):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            chunks = []
            try:
                s.sendall(request)
                while chunk := s.recv(65536):
                    chunks.append(chunk)
            except (ConnectionResetError, BrokenPipeError):
                pass
        if chunks:
            return b"".join(chunks), tries
    raise AssertionError("no reply in 5 tries")


@pytest.mark.parametrize(
    ("request_bytes", "detail"),
    [
        (
            b"GET /" + b"a" * 80_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            "400 Got more than 8190 bytes when reading: bytearray(b'/aaaaa",
        ),
        (
            b"GET /status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 80_000 + b"\r\n\r\n",
            "400 Got more than 8190 bytes when reading: b'bbbbb",
        ),
    ],
)
def test_an_oversized_request_gets_a_400_and_one_short_log_line(server, request_bytes: bytes, detail: str) -> None:
    reply, tries = _raw_http(server.http_port, request_bytes)
    assert reply.startswith(b"HTTP/1.0 400 Bad Request\r\n"), reply[:200]
    deadline = time.monotonic() + 10
    while server.log().count("Error handling request") < tries:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert server.text("/healthz") == "ok"  # still serving
    log = server.log()
    assert "Traceback" not in log
    lines = [ln for ln in log.splitlines() if "aiohttp" in ln]
    assert len(lines) == tries  # one line per bad request, nothing else
    for line in lines:
        assert " WARNING aiohttp.server: Error handling request from 127.0.0.1: " + detail in line, line
        assert line.endswith("...") and len(line) < 250, line


def test_status_shows_the_client_count_and_no_client_id(server) -> None:
    with (
        kvd.connect(server.url, server.http_url, MODEL, timeout=5) as a,
        kvd.connect(server.url, server.http_url, MODEL, timeout=5) as b,
    ):
        text = server.text("/status")
        st = server.get("/status")
        assert st["clients"] == 2
        assert a.client_id not in text and b.client_id not in text
        metrics = server.text("/metrics").splitlines()
        assert "kvdock_clients 2.0" in metrics and "kvdock_models 1.0" in metrics
    assert server.get("/status")["clients"] == 0
    cfg = server.get("/config")
    assert (cfg["client_ttl"], cfg["max_request_tokens"]) == (300.0, 1048576)


def test_a_client_that_hangs_up_on_expect_100_continue_logs_no_traceback(server) -> None:
    request = b"GET /status HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10\r\n\r\n"
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
    time.sleep(0.3)
    assert server.text("/healthz") == "ok"  # still serving
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 200 :][:1500]

"""The HTTP API: discovery documents, health, Prometheus metrics, guarded admin actions."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens


def test_config_and_status_documents(server, ctx) -> None:
    cfg = server.get("/config")
    assert cfg["chunk_size"] == CHUNK and cfg["protocol_version"] == 1
    assert cfg["zmq_url"] == server.url and cfg["transports"] == ["shm", "inline"]
    assert cfg["l1"]["shm_enabled"] is True and cfg["l1"]["size_bytes"] == 64 * 2**20
    assert kvd.store(ctx, make_kv(2 * CHUNK), make_tokens(2 * CHUNK))
    st = server.get("/status")
    assert st["health"] == "ok" and st["sessions"] == 0 and st["clients"] == 1
    assert st["l1"] == {
        "capacity_bytes": 64 * 2**20,
        "used_bytes": 8192,
        "free_bytes": 64 * 2**20 - 8192,
        "objects": 2,
        "evictions": 0,
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


def test_healthz_and_metrics(server, ctx) -> None:
    assert server.text("/healthz") == "ok"
    kv = make_kv(3 * CHUNK)
    assert kvd.store(ctx, kv, make_tokens(3 * CHUNK))
    assert kvd.store(ctx, kv, make_tokens(3 * CHUNK)) is False
    assert kvd.retrieve(ctx, make_tokens(5 * CHUNK)) is not None
    assert kvd.lookup(ctx, make_tokens(2 * CHUNK)) == 2 * CHUNK
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


def _post(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, method="POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_admin_clear_needs_the_token(make_server) -> None:
    srv = make_server("--admin-token", "s3cret")
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

"""A client that dies mid-flow loses its pins and reservations when its lease runs out."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens

CHILD = textwrap.dedent(
    """
    import sys, time
    import kvdock.sdk as kvd
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    url, http_url, model, what = sys.argv[1:5]
    ctx = kvd.connect(url, http_url, model, timeout=5)
    tokens = normalize_tokens(list(range(4 * {chunk}))).tobytes()
    if what == "store":
        reply = ctx.call(m.PrepareStore(ctx.client_id, "s1", tokens)).reply
        # scribble half of the first slot, as if killed in the middle of the copy
        if ctx.transport == "shm":
            ctx._transfer._slot(reply.slots[0].offset).view(-1)[:10].fill_(7)
    else:
        reply = ctx.call(m.PrepareRetrieve(ctx.client_id, "r1", tokens)).reply
    print(len(reply.slots), flush=True)
    time.sleep(600)
    """
).format(chunk=CHUNK)


def _run_child(srv, what: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, srv.url, srv.http_url, MODEL, what], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "4"
    return p


def _wait_sessions(srv, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.get("/status")["sessions"] != n:
        assert time.monotonic() < deadline, f"sessions still {srv.get('/status')['sessions']}"
        time.sleep(0.1)


def test_killed_store_leaves_nothing_locked(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="16KiB")  # room for exactly the 4 chunks
    child = _run_child(srv, "store")
    assert srv.get("/status")["sessions"] == 1
    assert srv.get("/status")["l1"]["used_bytes"] == 4 * 4096
    child.send_signal(signal.SIGKILL)
    child.wait()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        tokens = make_tokens(4 * CHUNK)
        assert kvd.lookup(c, tokens) == 0  # reserved chunks were never visible
        _wait_sessions(srv, 0)
        assert srv.get("/status")["l1"]["used_bytes"] == 0
        kv = make_kv(4 * CHUNK, seed=3)
        assert kvd.store(c, kv, tokens) is True  # not deduped against the dead reservation
        assert torch.equal(kvd.retrieve(c, tokens), kv)
        assert kvd.check_server_integrity(c) == []
    assert "lease expired" in srv.log()


def test_killed_retrieve_releases_its_pins(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="16KiB")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        kv = make_kv(4 * CHUNK, seed=4)
        assert kvd.store(c, kv, make_tokens(4 * CHUNK))
        child = _run_child(srv, "retrieve")  # pins all four slots
        other = make_kv(CHUNK, seed=5)
        with pytest.raises(kvd.PoolFullError):
            kvd.store(c, other, make_tokens(CHUNK, start=10_000))
        child.send_signal(signal.SIGKILL)
        child.wait()
        _wait_sessions(srv, 0)
        assert kvd.store(c, other, make_tokens(CHUNK, start=10_000)) is True  # evicts an unpinned chunk now
        assert kvd.check_server_integrity(c) == []
    metrics = srv.text("/metrics")
    assert "kvdock_expired_sessions_total 1.0" in metrics

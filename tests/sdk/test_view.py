"""Zero-copy views (``kvd.view``): the slots themselves, read-only, pinned while open, zeros
after, and a LeaseExpiredError (never silently other bytes) for a view that outlived its lease."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, MODEL, make_kv, make_tokens, open_sessions, wait_sessions
from kvdock.protocol import messages as m

PAUSED = str(Path(__file__).parent.parent / "paused_client.py")


def test_a_view_shows_the_stored_bytes_chunk_by_chunk_without_a_copy(server, ctx) -> None:
    toks = make_tokens(4 * CHUNK + 5)
    kv = make_kv(len(toks), seed=1)
    kvd.store(ctx, kv, toks)
    with kvd.view(ctx, toks) as v:
        assert (v.num_tokens, len(v), v.chunk_size) == (4 * CHUNK, 4, CHUNK)
        for i, chunk in enumerate(v):
            assert chunk.shape == (2, 3, CHUNK, 16) and chunk.dtype == ctx.dtype
            assert torch.equal(chunk, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        # the same memory as the server's slot, not a copy: two chunk() calls share a pointer
        assert v.chunk(2).data_ptr() == v.chunk(2).data_ptr()
        assert torch.equal(v.tensor(), kv[:, :, : 4 * CHUNK])
        assert torch.equal(v.tensor(layers=range(1, 3)), kv[:, 1:3, : 4 * CHUNK])
        assert open_sessions(server) == 1  # pinned while open
        with pytest.raises(IndexError, match="chunk 4 of a view of 4 chunks"):
            v.chunk(4)
        with pytest.raises(kvd.InvalidInputError, match="layers"):
            v.tensor(layers=range(2, 9))
    wait_sessions(server, 0)
    assert kvd.check_server_integrity(ctx) == []


def test_tensors_kept_past_the_block_read_zeros_never_the_next_object(server, ctx) -> None:
    toks = make_tokens(2 * CHUNK, start=1000)
    kv = make_kv(2 * CHUNK, seed=2)
    kvd.store(ctx, kv, toks)
    with kvd.view(ctx, toks) as v:
        kept = v.chunk(1)
        assert torch.equal(kept, kv[:, :, CHUNK:])
    assert bool((kept == 0).all())
    assert v.closed
    with pytest.raises(kvd.KVCacheSDKError, match="closed"):
        v.chunk(0)
    # the slots themselves still hold the object
    assert torch.equal(kvd.retrieve(ctx, toks), kv)
    kvd.store(ctx, make_kv(2 * CHUNK, seed=3), toks, overwrite=True)
    assert bool((kept == 0).all())


def test_a_write_into_a_view_kills_the_writer_not_the_cache(server, ctx, tmp_path) -> None:
    toks = make_tokens(CHUNK, start=2000)
    kv = make_kv(CHUNK, seed=4)
    kvd.store(ctx, kv, toks)
    code = (
        "import sys; import kvdock.sdk as kvd\n"
        f"c = kvd.connect({server.url!r}, {server.http_url!r}, {MODEL!r})\n"
        f"v = kvd.view(c, list(range(2000, 2000 + {CHUNK})))\n"
        "print(v.num_tokens, flush=True)\n"
        "v.chunk(0).fill_(1.0)\n"
    )
    p = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == str(CHUNK), p.stderr
    assert p.returncode == -signal.SIGSEGV
    assert torch.equal(kvd.retrieve(ctx, toks), kv)


def test_a_miss_is_an_empty_view(server, ctx) -> None:
    with kvd.view(ctx, make_tokens(3 * CHUNK, start=9000)) as v:
        assert (v.num_tokens, len(v), list(v)) == (0, 0, [])
        assert v.tensor().shape == (2, 3, 0, 16)
    with kvd.view(ctx, make_tokens(CHUNK - 1)) as v:  # no whole chunk
        assert v.num_tokens == 0
    assert open_sessions(server) == 0


def test_a_view_holds_its_pins_past_the_session_ttl(make_server) -> None:
    srv = make_server("--session-ttl", "0.6")
    toks = make_tokens(2 * CHUNK, start=3000)
    kv = make_kv(2 * CHUNK, seed=5)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        kvd.store(c, kv, toks)
        with kvd.view(c, toks) as v:
            deadline = time.monotonic() + 2.0  # over three leases: renewed every 0.2 s meanwhile
            while time.monotonic() < deadline:
                assert open_sessions(srv) == 1
                time.sleep(0.1)
            assert torch.equal(v.chunk(0), kv[:, :, :CHUNK])
        wait_sessions(srv, 0)
        assert "kvdock_expired_sessions_total 0.0" in srv.text("/metrics")


def test_closing_the_context_or_dropping_the_view_releases_it(server) -> None:
    toks = make_tokens(CHUNK, start=4000)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        kvd.store(c, make_kv(CHUNK, seed=6), toks)
        v = kvd.view(c, toks)
        kept = v.chunk(0)
        del v
        gc.collect()
        deadline = time.monotonic() + 5
        while open_sessions(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert open_sessions(server) == 0 and bool((kept == 0).all())
        v2 = kvd.view(c, toks)
        kept = v2.chunk(0)
    assert v2.closed and bool((kept == 0).all())  # the context closed it first
    deadline = time.monotonic() + 5
    while open_sessions(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open_sessions(server) == 0


def test_the_inline_transport_has_no_views(make_server) -> None:
    srv = make_server("--no-shm")
    with kvd.connect(srv.url, srv.http_url, MODEL) as c, pytest.raises(kvd.KVCacheSDKError, match="inline transport"):
        kvd.view(c, make_tokens(CHUNK))


def test_a_view_paused_past_its_lease_raises_instead_of_passing_off_other_bytes(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="64KiB")  # 16 slots of 4 KiB
    a, b = make_tokens(4 * CHUNK), make_tokens(12 * CHUNK, start=50_000)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        kvd.store(c, make_kv(4 * CHUNK, seed=1), a)
        child = zygote.Popen(
            [sys.executable, PAUSED, srv.url, srv.http_url, MODEL, "view", "0", str(4 * CHUNK), "-"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "paused"
        deadline = time.monotonic() + 10
        while open_sessions(srv):  # its lease runs out while it is stopped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kvd.store(c, make_kv(4 * CHUNK, seed=2), a, overwrite=True)  # the viewed slots are freed ...
        kvd.store(c, make_kv(12 * CHUNK, seed=3), b)  # ... and every slot is taken by others
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=30)
        got = json.loads(out.strip().splitlines()[-1])
        assert got["error"] == "LeaseExpiredError", (got, err)
        assert "discard" in got["message"]
        assert kvd.check_server_integrity(c) == []


def test_renew_sessions_renews_open_ones_and_names_the_gone(server, ctx) -> None:
    toks = make_tokens(CHUNK, start=6000)
    kvd.store(ctx, make_kv(CHUNK, seed=7), toks)
    with kvd.view(ctx, toks) as v:
        sid = v._lease.session_id  # type: ignore[union-attr]
        reply = ctx.call(m.RenewSessions(ctx.client_id, [sid, "nope"])).reply
        assert reply == m.Renewed(["nope"])
    with pytest.raises(kvd.InvalidInputError, match="at most 4096 sessions"):
        ctx.call(m.RenewSessions(ctx.client_id, ["x"] * 4097))

"""Regression tests from the review of zero-copy views: revocation by the context, unaligned
pools, a copy racing a release, a dying keeper, finalizers that must not lock, renewals past
MAX_RENEW, and the snapshot contract."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens, open_sessions, wait_sessions
from kvdock.protocol import messages as m
from kvdock.sdk import views


def test_closing_the_context_revokes_a_view_and_its_owner_hears_of_it(server) -> None:
    toks = make_tokens(2 * CHUNK)
    c = kvd.connect(server.url, server.http_url, MODEL)
    kvd.store(c, make_kv(2 * CHUNK, seed=1), toks)
    v = kvd.view(c, toks)
    kept = v.chunk(1)
    c.close()
    assert bool((kept == 0).all()) and v.closed
    with pytest.raises(kvd.LeaseExpiredError, match="revoked by its context's close"):
        v.close()
    v.close()  # reported once
    with pytest.raises(kvd.LeaseExpiredError, match="released"):
        v.verify()
    wait_sessions(server, 0)


def test_a_view_of_a_pool_that_is_not_a_whole_number_of_pages_closes_cleanly(make_server) -> None:
    srv = make_server(l1_size="1000001")
    toks = make_tokens(CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        kv = make_kv(CHUNK, seed=2)
        kvd.store(c, kv, toks)
        with kvd.view(c, toks) as v:
            kept = v.chunk(0)
            assert torch.equal(kept, kv)
        assert bool((kept == 0).all())
        wait_sessions(srv, 0)


def test_a_gather_racing_a_release_raises_instead_of_returning_zeros(server, ctx, monkeypatch) -> None:
    toks = make_tokens(2 * CHUNK, start=100)
    kvd.store(ctx, make_kv(2 * CHUNK, seed=3), toks)
    v = kvd.view(ctx, toks)

    class RevokingCopier(views.Copier):
        def run(self) -> None:
            v.revoke()  # another thread (or the context's close) gets in between
            super().run()

    monkeypatch.setattr(views, "Copier", RevokingCopier)
    with pytest.raises(kvd.LeaseExpiredError, match="released"):
        v.tensor()


def test_a_view_is_a_snapshot_an_overwrite_does_not_change_it(server, ctx) -> None:
    toks = make_tokens(CHUNK, start=200)
    old, new = make_kv(CHUNK, seed=4), make_kv(CHUNK, seed=5)
    kvd.store(ctx, old, toks)
    with kvd.view(ctx, toks) as v:
        assert kvd.store(ctx, new, toks, overwrite=True)
        assert torch.equal(kvd.retrieve(ctx, toks), new)
        assert torch.equal(v.chunk(0), old)  # pinned: the old version lives until the view closes
    assert torch.equal(kvd.retrieve(ctx, toks), new)
    assert kvd.check_server_integrity(ctx) == []


def test_the_keeper_outlives_an_unexpected_error(make_server, monkeypatch) -> None:
    srv = make_server("--session-ttl", "0.6")
    toks = make_tokens(CHUNK, start=300)
    failures = []
    renew = views._Keeper.renew

    def flaky(ctx, leases, timeout):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise RuntimeError("boom")
        return renew(ctx, leases, timeout)

    monkeypatch.setattr(views._Keeper, "renew", staticmethod(flaky))
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        kvd.store(c, make_kv(CHUNK, seed=6), toks)
        with kvd.view(c, toks) as v:
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert open_sessions(srv) == 1
                time.sleep(0.1)
            v.verify()
        assert failures == [1]


def test_dropping_pooled_tensors_and_views_under_held_locks_never_deadlocks(server, ctx) -> None:
    pool = kvd.BufferPool(64 << 20)
    t = pool.empty((4 << 20,), torch.uint8)
    with pool._lock:  # a GC pass inside a locked section runs the finalizer right here
        del t
        gc.collect()
    assert pool.stats().free_bytes == 4 << 20
    toks = make_tokens(CHUNK, start=400)
    kvd.store(ctx, make_kv(CHUNK, seed=7), toks)
    v = kvd.view(ctx, toks)
    kept = v.chunk(0)
    with ctx._conn._client._sock_lock, ctx._refs:
        del v
        gc.collect()  # the finalizer only queues the lease for the keeper
    wait_sessions(server, 0)
    assert bool((kept == 0).all())


def test_renewals_are_split_at_max_renew_and_name_every_gone_session(server, ctx) -> None:
    class Fake:
        def __init__(self, sid: str) -> None:
            self.client_id, self.session_id, self.lost = ctx.client_id, sid, False

        def lose(self) -> None:
            self.lost = True

    fakes = [Fake(f"s{i}") for i in range(m.MAX_RENEW + 10)]
    views._Keeper.renew(ctx, fakes, timeout=10)  # type: ignore[arg-type]
    assert all(f.lost for f in fakes)


def test_a_bad_copy_thread_count_is_a_clear_error_at_connect(server, monkeypatch) -> None:
    monkeypatch.setenv("KVDOCK_COPY_THREADS", "lots")
    with pytest.raises(kvd.InvalidInputError, match="KVDOCK_COPY_THREADS='lots'"):
        kvd.connect(server.url, server.http_url, MODEL)


def test_a_bad_buffer_pool_size_is_a_clear_error_and_sizes_take_units(server, monkeypatch) -> None:
    from kvdock.sdk.buffers import default_max_bytes

    monkeypatch.setenv("KVDOCK_BUFFER_POOL_BYTES", "512MiB")
    assert default_max_bytes() == 512 << 20
    monkeypatch.setenv("KVDOCK_BUFFER_POOL_BYTES", "plenty")
    with pytest.raises(kvd.InvalidInputError, match="KVDOCK_BUFFER_POOL_BYTES='plenty'"):
        kvd.connect(server.url, server.http_url, MODEL)


def test_a_view_maps_only_the_span_of_its_slots(server, ctx) -> None:
    toks = make_tokens(2 * CHUNK, start=500)
    kvd.store(ctx, make_kv(2 * CHUNK, seed=8), toks)
    with kvd.view(ctx, toks) as v:
        lease = v._lease
        assert lease is not None and lease.mm is not None
        offsets = [s.offset for s in v._slots]
        assert len(lease.mm) == max(offsets) + v._nbytes - min(offsets) // 4096 * 4096
        assert len(lease.mm) < (64 << 20)  # not the whole pool

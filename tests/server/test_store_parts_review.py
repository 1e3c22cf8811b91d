"""Review of a store committed in parts (CommitStore ``more``: sdk._storeparts,
server.storing._commit_part), through real in-process servers, shared memory and a real client
process: what happens between two parts when the lease runs out, another client overwrites the
part's prefix, the part is evicted, or the client is killed. Each must leave whole chunks of one
version (the part, bytes exact) or a miss, and the server's books straight. Lease ends use the
session table's injected clock, never sleeps. The strict xfail is a finding of the review."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, AnyServer, InProcessServer, make_kv, make_tokens, wait_for
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk.chunks import TensorChunks
from kvdock.storage.sessions import SessionTable

N = 8  # chunks a store
Two = tuple[InProcessServer, kvd.KVCacheContext, kvd.KVCacheContext]  # a server, clients A and B


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _prepare(ctx: kvd.KVCacheContext, tokens: list[int], sid: str) -> list[m.SlotRef]:
    whole = np.asarray(tokens, TOKEN_DTYPE).tobytes()
    prep = ctx.ask(m.PrepareStore(ctx.client_id, sid, whole, "", False))
    assert [s.index for s in prep.slots] == list(range(N))
    return list(prep.slots)


def _write(ctx: kvd.KVCacheContext, slots: list[m.SlotRef], kv: torch.Tensor) -> None:
    with ctx.transfer() as t:
        t.write(slots, TensorChunks(kv, CHUNK))


class Clock:
    """The server's session clock, moved by the test (set on the loop: the reaper reads it there)."""

    def __init__(self, srv: InProcessServer) -> None:
        assert srv.state is not None
        self.srv, self.now = srv, 0.0
        self.sessions: SessionTable = srv.state.manager.sessions
        srv.call(lambda: setattr(self.sessions, "_clock", lambda: self.now))

    def expire(self) -> int:
        """Past every lease: the leases that ran out end now (their slots quarantined)."""
        self.now += 1e6
        return int(self.srv.call(self.sessions.expire))

    def quarantined(self) -> int:
        return int(self.srv.call(self.sessions.quarantined_bytes))


@pytest.fixture
def two(make_server: Callable[..., AnyServer]) -> Iterator[Two]:
    srv = make_server()
    assert isinstance(srv, InProcessServer)
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as b,
    ):
        yield srv, a, b
        assert kvd.check_server_integrity(a) == []


def test_a_lease_run_out_between_parts_keeps_the_rest_quarantined_until_the_last_commit(
    two: Two,
) -> None:
    srv, ctx, _ = two
    clock = Clock(srv)
    tokens, kv = make_tokens(N * CHUNK, 100), make_kv(N * CHUNK, seed=1)
    slots = _prepare(ctx, tokens, "s1")
    _write(ctx, slots[:2], kv)
    assert ctx.ask(m.CommitStore(ctx.client_id, "s1", [0, 1], more=True)).committed == 2
    assert clock.expire() == 1  # (the client paused past its lease while copying the next part)
    held = clock.quarantined()
    assert held >= 6 * 3072  # the 6 slots still being copied: never handed to anyone else
    with pytest.raises(kvd.LeaseExpiredError, match="no open session"):  # a late part: refused ...
        ctx.ask(m.CommitStore(ctx.client_id, "s1", [2, 3], more=True))
    assert clock.quarantined() == held  # ... and the slots stay quarantined (its copy goes on)
    _write(ctx, slots[2:], torch.zeros_like(kv))
    with pytest.raises(kvd.LeaseExpiredError, match="lease ran out"):  # the last commit ends the copy
        ctx.ask(m.CommitStore(ctx.client_id, "s1", list(range(N))))
    assert clock.quarantined() == 0
    assert kvd.lookup(ctx, tokens) == 2 * CHUNK  # the part, whole and exact; nothing of the rest
    assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 2 * CHUNK])


@pytest.mark.xfail(
    strict=True,
    reason="after a part, a lease run out makes the last CommitStore say 'nothing was stored' "
    "(storage.manager.reservations, storing._check_group) while the parts' chunks are stored",
)
def test_the_last_commit_refused_after_parts_does_not_say_nothing_was_stored(
    two: Two,
) -> None:
    srv, ctx, _ = two
    clock = Clock(srv)
    tokens, kv = make_tokens(N * CHUNK, 150), make_kv(N * CHUNK, seed=9)
    slots = _prepare(ctx, tokens, "s9")
    _write(ctx, slots, kv)
    assert ctx.ask(m.CommitStore(ctx.client_id, "s9", [0, 1], more=True)).committed == 2
    assert clock.expire() == 1
    with pytest.raises(kvd.LeaseExpiredError) as refused:
        ctx.ask(m.CommitStore(ctx.client_id, "s9", list(range(N))))
    assert kvd.lookup(ctx, tokens) == 2 * CHUNK  # stored: the part
    assert "nothing was stored" not in str(refused.value)


def test_an_overwrite_of_the_parts_prefix_between_parts_leaves_no_mix(
    two: Two,
) -> None:
    """B's overwrite of the two chunks A's part committed is not contended (they are READY), so it
    lands between A's parts; A's later chunks chain to A's replaced version: never read after B's."""
    _, a, b = two
    tokens, kv, new = make_tokens(N * CHUNK, 200), make_kv(N * CHUNK, seed=2), make_kv(2 * CHUNK, seed=3)
    slots = _prepare(a, tokens, "s2")
    _write(a, slots[:2], kv)
    assert a.ask(m.CommitStore(a.client_id, "s2", [0, 1], more=True)).committed == 2
    assert kvd.store(b, new, tokens[: 2 * CHUNK], overwrite=True)  # acknowledged
    _write(a, slots[2:4], kv)
    assert a.ask(m.CommitStore(a.client_id, "s2", [2, 3], more=True)).committed == 2
    _write(a, slots[4:], kv)
    assert a.ask(m.CommitStore(a.client_id, "s2", list(range(N)))).committed == N
    assert kvd.lookup(b, tokens) == 2 * CHUNK
    assert same(kvd.retrieve(b, tokens), new)  # B's version, and nothing of A's after it


def test_a_part_evicted_while_the_rest_is_copied(make_server: Callable[..., AnyServer]) -> None:
    srv = make_server(l1_size="64KiB")  # ~20 slots: B's stores evict A's committed part
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as b,
    ):
        tokens, kv = make_tokens(N * CHUNK, 300), make_kv(N * CHUNK, seed=4)
        slots = _prepare(a, tokens, "s3")
        _write(a, slots[:2], kv)
        assert a.ask(m.CommitStore(a.client_id, "s3", [0, 1], more=True)).committed == 2
        others = [(make_tokens(4 * CHUNK, 10_000 * (k + 1)), make_kv(4 * CHUNK, seed=10 + k)) for k in range(4)]
        for toks, other in others:
            assert kvd.store(b, other, toks)
        assert kvd.lookup(a, tokens) == 0  # the part went (its slots reused by B's chunks)
        _write(a, slots[2:], kv)  # (A's own slots: still reserved)
        assert a.ask(m.CommitStore(a.client_id, "s3", list(range(N)))).committed == N
        assert kvd.retrieve(a, tokens) is None  # the rest has no prefix: a miss
        for toks, other in others[-2:]:  # B's newest chunks, untouched by A's copy
            assert same(kvd.retrieve(b, toks), other)
        assert kvd.check_server_integrity(a) == []


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, "tests")
    import kvdock.sdk as kvd
    from kvdock.sdk import _storeparts
    from helpers import CHUNK, make_kv, make_tokens
    url, http_url, model = sys.argv[1:4]
    _storeparts.PART_BYTES = 1  # every store in parts: [0, 1], [2, 3], ...
    kv = make_kv(8 * CHUNK, seed=5)

    class Stalls:  # copies chunks 0 and 1, then stalls in the second part's copy
        def put(self, index, dst):
            if index == 2:
                print("stalled", flush=True)
                time.sleep(600)
            dst.copy_(kv[:, :, index * CHUNK : (index + 1) * CHUNK])

    ctx = kvd.connect(url, http_url, model, timeout=5)
    kvd.store_from(ctx, Stalls(), make_tokens(8 * CHUNK, 400))
    """
)


def test_a_client_killed_between_parts_leaves_the_part_only(
    make_server: Callable[..., AnyServer], tmp_path: Path
) -> None:
    srv = make_server()
    assert isinstance(srv, InProcessServer)
    clock = Clock(srv)
    tokens, kv = make_tokens(N * CHUNK, 400), make_kv(N * CHUNK, seed=5)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, srv.url, srv.http_url, MODEL], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "stalled"
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
            wait_for(lambda: kvd.lookup(ctx, tokens) == 2 * CHUNK, "the first part, committed without waiting")
            child.kill()
            child.wait()
            assert clock.expire() == 1
            assert srv.call(clock.sessions.reap_quarantine) == N - 2  # its writer is gone
            assert clock.quarantined() == 0
            assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 2 * CHUNK])
            r = kvd.store_chunks(ctx, kv, tokens)  # the rest stores later, after the part
            assert (r.stored_chunks, r.deduped_chunks) == (N - 2, 2)
            assert same(kvd.retrieve(ctx, tokens), kv)
            assert kvd.check_server_integrity(ctx) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

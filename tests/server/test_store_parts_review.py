"""Review of a store committed in parts (CommitStore ``more``: sdk._storeparts,
server.storing._commit_part), through real in-process servers and shared memory: what happens
between two parts when the lease runs out while the client still copies, another client
overwrites the part's prefix, or other stores fill the pool. Each must leave whole chunks of one
version (the part, bytes exact) or a miss, and the server's books straight. The lease ends on the
session table's injected clock, never a sleep. (A client killed between parts, forged parts, and
the two strict xfails of this change: tests/server/test_store_parts_adversarial.py; an overwrite
through another server of a fleet between parts: tests/fleet/test_store_parts_fleet.py.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, AnyServer, InProcessServer, make_kv, make_tokens
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
    """Other stores fill the pool between A's parts: they evict A's committed part (today; or
    find no room, should parts be pinned until the last commit). Either way A's chunks read back
    are an exact prefix or a miss, and B's are B's (A's copy never lands in a slot reused)."""
    srv = make_server(l1_size="64KiB")  # ~20 slots
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as b,
    ):
        tokens, kv = make_tokens(N * CHUNK, 300), make_kv(N * CHUNK, seed=4)
        slots = _prepare(a, tokens, "s3")
        _write(a, slots[:2], kv)
        assert a.ask(m.CommitStore(a.client_id, "s3", [0, 1], more=True)).committed == 2
        stored = []
        for k in range(4):
            toks, other = make_tokens(4 * CHUNK, 10_000 * (k + 1)), make_kv(4 * CHUNK, seed=10 + k)
            try:
                if kvd.store(b, other, toks):
                    stored.append((toks, other))
            except kvd.PoolFullError:
                pass
        assert stored, "no store of B got room"
        _write(a, slots[2:], kv)  # (A's own slots: still reserved)
        assert a.ask(m.CommitStore(a.client_id, "s3", list(range(N)))).committed == N
        got = kvd.retrieve(a, tokens)
        assert got is None or same(got, kv[:, :, : got.shape[2]])
        for toks, other in stored:  # B's chunks still held are B's bytes
            back = kvd.retrieve(b, toks)
            assert back is None or same(back, other[:, :, : back.shape[2]])
        assert same(kvd.retrieve(b, stored[-1][0]), stored[-1][1])  # (the newest: not evicted)
        assert kvd.check_server_integrity(a) == []

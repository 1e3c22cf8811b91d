"""A store committed in parts (CommitStore ``more``, sdk._storeparts, server.storing._commit_part):
the server commits the chunks copied so far while the client copies the rest, through real
servers and shared memory. Each part's chunks are whole and visible before the rest; a failure
between parts leaves the parts committed (a prefix, bytes exact) and nothing else; the last
CommitStore names every chunk and decides; an overwrite and an inline client commit in one step."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, AnyServer, make_kv, make_tokens
from kvdock.errors import BadRequestError
from kvdock.keys import TOKEN_DTYPE
from kvdock.memcpy import ENV_THREADS
from kvdock.protocol import messages as m
from kvdock.sdk import _storeparts as storeparts
from kvdock.sdk.chunks import TensorChunks
from kvdock.sdk.context import KVCacheContext

N = 8  # chunks a store


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> list[m.CommitStore]:
    """Every store splits (a part of one byte is worth it), and the parts the SDK sends, recorded."""
    monkeypatch.setattr(storeparts, "PART_BYTES", 1)
    sent: list[m.CommitStore] = []
    notify = KVCacheContext.notify

    def spy(self: KVCacheContext, msg: object) -> None:
        if isinstance(msg, m.CommitStore):
            sent.append(msg)
        notify(self, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(KVCacheContext, "notify", spy)
    return sent


@pytest.fixture
def checked(ctx: kvd.KVCacheContext) -> Iterator[kvd.KVCacheContext]:
    yield ctx
    assert kvd.check_server_integrity(ctx) == []


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_large_store_commits_in_parts(checked: kvd.KVCacheContext, parts: list[m.CommitStore]) -> None:
    tokens, kv = make_tokens(N * CHUNK, 100), make_kv(N * CHUNK, seed=1)
    r = kvd.store_chunks(checked, kv, tokens)
    assert (r.stored_chunks, r.deduped_chunks) == (N, 0)
    assert [p.chunks for p in parts] == [[0, 1], [2, 3], [4, 5]] and all(p.more for p in parts)
    assert same(kvd.retrieve(checked, tokens), kv)
    assert kvd.store_chunks(checked, kv, tokens).deduped_chunks == N  # (a store of nothing new: no parts)
    assert len(parts) == 3


def test_bounds_keep_a_chunks_shards_together() -> None:
    slots, least = [m.SlotRef(i, 0, 0) for i in range(10)], storeparts.AUTO_PART_BYTES  # 5 chunks of 2 shards
    assert storeparts.bounds(slots, 2, least) == [0, 2, 4, 6, 10]
    assert storeparts.bounds(slots[1:], 2, least) == [0, 1, 3, 5, 9]  # (chunk 0 deduped in shard 0)
    assert storeparts.bounds(slots[:3], 1, least // 2) == [0, 3]  # too small: one part
    assert storeparts.bounds(slots[:3], 1, least) == [0, 1, 2, 3]


def test_parts_only_where_a_cpu_is_left_for_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv(ENV_THREADS, str(cpus))  # every CPU copies: no parts
    assert storeparts.part_bytes() is None
    if cpus > 1:
        monkeypatch.setenv(ENV_THREADS, str(cpus - 1))
        assert storeparts.part_bytes() == storeparts.AUTO_PART_BYTES
    monkeypatch.setattr(storeparts, "PART_BYTES", 5)  # (set: always)
    assert storeparts.part_bytes() == 5


def _prepare(ctx: kvd.KVCacheContext, tokens: list[int], sid: str, overwrite: bool = False) -> list[m.SlotRef]:
    whole = np.asarray(tokens, TOKEN_DTYPE).tobytes()
    prep = ctx.ask(m.PrepareStore(ctx.client_id, sid, whole, "", overwrite))
    assert [s.index for s in prep.slots] == list(range(N))
    return list(prep.slots)


def _write(ctx: kvd.KVCacheContext, slots: list[m.SlotRef], kv: torch.Tensor) -> None:
    with ctx.transfer() as t:
        t.write(slots, TensorChunks(kv, CHUNK))


def test_a_part_is_visible_before_the_rest_and_a_failure_leaves_only_it(checked: kvd.KVCacheContext) -> None:
    ctx, tokens, kv = checked, make_tokens(N * CHUNK, 200), make_kv(N * CHUNK, seed=2)
    slots = _prepare(ctx, tokens, "s1")
    _write(ctx, slots[:3], kv)
    assert ctx.ask(m.CommitStore(ctx.client_id, "s1", [0, 1, 2], more=True)).committed == 3
    assert kvd.lookup(ctx, tokens) == 3 * CHUNK  # the part, whole; the rest not
    assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 3 * CHUNK])
    with pytest.raises(kvd.LeaseExpiredError, match="not reserved"):  # a part again: refused, the session kept
        ctx.ask(m.CommitStore(ctx.client_id, "s1", [2, 3], more=True))
    _write(ctx, slots[3:5], torch.zeros_like(kv))  # (the client fails mid-copy: never visible)
    ctx.ask(m.EndSession(ctx.client_id, "s1"))
    assert kvd.lookup(ctx, tokens) == 3 * CHUNK
    assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 3 * CHUNK])
    assert kvd.store(ctx, kv, tokens, edited=False)  # the rest stores later, after the part
    assert same(kvd.retrieve(ctx, tokens), kv)


def test_the_last_commit_names_every_chunk_and_counts_the_parts(checked: kvd.KVCacheContext) -> None:
    ctx, tokens, kv = checked, make_tokens(N * CHUNK, 300), make_kv(N * CHUNK, seed=3)
    slots = _prepare(ctx, tokens, "s2")
    _write(ctx, slots, kv)
    assert ctx.ask(m.CommitStore(ctx.client_id, "s2", [0, 1], more=True)).committed == 2
    assert ctx.ask(m.CommitStore(ctx.client_id, "s2", [4, 5], more=True)).committed == 2  # (out of order)
    assert kvd.lookup(ctx, tokens) == 2 * CHUNK  # chunk 2 missing: 4 and 5 are not reachable yet
    assert ctx.ask(m.CommitStore(ctx.client_id, "s2", list(range(N)))).committed == N
    assert same(kvd.retrieve(ctx, tokens), kv)
    with pytest.raises(kvd.LeaseExpiredError, match="no open session"):  # the session is over
        ctx.ask(m.CommitStore(ctx.client_id, "s2", [6], more=True))


def test_a_part_that_comes_after_the_last_commit_changes_nothing(checked: kvd.KVCacheContext) -> None:
    ctx, tokens, kv = checked, make_tokens(N * CHUNK, 400), make_kv(N * CHUNK, seed=4)
    slots = _prepare(ctx, tokens, "s3")
    _write(ctx, slots, kv)
    assert ctx.ask(m.CommitStore(ctx.client_id, "s3", list(range(N)))).committed == N  # (the part overtaken)
    with pytest.raises(kvd.LeaseExpiredError, match="no open session"):
        ctx.ask(m.CommitStore(ctx.client_id, "s3", [0, 1], more=True))
    assert same(kvd.retrieve(ctx, tokens), kv)


def test_an_overwrite_commits_in_one_step(checked: kvd.KVCacheContext, parts: list[m.CommitStore]) -> None:
    ctx, tokens, kv, new = checked, make_tokens(N * CHUNK, 500), make_kv(N * CHUNK, seed=5), make_kv(N * CHUNK, seed=6)
    assert kvd.store(ctx, kv, tokens) and len(parts) == 3
    assert kvd.store(ctx, new, tokens, overwrite=True) and len(parts) == 3  # no part sent
    assert same(kvd.retrieve(ctx, tokens), new)
    slots = _prepare(ctx, tokens, "s4", overwrite=True)  # a part of an overwrite: refused, the last decides
    _write(ctx, slots, kv)
    with pytest.raises(BadRequestError, match="one step"):
        ctx.ask(m.CommitStore(ctx.client_id, "s4", [0, 1], more=True))
    assert same(kvd.retrieve(ctx, tokens), new)  # nothing of the part committed: the older version
    assert ctx.ask(m.CommitStore(ctx.client_id, "s4", list(range(N)))).committed == N
    assert same(kvd.retrieve(ctx, tokens), kv)


def test_an_inline_client_commits_in_one_step(
    make_server: Callable[..., AnyServer], parts: list[m.CommitStore]
) -> None:
    srv = make_server("--no-shm")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        assert ctx.transport == "inline"
        tokens, kv = make_tokens(N * CHUNK, 600), make_kv(N * CHUNK, seed=7)
        assert kvd.store_chunks(ctx, kv, tokens).stored_chunks == N and parts == []
        assert same(kvd.retrieve(ctx, tokens), kv)
        assert kvd.check_server_integrity(ctx) == []


def test_a_whole_model_store_of_two_shards_commits_whole_chunks_in_parts(
    make_server: Callable[..., AnyServer], parts: list[m.CommitStore]
) -> None:
    srv = make_server(register=None)
    kvd.register_model(srv.url, srv.http_url, "tp", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                       world_size=2, rank=1, timeout=10)  # fmt: skip
    whole = kvd.connect(srv.url, srv.http_url, "tp", timeout=10)
    ranks = [kvd.connect(srv.url, srv.http_url, "tp", timeout=10, kv_rank=r) for r in range(2)]
    try:
        assert whole.shards == 2
        tokens = make_tokens(N * CHUNK, 700)
        kv = make_kv(N * CHUNK, seed=8).repeat(1, 1, 1, 2)  # [2, L, T, 2 ranks' heads]
        assert kvd.store_chunks(whole, kv, tokens).stored_chunks == 2 * N
        assert [p.chunks for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert same(kvd.retrieve(whole, tokens), kv)
        for r, c in enumerate(ranks):
            assert same(kvd.retrieve(c, tokens), kv[..., r * 16 : (r + 1) * 16])
        assert kvd.check_server_integrity(whole) == []
    finally:
        for c in [whole, *ranks]:
            c.close()

"""Models stored in several shards (tensor parallelism), through real servers: what each rank
stores is its shard; the whole-model (all-rank) context assembles and splits chunks across the
shards (server.shards: the same handlers, once per shard), and never hands out a chunk that a
shard lacks or that mixes versions."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, ServerProc, make_tokens, start_server
from kvdock.errors import InvalidInputError, KVCacheSDKError
from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.protocol import messages as m
from kvdock.server.shards import Interleave

LAYERS, HEADS, HEAD_DIM = 3, 2, 8  # per rank: 2 of the model's 4 KV heads at TP=2
TP = "tp"


@pytest.fixture(params=["shm", "inline"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["bfloat16", "float32"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return getattr(torch, str(request.param))


@pytest.fixture
def srv(make_server: Callable[..., ServerProc], transport: str, dtype: torch.dtype) -> ServerProc:
    s = make_server(*(["--no-shm"] if transport == "inline" else []), register=None)
    name = str(dtype).removeprefix("torch.")
    kvd.register_model(s.url, s.http_url, TP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype=name, world_size=2, rank=1, timeout=10)  # fmt: skip
    return s


def connect(srv: ServerProc, model: str = TP, kv_rank: int | None = None) -> kvd.KVCacheContext:
    return kvd.connect(srv.url, srv.http_url, model, timeout=10, kv_rank=kv_rank)


@pytest.fixture
def contexts(srv: ServerProc, transport: str) -> Iterator[tuple[kvd.KVCacheContext, list[kvd.KVCacheContext]]]:
    whole, ranks = connect(srv), [connect(srv, kv_rank=r) for r in range(2)]
    assert {c.transport for c in [whole, *ranks]} == {transport}
    yield whole, ranks
    for c in [whole, *ranks]:
        assert kvd.check_server_integrity(c) == []
        c.close()


def kv_of(geo: KVGeometry, tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geo.chunk_shape(tokens), generator=g).to(dtype)


def objects(ctx: kvd.KVCacheContext) -> int:
    return int(kvd.server_status(ctx.http_url)["l1"]["objects"])


def test_contexts_see_the_whole_model_or_one_rank(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    assert whole.geometry == KVGeometry(LAYERS, 2 * HEADS, HEAD_DIM, whole.geometry.dtype)
    assert (whole.kv_rank, whole.shards) == (None, 2)
    assert [(c.kv_rank, c.shard, c.shards, c.geometry.rank) for c in ranks] == [(0, 0, 1, 0), (1, 1, 1, 1)]
    assert all(c.geometry.hidden_dim == HEADS * HEAD_DIM for c in ranks)
    assert whole.layout.geometry == KVGeometry(LAYERS, HEADS, HEAD_DIM, whole.geometry.dtype, world_size=2)


def test_a_whole_model_store_is_split_into_every_rank_shard(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(4 * CHUNK)
    kv = kv_of(whole.geometry, 4 * CHUNK, dtype, 1)
    r = kvd.store_chunks(whole, kv, tokens)
    assert (r.stored_chunks, r.deduped_chunks, r.pool_full_chunks) == (8, 0, 0)  # 4 chunks x 2 shards
    assert objects(whole) == 8
    assert kvd.lookup(whole, tokens) == 4 * CHUNK
    got = kvd.retrieve(whole, tokens)
    assert got is not None and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    for rank, ctx in enumerate(ranks):
        mine = kvd.retrieve(ctx, tokens)
        assert mine is not None and torch.equal(mine, kv[..., rank * 16 : (rank + 1) * 16])
    assert kvd.store(whole, kv, tokens) is False  # every shard of every chunk is there: deduped
    assert objects(whole) == 8


def test_what_the_ranks_store_is_retrieved_whole(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(3 * CHUNK, start=7)
    kv = kv_of(whole.geometry, 3 * CHUNK, dtype, 2)
    for rank, ctx in enumerate(ranks):
        assert kvd.store(ctx, kv[..., rank * 16 : (rank + 1) * 16].contiguous(), tokens) is True
    got = kvd.retrieve(whole, tokens)
    assert got is not None and torch.equal(got, kv)
    # partial reads and out= assemble the same bytes
    out = torch.full((2, 2, 2 * CHUNK, 32), 7.0, dtype=dtype)
    part = kvd.retrieve(whole, tokens, layers=range(1, 3), start=CHUNK, out=out)
    assert part is not None and part.data_ptr() == out.data_ptr()
    assert torch.equal(part, kv[:, 1:3, CHUNK:])
    # an engine's sink gets whole chunks, each assembled from every shard
    seen: dict[int, torch.Tensor] = {}

    class Sink:
        def take(self, index: int, src: torch.Tensor) -> None:
            seen[index] = src.clone()

    assert kvd.retrieve_into(whole, tokens, Sink()) == 3 * CHUNK
    assert sorted(seen) == [0, 1, 2]
    assert all(torch.equal(seen[i], kv[:, :, i * CHUNK : (i + 1) * CHUNK]) for i in seen)


def test_a_missing_shard_is_a_shorter_hit_never_half_a_chunk(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(4 * CHUNK, start=100)
    kv = kv_of(whole.geometry, 4 * CHUNK, dtype, 3)
    # the ranks' saves of an engine (its model's KV, not a user's edit: edited=False)
    assert kvd.store(ranks[0], kv[..., :16].contiguous(), tokens, edited=False)
    assert kvd.lookup(whole, tokens) == 0 and kvd.retrieve(whole, tokens) is None  # rank 1 has nothing
    assert kvd.store(ranks[1], kv[:, :, : 2 * CHUNK, 16:].contiguous(), tokens[: 2 * CHUNK], edited=False)
    assert kvd.lookup(whole, tokens) == 2 * CHUNK
    got = kvd.retrieve(whole, tokens)
    assert got is not None and got.shape == (2, LAYERS, 2 * CHUNK, 32) and torch.equal(got, kv[:, :, : 2 * CHUNK])
    # a user's whole-model store (edited) would fill in the missing shard only, chaining rank 1's
    # chunks 2-3 onto its stored run and leaving rank 0's chunks 2-3 as stored: the user's tensor
    # can be read back and compared only up to the common hit (2 chunks), so rank 0's chunks 2-3
    # would be unverified halves of chunks whose other halves are the user's: nothing is written
    r = kvd.store_chunks(whole, kv, tokens)
    assert (r.stored_chunks, r.deduped_chunks, r.diverged_chunks) == (0, 6, 2)
    assert torch.equal(kvd.retrieve(whole, tokens), kv[:, :, : 2 * CHUNK])
    # the engine's own save of the missing shard (model KV, as rank 0's) fills it in
    r = kvd.store_chunks(ranks[1], kv[..., 16:].contiguous(), tokens, edited=False)
    assert (r.stored_chunks, r.deduped_chunks) == (2, 2)
    assert torch.equal(kvd.retrieve(whole, tokens), kv)


def test_an_overwrite_replaces_every_shard(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(2 * CHUNK, start=300)
    old, new = (kv_of(whole.geometry, 2 * CHUNK, dtype, s) for s in (4, 5))
    assert kvd.store(whole, old, tokens)
    assert kvd.store(whole, new, tokens, overwrite=True) is True
    assert torch.equal(kvd.retrieve(whole, tokens), new)
    for rank, ctx in enumerate(ranks):
        assert torch.equal(kvd.retrieve(ctx, tokens), new[..., rank * 16 : (rank + 1) * 16])
    assert objects(whole) == 4


def test_an_overwrite_of_chunks_a_shard_is_writing_writes_no_shard(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(3 * CHUNK, start=500)
    old, new = (kv_of(whole.geometry, 3 * CHUNK, dtype, s) for s in (6, 7))
    assert kvd.store(whole, old[:, :, : 2 * CHUNK].contiguous(), tokens[: 2 * CHUNK], edited=False)  # model KV
    # rank 1 starts a store of its shard of the third chunk and does not commit it yet
    sid = ranks[1].new_session_id()
    prep = ranks[1].call(m.PrepareStore(ranks[1].client_id, sid, raw(tokens), "", False)).reply
    assert [s.index for s in prep.slots] == [2]
    r = kvd.store_chunks(whole, new, tokens, overwrite=True)
    assert (r.stored_chunks, r.in_flight_chunks) == (0, 6)
    ranks[1].call(m.EndSession(ranks[1].client_id, sid))
    assert torch.equal(kvd.retrieve(whole, tokens), old[:, :, : 2 * CHUNK])  # neither shard was overwritten


def test_readers_never_see_two_versions_of_a_chunk(contexts, dtype: torch.dtype) -> None:
    """A writer overwrites the whole model with A and B in turn while a reader retrieves it: each
    read is all A or all B (per chunk and across the prefix), never shards of both."""
    whole, _ = contexts
    tokens = make_tokens(2 * CHUNK, start=900)
    a = torch.zeros(whole.geometry.chunk_shape(2 * CHUNK), dtype=dtype)
    b = torch.ones_like(a)
    kvd.store(whole, a, tokens)
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(60):
                kvd.store(whole, b if i % 2 == 0 else a, tokens, overwrite=True)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while not stop.is_set() or reads < 5:
        got = kvd.retrieve(whole, tokens)
        if got is not None:
            reads += 1
            assert torch.equal(got, torch.full_like(got, float(got.flatten()[0]))), "a mix of versions"
    writer.join()
    assert not errors


def test_replicated_heads_are_stored_once(make_server: Callable[..., ServerProc], dtype: torch.dtype) -> None:
    """GQA with fewer KV heads than ranks: 2 heads over 4 ranks, each head on two ranks: one copy."""
    srv = make_server(register=None)
    name = str(dtype).removeprefix("torch.")
    kvd.register_model(srv.url, srv.http_url, "gqa", num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype=name, world_size=4, total_kv_heads=2, timeout=10)  # fmt: skip
    whole = connect(srv, "gqa")
    ranks = [connect(srv, "gqa", r) for r in range(4)]
    try:
        assert (whole.shards, whole.geometry.hidden_dim) == (2, 2 * HEAD_DIM)
        tokens = make_tokens(2 * CHUNK)
        kv = kv_of(whole.geometry, 2 * CHUNK, dtype, 8)
        stored = [kvd.store_chunks(c, kv[..., (r // 2) * 8 : (r // 2 + 1) * 8].contiguous(), tokens) for r, c in
                  enumerate(ranks)]  # fmt: skip
        assert [(s.stored_chunks, s.deduped_chunks) for s in stored] == [(2, 0), (0, 2), (2, 0), (0, 2)]
        assert objects(whole) == 4  # 2 chunks x 2 distinct head groups, not x 4 ranks
        assert torch.equal(kvd.retrieve(whole, tokens), kv)
        assert torch.equal(kvd.retrieve(ranks[3], tokens), kv[..., 8:])
        assert kvd.check_server_integrity(whole) == []
    finally:
        for c in [whole, *ranks]:
            c.close()


def test_an_mla_latent_is_stored_once_for_every_rank(
    make_server: Callable[..., ServerProc], transport: str, dtype: torch.dtype
) -> None:
    srv = make_server(*(["--no-shm"] if transport == "inline" else []), register=None)
    name = str(dtype).removeprefix("torch.")
    kvd.register_model(srv.url, srv.http_url, "mla", num_layers=LAYERS, num_kv_heads=1, head_dim=24, dtype=name,
                       world_size=2, kv_kind=KV_LATENT, timeout=10)  # fmt: skip
    whole, ranks = connect(srv, "mla"), [connect(srv, "mla", r) for r in range(2)]
    try:
        assert whole.shards == 1 and whole.geometry == KVGeometry(LAYERS, 1, 24, name, KV_LATENT)
        tokens = make_tokens(3 * CHUNK)
        latent = kv_of(whole.geometry, 3 * CHUNK, dtype, 9)
        assert latent.shape == (1, LAYERS, 3 * CHUNK, 24)  # KV_1LTD
        assert kvd.store(ranks[0], latent, tokens) is True
        assert kvd.store(ranks[1], latent, tokens) is False  # the same latent: already stored
        assert objects(whole) == 3
        assert torch.equal(kvd.retrieve(whole, tokens), latent)
        assert torch.equal(kvd.retrieve(ranks[1], tokens), latent)
        with pytest.raises(InvalidInputError, match=r"kv must be KV_1LTD \[1, num_layers=3, tokens, D=24\]"):
            kvd.store(whole, torch.zeros(2, LAYERS, CHUNK, 24, dtype=dtype), tokens[:CHUNK])
    finally:
        for c in [whole, *ranks]:
            c.close()


def test_what_the_whole_model_context_cannot_do_is_refused_clearly(contexts, srv: ServerProc) -> None:
    whole, _ = contexts
    tokens = make_tokens(CHUNK)
    for call, what in (
        (lambda: kvd.view(whole, tokens), "a zero-copy view"),
        (lambda: kvd.lookup_many(whole, [tokens]), "a batch"),
        (lambda: kvd.retrieve_many(whole, [tokens]), "a batch"),
        (lambda: kvd.inspect_prefix(whole, tokens), "inspection"),
    ):
        with pytest.raises(InvalidInputError) as err:
            call()
        assert str(err.value) == (
            f"{what} of 'tp', stored in 2 shards (tensor parallelism), is not supported for the whole model yet; "
            "connect with kv_rank=r to work on one rank's shard"
        )
    # the server refuses them too, for a client that asks anyway
    raw = m.LookupMany(whole.client_id, [bytes(4 * CHUNK)], [""])
    with pytest.raises(KVCacheSDKError, match="a batch lookup is not supported for a client of every rank"):
        whole.call(raw)
    for bad in (2, -1, True, 1.0):
        with pytest.raises(InvalidInputError, match="kv_rank"):
            connect(srv, kv_rank=bad)  # type: ignore[arg-type]


class Taken:
    """An engine-like sink: what each take() got."""

    def __init__(self) -> None:
        self.chunks: dict[int, torch.Tensor] = {}

    def take(self, index: int, src: torch.Tensor) -> None:
        self.chunks[index] = src.clone()


def test_ranks_load_exactly_the_versions_one_lookup_saw(contexts, dtype: torch.dtype) -> None:
    whole, ranks = contexts
    tokens = make_tokens(4 * CHUNK, start=2000)
    old, new = (kv_of(whole.geometry, 4 * CHUNK, dtype, s) for s in (10, 11))
    assert kvd.store(ranks[0], old[..., :16].contiguous(), tokens)
    assert kvd.store(ranks[1], old[:, :, : 2 * CHUNK, 16:].contiguous(), tokens[: 2 * CHUNK])
    seen = kvd.lookup_tips(whole, tokens)
    assert seen.hit_tokens == 2 * CHUNK and len(seen.versions) == 2 and all(seen.versions)
    hit = tokens[: seen.hit_tokens]
    for rank, ctx in enumerate(ranks):  # rank 0 holds 4 chunks: its tip is the one at the cut
        sink = Taken()
        assert kvd.retrieve_into(ctx, hit, sink, tips=[seen.versions[rank]]) == 2 * CHUNK
        assert torch.equal(
            torch.cat([sink.chunks[0], sink.chunks[1]], 2), old[:, :, : 2 * CHUNK, rank * 16 : (rank + 1) * 16]
        )
    sink = Taken()
    assert kvd.retrieve_into(whole, hit, sink, tips=list(seen.versions)) == 2 * CHUNK
    assert torch.equal(sink.chunks[1], old[:, :, CHUNK : 2 * CHUNK])
    # more tokens than the lookup's hit, or another version at the tip: nothing, and the sink untouched
    sink = Taken()
    assert kvd.retrieve_into(ranks[0], tokens, sink, tips=[seen.versions[0]]) == 0 and not sink.chunks
    assert kvd.store(whole, new[:, :, : 2 * CHUNK].contiguous(), hit, overwrite=True)
    for rank, ctx in enumerate(ranks):
        assert kvd.retrieve_into(ctx, hit, sink, tips=[seen.versions[rank]]) == 0
    assert not sink.chunks
    assert kvd.retrieve_into(whole, hit, sink, tips=list(seen.versions)) == 0 and not sink.chunks
    again = kvd.lookup_tips(whole, hit)
    assert again.hit_tokens == 2 * CHUNK and set(again.versions).isdisjoint(seen.versions)
    assert kvd.retrieve_into(ranks[1], hit, sink, tips=[again.versions[1]]) == 2 * CHUNK
    with pytest.raises(InvalidInputError, match=r"tips must be 1 version\(s\) from lookup_tips"):
        kvd.retrieve_into(ranks[1], hit, sink, tips=list(again.versions))
    for bad in ([True], [str(again.versions[1])], [-1], [2**64], [float(again.versions[1])]):
        with pytest.raises(InvalidInputError, match=r"tips must be 1 version\(s\) from lookup_tips"):
            kvd.retrieve_into(ranks[1], hit, sink, tips=bad)
    with pytest.raises(InvalidInputError, match="tips must be a sequence of versions, got int"):
        kvd.retrieve_into(ranks[1], hit, sink, tips=5)  # type: ignore[arg-type]
    with pytest.raises(KVCacheSDKError, match=r"a retrieve of 2 shard\(s\) names 1 tip versions"):
        whole.call(m.PrepareRetrieve(whole.client_id, "s", b"\0" * 4 * CHUNK, tips=[1]))
    assert kvd.lookup_tips(whole, make_tokens(CHUNK, start=77777)) == kvd.Tips(0, ())


def test_tips_of_chunks_only_a_lower_tier_holds(make_server: Callable[..., ServerProc], tmp_path) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"), register=None)
    kvd.register_model(srv.url, srv.http_url, TP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype="float32", world_size=2, timeout=10)  # fmt: skip
    whole, rank1 = connect(srv), connect(srv, kv_rank=1)
    try:
        tokens = make_tokens(3 * CHUNK)
        kv = kv_of(whole.geometry, 3 * CHUNK, torch.float32, 12)
        assert kvd.store(whole, kv, tokens)
        seen = kvd.lookup_tips(whole, tokens)
        deadline = time.monotonic() + 10
        while srv.get("/status")["tiers"]["l2"]["objects"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        req = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
        urllib.request.urlopen(req, timeout=5).read()
        assert objects(whole) == 0
        assert kvd.lookup_tips(whole, tokens) == seen  # counted from L2's headers
        sink = Taken()
        assert kvd.retrieve_into(rank1, tokens, sink, tips=[seen.versions[1]]) == 3 * CHUNK
        assert torch.equal(sink.chunks[2], kv[:, :, 2 * CHUNK :, 16:])
    finally:
        whole.close()
        rank1.close()


# ---------------------------------------------------------------- regressions found in review
W = HEADS * HEAD_DIM  # one shard's D


def _register(s: ServerProc, name: str = TP) -> None:
    kvd.register_model(s.url, s.http_url, name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype="bfloat16", world_size=2, timeout=10)  # fmt: skip


def raw(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def one_version(got: torch.Tensor | None, *versions: torch.Tensor) -> bool:
    return got is None or any(torch.equal(got, v[:, :, : got.shape[2]]) for v in versions)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


# 1 ------------------------------------------------------------------------------------------------
def test_a_per_rank_overwrite_never_shows_a_chunk_of_two_versions(make_server) -> None:
    srv = make_server(register=None)
    _register(srv)
    whole, rank0 = connect(srv), connect(srv, TP, 0)
    try:
        tokens = make_tokens(2 * CHUNK)
        old, new = (
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 1),
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 2),
        )
        assert kvd.store(whole, old, tokens)
        # an overwrite of rank 0's shard alone would leave shard 1 old beside it: refused
        with pytest.raises(KVCacheSDKError, match="an overwrite of one rank's shard of 'tp', stored in 2 shards"):
            kvd.store(rank0, new[..., :W].contiguous(), tokens, overwrite=True)
        assert torch.equal(kvd.retrieve(whole, tokens), old)
        assert kvd.store(rank0, new[..., :W].contiguous(), tokens) is False  # a plain store: deduped
    finally:
        whole.close()
        rank0.close()


# 2 ------------------------------------------------------------------------------------------------
def test_a_commit_never_commits_some_shards_of_an_overwrite(make_server) -> None:
    srv = make_server("--no-shm", register=None)
    _register(srv)
    whole = connect(srv)
    try:
        tokens = make_tokens(2 * CHUNK, start=1000)
        old, new = (
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 3),
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 4),
        )
        assert kvd.store(whole, old, tokens)
        sid = whole.new_session_id()
        prep = whole.call(m.PrepareStore(whole.client_id, sid, raw(tokens), "", True)).reply
        assert [s.index for s in prep.slots] == [0, 1, 2, 3]  # chunk-major: c0s0 c0s1 c1s0 c1s1
        # shard 1's session goes away before the commit (here: EndSession of "sid/1", which also
        # is what a CommitRetrieve("sid/1") or an expiry of that shard's lease alone does)
        whole.call(m.EndSession(whole.client_id, sid + "/1"))
        frames = [memoryview(new[:, :, i * CHUNK : (i + 1) * CHUNK, :W].contiguous().view(torch.uint8).numpy())
                  for i in range(2)]  # fmt: skip
        with pytest.raises(KVCacheSDKError, match=r"no open session .* for every shard"):
            whole.call(m.CommitStore(whole.client_id, sid, [0, 2]), frames)
        assert torch.equal(kvd.retrieve(whole, tokens), old)
        assert one_version(kvd.retrieve(whole, tokens), old, new), "shard 0 committed new, shard 1 kept old"
    finally:
        whole.close()


# 3 ------------------------------------------------------------------------------------------------
def test_a_closed_whole_model_client_releases_every_shard_quarantine(make_server) -> None:
    srv = make_server(register=None)  # shared memory
    _register(srv)
    whole = connect(srv)
    assert whole.transport == "shm"
    try:
        sid = whole.new_session_id()
        prep = whole.call(m.PrepareStore(whole.client_id, sid, raw(make_tokens(2 * CHUNK)), "", False)).reply
        assert len(prep.slots) == 4
        # the context is closed while another of its threads copies: every shard is quarantined
        whole.call(m.CloseClient(whole.client_id, idle=False))
        assert srv.get("/status")["l1"]["quarantined_bytes"] == 4 * 4096
        # the copying thread's store then fails and ends its session, as the SDK does
        with pytest.raises(KVCacheSDKError):
            whole.call(m.EndSession(whole.client_id, sid))
        assert srv.get("/status")["l1"]["quarantined_bytes"] == 0, "shard 1's slots stay quarantined"
    finally:
        whole.close()


# 4 ------------------------------------------------------------------------------------------------
def test_an_acknowledged_overwrite_of_a_shard_that_found_no_room_is_final(tmp_path) -> None:
    disk = tmp_path / "l2"
    slow = {"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.3"}
    srv = start_server(tmp_path, "--disk-dir", str(disk), l1_size="24KiB", env=slow)  # 6 slots
    try:
        _register(srv)
        whole = connect(srv)
        tokens = make_tokens(2 * CHUNK, start=5000)
        old, new = (
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 5),
            kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, 6),
        )
        assert kvd.store(whole, old, tokens)
        wait_for(lambda: srv.get("/status")["tiers"]["l2"]["writes"] == 4, "the old version on disk")
        # a reader pins the 4 old objects: 2 slots stay free, shard 0 takes both, shard 1 none
        sid = whole.new_session_id()
        assert len(whole.call(m.PrepareRetrieve(whole.client_id, sid, raw(tokens), "", 1.0)).reply.slots) == 4
        r = kvd.store_chunks(whole, new, tokens, overwrite=True)
        assert (r.stored_chunks, r.pool_full_chunks) == (2, 2)  # acknowledged
        deletes = srv.get("/status")["tiers"]["l2"]["deletes"]
        srv.stop(signal.SIGKILL)  # a crash right after the acknowledgement
    finally:
        srv.stop(signal.SIGKILL)
    srv = start_server(tmp_path, "--disk-dir", str(disk))
    try:
        with connect(srv, TP, 1) as rank1:
            got = kvd.retrieve(rank1, tokens)
            assert got is None or not torch.equal(got, old[..., W:]), (
                f"shard 1's old version came back (acknowledged after {deletes} of the 4 deletions)"
            )
    finally:
        srv.stop()


# 5 ------------------------------------------------------------------------------------------------
def test_reusing_the_id_of_a_session_being_committed_leaks_nothing(make_server) -> None:
    srv = make_server("--no-shm", register=None, env={"KVDOCK_FAULT_COPY_DELAY_S": "1.0"})
    _register(srv)
    whole = connect(srv)
    try:
        tokens = make_tokens(CHUNK, start=7000)
        sid = whole.new_session_id()
        prep = whole.call(m.PrepareStore(whole.client_id, sid, raw(tokens), "", False)).reply
        assert len(prep.slots) == 2
        frames = [memoryview(bytearray(LAYERS * 2 * CHUNK * W * 2)) for _ in range(2)]
        failed: list[BaseException] = []

        def commit() -> None:
            try:
                whole.call(m.CommitStore(whole.client_id, sid, [0, 1]), frames)
            except KVCacheSDKError as e:  # ended meanwhile: the commit is refused
                failed.append(e)

        t = threading.Thread(target=commit)
        t.start()
        time.sleep(0.3)  # the copy is running (sessions busy)
        whole.call(m.EndSession(whole.client_id, sid))  # ended while busy: released when idle
        with pytest.raises(KVCacheSDKError):  # the id is refused ...
            whole.call(m.PrepareStore(whole.client_id, sid, raw(make_tokens(CHUNK, start=8000)), "", False))
        t.join()
        assert len(failed) == 1 and "no open session" in str(failed[0])
        assert kvd.check_server_integrity(whole) == []  # ... and nothing was reserved for it
    finally:
        whole.close()


def test_ranks_that_disagree_on_the_model_are_refused_at_registration(make_server) -> None:
    srv = make_server(register=None)
    _register(srv)  # rank 0 of 2: 3 layers, 2 of 4 KV heads, bfloat16
    for change, what in (({"dtype": "float32"}, "dtype=float32"), ({"num_layers": 4}, "layers=4")):
        args = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", **change}
        with pytest.raises(kvd.ServerError) as err:
            kvd.register_model(srv.url, srv.http_url, TP, world_size=2, rank=1, timeout=10, **args)  # type: ignore[arg-type]
        assert err.value.code == "registration"
        assert "model 'tp' is already registered with a different geometry" in str(err.value) and what in str(err.value)
    with pytest.raises(InvalidInputError, match="rank must be between 0 and world_size - 1 = 1, got 2"):
        kvd.register_model(srv.url, srv.http_url, TP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           dtype="bfloat16", world_size=2, rank=2, timeout=10)  # fmt: skip
    # the other rank, and an engine at TP=1 of the same model, share the registration
    same = {"num_layers": LAYERS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "timeout": 10}
    assert not kvd.register_model(srv.url, srv.http_url, TP, num_kv_heads=HEADS, world_size=2, rank=1, **same).created
    assert not kvd.register_model(srv.url, srv.http_url, TP, num_kv_heads=2 * HEADS, **same).created


# ---------------------------------------------------------------- pipeline stages


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_are_shards_of_layers(make_server, transport: str, tp: int) -> None:
    """2 stages of 2 layers (x tp ranks of 2 heads): each global rank stores its layers' (and
    heads') shard; the whole model is every stage's layers in order."""
    srv = make_server(*(["--no-shm"] if transport == "inline" else []), register=None)
    kvd.register_model(srv.url, srv.http_url, "pp", num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype="float32", world_size=tp, pp_size=2, pp_rank=1, timeout=10)  # fmt: skip
    whole = connect(srv, "pp")
    ranks = [connect(srv, "pp", r) for r in range(2 * tp)]
    try:
        w = HEADS * HEAD_DIM
        assert whole.shards == 2 * tp and whole.geometry == KVGeometry(4, HEADS * tp, HEAD_DIM, "float32")
        assert [(c.shard, c.geometry.pp_rank, c.geometry.rank) for c in ranks] == [
            (r, r // tp, r % tp) for r in range(2 * tp)
        ]
        tokens = make_tokens(3 * CHUNK)
        kv = kv_of(whole.geometry, 3 * CHUNK, torch.float32, 20)

        def mine(r: int) -> torch.Tensor:  # global rank r's layers and heads
            stage, t = divmod(r, tp)
            return kv[:, 2 * stage : 2 * stage + 2, :, t * w : (t + 1) * w].contiguous()

        for r in range(2 * tp - 1):  # the last rank has stored nothing yet
            assert kvd.store(ranks[r], mine(r), tokens)
        assert kvd.lookup(whole, tokens) == 0 and kvd.retrieve(whole, tokens) is None
        assert kvd.store(ranks[-1], mine(2 * tp - 1)[:, :, : 2 * CHUNK].contiguous(), tokens[: 2 * CHUNK])
        got = kvd.retrieve(whole, tokens)
        assert got is not None and torch.equal(got, kv[:, :, : 2 * CHUNK])  # never half a chunk
        later = kvd.retrieve(whole, tokens, start=CHUNK)  # from a chunk on: every stage's layers
        assert later is not None and torch.equal(later, kv[:, :, CHUNK : 2 * CHUNK])
        with pytest.raises(InvalidInputError, match="a read of some layers of 'pp', stored in"):
            kvd.retrieve(whole, tokens, layers=range(1, 3))
        # the whole model's store splits into every rank's shard
        other = make_tokens(2 * CHUNK, start=3000)
        r = kvd.store_chunks(whole, kv[:, :, : 2 * CHUNK].contiguous(), other)
        assert r.stored_chunks == 2 * 2 * tp
        for rank, ctx in enumerate(ranks):
            assert torch.equal(kvd.retrieve(ctx, other), mine(rank)[:, :, : 2 * CHUNK])
        assert kvd.check_server_integrity(whole) == []
    finally:
        for c in [whole, *ranks]:
            c.close()


def test_a_tips_load_that_outlives_its_lease_raises_and_is_not_tried_again(make_server) -> None:
    """A retry could find the tips' versions overwritten and answer 0 after the first try's takes
    handed the sink bytes of reused slots: with tips, LeaseExpiredError instead."""
    srv = make_server("--session-ttl", "1", register=None)
    _register(srv)
    whole, rank0 = connect(srv), connect(srv, TP, 0)
    try:
        tokens = make_tokens(2 * CHUNK, start=9000)
        old, new = (kv_of(whole.geometry, 2 * CHUNK, torch.bfloat16, s) for s in (30, 31))
        assert kvd.store(whole, old, tokens)
        seen = kvd.lookup_tips(whole, tokens)
        rank0.fast_reads = False  # (a tips load asks the server anyway)
        takes: list[int] = []

        class Slow:
            def take(self, index: int, src: torch.Tensor) -> None:
                takes.append(index)
                if len(takes) == 1:  # past the lease, while the whole model is overwritten
                    time.sleep(2.5)

        writer = threading.Thread(
            target=lambda: (time.sleep(1.6), kvd.store(whole, new, tokens, overwrite=True)), daemon=True
        )
        writer.start()
        with pytest.raises(kvd.LeaseExpiredError):
            kvd.retrieve_into(rank0, tokens, Slow(), tips=[seen.versions[0]])
        writer.join()
        assert takes == [0, 1]  # one try
        assert torch.equal(kvd.retrieve(whole, tokens), new)
    finally:
        whole.close()
        rank0.close()


def test_a_client_refuses_a_server_that_stores_the_model_otherwise_than_its_status_said(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout is read (Describe) before the registration: a model registered again in between
    (a server restarted with another layout of the same slot size) would file a rank's KV under
    another shard. Mocked: Describe answering another layout."""
    import msgspec

    from kvdock.sdk import _handshake as handshake

    srv = make_server(register=None)
    _register(srv)
    real = handshake.describe

    def other(*args, **kw) -> m.Described:  # type: ignore[no-untyped-def]
        desc = real(*args, **kw)  # 4 ranks of 1 head: rank 1 is in shard 0, not 1
        geo = msgspec.structs.replace(desc.layout.geometry, world_size=4, num_kv_heads=1, total_kv_heads=0)
        geo = msgspec.structs.replace(geo, head_dim=2 * HEAD_DIM)  # the same slot size
        return msgspec.structs.replace(desc, layout=msgspec.structs.replace(desc.layout, geometry=geo))

    monkeypatch.setattr(handshake, "describe", other)
    with pytest.raises(KVCacheSDKError, match="changed its chunk size or the layout"):
        connect(srv, TP, 1)


def test_interleave_numbers_a_requests_slots_chunk_major() -> None:
    """The one numbering of a request's slots over its shards (store, commit and retrieve):
    slot ``chunk * shards + shard``; of one shard, the chunk itself."""
    il = Interleave(3)
    assert il.index(2, 1) == 7 and il.split(7) == (2, 1)
    per_shard = [[m.SlotRef(0, 10, 1), m.SlotRef(2, 12, 1)], [m.SlotRef(0, 20, 2)], []]
    assert il.merge(per_shard) == [m.SlotRef(0, 10, 1), m.SlotRef(1, 20, 2), m.SlotRef(6, 12, 1)]
    assert il.chunks([6, 1, 0, 4]) == [[2, 0], [0, 1], []]
    assert il.route([6, 1, 0, 4], ["a", "b", "c", "d"]) == [["a", "c"], ["b", "d"], []]
    one = Interleave(1)
    assert one.merge([[m.SlotRef(0, 5), m.SlotRef(1, 9)]]) == [m.SlotRef(0, 5), m.SlotRef(1, 9)]
    assert one.chunks([3, 1]) == [[3, 1]] and one.split(3) == (3, 0)
    assert one.route([3, 1], ["x", "y"]) == [["x", "y"]]
    with pytest.raises(ValueError):  # as zip(strict=True) of several shards
        one.route([3, 1], ["x"])

"""lookup_many / retrieve_many against real servers: each prompt gets exactly what its single call
gets (byte for byte), in one round trip, on both transports; large batches are split; bad
batches are refused before anything is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens


@pytest.fixture
def bctx(transport_server: ServerProc) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(transport_server.url, transport_server.http_url, MODEL, timeout=10) as c:
        yield c


def requests(srv: ServerProc, op: str) -> float:
    return srv.metric(f'kvdock_requests_total{{op="{op}"}}', default=0.0)


def stored_prompts(ctx: kvd.KVCacheContext, base: int) -> list[list[int]]:
    """Prompts of every kind: fully cached, cached in part, sharing a prefix, a miss, shorter than
    a chunk, empty; the cached ones stored here."""
    a, b = make_tokens(4 * CHUNK, start=base), make_tokens(3 * CHUNK, start=base + 10_000)
    kvd.store(ctx, make_kv(len(a), seed=base % 97), a)
    kvd.store(ctx, make_kv(len(b), seed=base % 89), b)
    return [
        a,
        b + make_tokens(2 * CHUNK + 3, start=base + 20_000),  # 3 of 5 chunks cached
        a[: 2 * CHUNK] + make_tokens(CHUNK, start=base + 30_000),  # shares a's first 2 chunks
        make_tokens(2 * CHUNK, start=base + 40_000),  # nothing cached
        a[: CHUNK - 1],  # no whole chunk
        [],
        [*a, 7],  # a, and a token that is not a whole chunk
    ]


def test_lookup_many_equals_the_single_lookups_in_one_round_trip(transport_server: ServerProc, bctx) -> None:
    bctx.fast_reads = False  # every prompt goes to the server (see the test of fast batches below)
    prompts = stored_prompts(bctx, 100_000)
    singles = [kvd.lookup(bctx, p) for p in prompts]
    assert singles == [4 * CHUNK, 3 * CHUNK, 2 * CHUNK, 0, 0, 0, 4 * CHUNK]
    before = requests(transport_server, "LookupMany")
    assert kvd.lookup_many(bctx, prompts) == singles
    assert requests(transport_server, "LookupMany") == before + 1
    assert kvd.lookup_many(bctx, []) == []


def test_retrieve_many_equals_the_single_retrieves_in_one_round_trip(transport_server: ServerProc, bctx) -> None:
    srv = transport_server
    bctx.fast_reads = False
    prompts = stored_prompts(bctx, 200_000)
    singles = [kvd.retrieve(bctx, p) for p in prompts]
    before = (requests(srv, "PrepareRetrieveMany"), requests(srv, "PrepareRetrieve"))
    got = kvd.retrieve_many(bctx, prompts)
    assert (requests(srv, "PrepareRetrieveMany"), requests(srv, "PrepareRetrieve")) == (
        before[0] + 1,
        before[1],
    )
    assert [g is None for g in got] == [s is None for s in singles] == [False, False, False, True, True, True, False]
    for g, s in zip(got, singles, strict=True):
        if s is not None:
            assert g is not None and g.shape == s.shape and torch.equal(g.view(torch.uint8), s.view(torch.uint8))
    assert (
        got[0] is not None and got[2] is not None and torch.equal(got[2][:, :, : 2 * CHUNK], got[0][:, :, : 2 * CHUNK])
    )
    assert kvd.check_server_integrity(bctx) == []
    assert srv.get("/status")["sessions"] == 0  # every session of the batch was released


def test_a_batch_the_pool_directory_answers_sends_nothing(make_server, tmp_path: Path) -> None:
    """Each prompt is answered from the pool directory where its single call would be (a full
    hit, or a final miss: no L2), the others in one message, with the same results."""
    for srv in (make_server(), make_server("--disk-dir", str(tmp_path / "l2"))):
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            prompts = stored_prompts(c, 500_000)
            c.fast_reads = False
            slow_hits, slow_kv = kvd.lookup_many(c, prompts), kvd.retrieve_many(c, prompts)
            c.fast_reads = True
            before = (requests(srv, "LookupMany"), requests(srv, "PrepareRetrieveMany"))
            assert kvd.lookup_many(c, prompts) == slow_hits
            got = kvd.retrieve_many(c, prompts)
            for g, s in zip(got, slow_kv, strict=True):
                assert (g is None and s is None) or (g is not None and s is not None and torch.equal(g, s))
            # with an L2, the partial hits and the miss may grow there: those go to the server
            asked = (1, 1) if "--disk-dir" in srv.args else (0, 0)
            assert (requests(srv, "LookupMany"), requests(srv, "PrepareRetrieveMany")) == (
                before[0] + asked[0],
                before[1] + asked[1],
            )


@pytest.mark.parametrize(("layers", "start"), [(range(1, 3), 0), (None, 2 * CHUNK), (range(0, 3, 2), CHUNK)])
def test_partial_reads_of_a_batch_equal_the_single_ones(bctx, layers: range | None, start: int) -> None:
    prompts = stored_prompts(bctx, 300_000 + start)
    singles = [kvd.retrieve(bctx, p, layers=layers, start=start) for p in prompts]
    got = kvd.retrieve_many(bctx, prompts, layers=layers, start=start)
    assert [g is None for g in got] == [s is None for s in singles]
    for g, s in zip(got, singles, strict=True):
        if s is not None:
            assert g is not None and torch.equal(g, s)


def test_one_salt_per_prompt(bctx) -> None:
    toks = make_tokens(2 * CHUNK, start=400_000)
    kv_a, kv_b = make_kv(len(toks), seed=1), make_kv(len(toks), seed=2)
    kvd.store(bctx, kv_a, toks, cache_salt="a")
    kvd.store(bctx, kv_b, toks, cache_salt="b")
    assert kvd.lookup_many(bctx, [toks, toks, toks], ["a", "b", "c"]) == [2 * CHUNK, 2 * CHUNK, 0]
    got = kvd.retrieve_many(bctx, [toks, toks, toks], cache_salt=["b", "a", "c"])
    assert got[0] is not None and torch.equal(got[0], kv_b)
    assert got[1] is not None and torch.equal(got[1], kv_a)
    assert got[2] is None
    assert kvd.retrieve_many(bctx, [toks], cache_salt="a")[0] is not None


def test_a_batch_over_the_request_limit_is_split(make_server) -> None:
    srv = make_server("--max-request-tokens", str(4 * CHUNK))
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        c.fast_reads = False  # every prompt goes to the server
        prompts = [make_tokens(3 * CHUNK, start=1000 * i) for i in range(5)]  # 15 chunks: 5 requests of 4
        for i, p in enumerate(prompts):
            kvd.store(c, make_kv(len(p), seed=i), p)
        assert kvd.lookup_many(c, prompts) == [3 * CHUNK] * 5
        got = kvd.retrieve_many(c, prompts)
        assert requests(srv, "LookupMany") == 5 and requests(srv, "PrepareRetrieveMany") == 5
        for i, g in enumerate(got):
            assert g is not None and torch.equal(g, make_kv(3 * CHUNK, seed=i))
        with pytest.raises(kvd.InvalidInputError, match="over the server's limit of 64 tokens"):
            kvd.lookup_many(c, [make_tokens(5 * CHUNK)])  # one prompt alone over the limit


def test_a_batch_prefetches_from_the_disk_tier(make_server, tmp_path: Path) -> None:
    """After a restart L1 is empty: the batch loads every prompt's chunks from L2 in its one round trip."""
    disk = ["--disk-dir", str(tmp_path / "l2")]
    srv = make_server(*disk)
    prompts = [make_tokens(2 * CHUNK, start=5000 * i) for i in range(4)]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        for i, p in enumerate(prompts):
            kvd.store(c, make_kv(len(p), seed=10 + i), p)
    assert srv.stop() == 0
    srv = make_server(*disk)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.lookup_many(c, prompts) == [2 * CHUNK] * 4
        got = kvd.retrieve_many(c, [*prompts, make_tokens(CHUNK, start=999_000)])
        assert requests(srv, "PrepareRetrieveMany") == 1
        assert srv.metric('kvdock_tier_hits_total{tier="l2"}') == 8  # all 8 chunks came from L2
        for i in range(4):
            assert got[i] is not None and torch.equal(got[i], make_kv(2 * CHUNK, seed=10 + i))
        assert got[4] is None
        assert kvd.check_server_integrity(c) == []


@pytest.mark.parametrize(
    ("prompts", "salt", "message"),
    [
        (make_tokens(2 * CHUNK), "", "got one flat sequence of ints"),
        ("abc", "", "prompts must be a list of token sequences"),
        ([[1, 2], [3, -4]], "", r"prompt 1: .*"),
        ([[1, 2], [3, 4]], ["a"], r"a str or a list of 2 str \(one per prompt\), got 1 of them"),
        ([[1, 2]], [5], "cache_salt must be a str"),
    ],
)
def test_bad_batches_are_refused_before_anything_is_sent(ctx, prompts: object, salt: object, message: str) -> None:
    with pytest.raises(kvd.InvalidInputError, match=message):
        kvd.lookup_many(ctx, prompts, salt)  # type: ignore[arg-type]
    with pytest.raises(kvd.InvalidInputError, match=message):
        kvd.retrieve_many(ctx, prompts, salt)  # type: ignore[arg-type]


def test_layers_out_of_range_in_a_batch(ctx) -> None:
    with pytest.raises(kvd.InvalidInputError, match="within the model's 3 layers"):
        kvd.retrieve_many(ctx, [make_tokens(CHUNK)], layers=range(2, 5))


def test_a_2d_tensor_is_a_batch_of_rows(ctx) -> None:
    toks = torch.arange(4 * CHUNK).view(2, 2 * CHUNK)
    kvd.store(ctx, make_kv(2 * CHUNK, seed=3), toks[1].tolist())
    assert kvd.lookup_many(ctx, toks) == [0, 2 * CHUNK]


def test_a_prompt_over_the_request_limit_is_named(make_server) -> None:
    srv = make_server("--max-request-tokens", str(4 * CHUNK))
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        prompts = [make_tokens(CHUNK), make_tokens(5 * CHUNK)]
        for call in (kvd.lookup_many, kvd.retrieve_many):
            with pytest.raises(kvd.InvalidInputError, match=r"^prompt 1: request of 80 tokens is over") as e:
                call(c, prompts)
            assert e.value.code == "limit"

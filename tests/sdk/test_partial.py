"""Partial reads: ``retrieve(..., layers=range(a, b), start=k)`` equals the same slice of a full
retrieve, byte for byte, on both transports; bad ranges and offsets are refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens


@pytest.fixture
def tctx(transport_server: ServerProc) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(transport_server.url, transport_server.http_url, MODEL, timeout=10) as c:
        yield c


TOKENS = make_tokens(5 * CHUNK + 4, start=40_000)


@pytest.mark.parametrize(
    ("layers", "start"),
    [(range(1, 3), 0), (range(0, 1), 2 * CHUNK), (None, 4 * CHUNK), (range(0, 3, 2), CHUNK), (range(2, 3), 0)],
)
def test_a_partial_read_is_the_same_slice_of_a_full_retrieve(tctx, layers: range | None, start: int) -> None:
    kv = make_kv(len(TOKENS), seed=5)
    kvd.store(tctx, kv, TOKENS)
    full = kvd.retrieve(tctx, TOKENS)
    assert full is not None and full.shape[2] == 5 * CHUNK
    got = kvd.retrieve(tctx, TOKENS, layers=layers, start=start)
    want = full[:, slice(layers.start, layers.stop, layers.step) if layers else slice(None), start:]
    assert got is not None and got.is_contiguous()
    assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    buf = torch.full((2, want.shape[1], 6 * CHUNK, 16), 7.0, dtype=tctx.dtype)  # into a reused buffer
    view = kvd.retrieve(tctx, TOKENS, layers=layers, start=start, out=buf)
    assert view is not None and torch.equal(view, want)
    assert bool((buf[:, :, want.shape[2] :] == 7.0).all())  # nothing written past the hit


def test_a_start_at_or_past_the_hit_is_a_miss(tctx) -> None:
    kvd.store(tctx, make_kv(3 * CHUNK, seed=6), make_tokens(3 * CHUNK, start=50_000))
    toks = make_tokens(5 * CHUNK, start=50_000)
    assert kvd.retrieve(tctx, toks, start=3 * CHUNK) is None  # 3 chunks cached: nothing from 3 on
    assert kvd.retrieve(tctx, toks, start=5 * CHUNK) is None  # past the tokens: no server call needed
    got = kvd.retrieve(tctx, toks, start=2 * CHUNK)
    assert got is not None and got.shape[2] == CHUNK


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": range(0, 4)}, r"layers range\(0, 4\) is not a non-empty increasing range within the model's 3"),
        ({"layers": range(2, 2)}, "not a non-empty increasing range"),
        ({"layers": range(2, 0, -1)}, "not a non-empty increasing range"),
        ({"layers": [0, 1]}, "layers must be a range of layer indices"),
        ({"start": 5}, "start must be a non-negative multiple of the chunk size 16, got 5"),
        ({"start": -CHUNK}, "start must be a non-negative multiple"),
        ({"start": True}, "start must be a non-negative multiple"),
        (
            {"layers": range(1, 3), "out": torch.empty(2, 3, 5 * CHUNK, 16, dtype=torch.bfloat16)},
            r"out must be \[2, 2, tokens, 16\]",
        ),
    ],
)
def test_bad_partial_reads_are_refused(ctx: kvd.KVCacheContext, kwargs: dict, message: str) -> None:
    with pytest.raises(kvd.InvalidInputError, match=message):  # checked before anything moves
        kvd.retrieve(ctx, TOKENS, **kwargs)


def test_an_inline_partial_read_moves_only_the_asked_for_bytes(make_server) -> None:
    srv = make_server("--no-shm")
    sent = "kvdock_retrieved_bytes_total"
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c.transport == "inline"
        kv = make_kv(len(TOKENS), seed=8)
        kvd.store(c, kv, TOKENS)
        chunk = c.geometry.chunk_nbytes(CHUNK)
        before = srv.metric(sent)
        got = kvd.retrieve(c, TOKENS, layers=range(1, 2), start=3 * CHUNK)  # 1 of 3 layers of 2 of 5 chunks
        assert got is not None and torch.equal(got, kv[:, 1:2, 3 * CHUNK : 5 * CHUNK])
        assert srv.metric(sent) - before == 2 * chunk // 3
        before = srv.metric(sent)
        many = kvd.retrieve_many(
            c, [TOKENS, TOKENS[: 2 * CHUNK], TOKENS[: 4 * CHUNK]], layers=range(0, 3, 2), start=2 * CHUNK
        )
        assert many[1] is None  # 2 chunks cached: nothing from chunk 2 on, and no frame for it
        assert many[0] is not None and torch.equal(many[0], kv[:, 0:3:2, 2 * CHUNK : 5 * CHUNK])
        assert many[2] is not None and torch.equal(many[2], kv[:, 0:3:2, 2 * CHUNK : 4 * CHUNK])
        assert srv.metric(sent) - before == (3 + 2) * chunk * 2 // 3
        assert kvd.check_server_integrity(c) == []

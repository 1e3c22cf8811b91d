"""The batched read ops on a real server, spoken to directly: malformed and oversized batches are
refused whole (no session opened), and the server keeps serving with its state intact."""

from __future__ import annotations

import time

import pytest

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.config import MAX_BATCH
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m
from kvdock.transport.client import ControlClient

TOKS = normalize_tokens(make_tokens(2 * CHUNK, start=70_000)).tobytes()


def refused(client: ControlClient, msg: object) -> m.Error:
    reply = client.call(msg).reply  # type: ignore[arg-type]
    assert isinstance(reply, m.Error), reply
    return reply


def test_malformed_batches_are_refused_whole(make_server) -> None:
    srv = make_server("--max-request-tokens", str(8 * CHUNK))
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        kv = make_kv(2 * CHUNK, seed=4)
        kvd.store(ctx, kv, make_tokens(2 * CHUNK, start=70_000))
        client = ControlClient(srv.url, timeout=10)
        cid = ctx.client_id
        try:
            cases = [
                (m.LookupMany(cid, [TOKS, TOKS], [""]), "bad_request", "2 prompts but 1 cache salts"),
                (
                    m.PrepareRetrieveMany(cid, ["s"], [TOKS, TOKS], ["", ""]),
                    "bad_request",
                    "2 prompts but 1 session ids",
                ),
                (
                    m.PrepareRetrieveMany(cid, ["s", "s"], [TOKS, TOKS], ["", ""]),
                    "bad_request",
                    "same session id twice",
                ),
                (m.LookupMany(cid, [b""] * (MAX_BATCH + 1), [""] * (MAX_BATCH + 1)), "limit", f"limit of {MAX_BATCH}"),
                (
                    m.LookupMany(cid, [TOKS] * 5, [""] * 5),
                    "limit",
                    "batch of 160 tokens is over the server's limit of 128",
                ),
                (
                    m.PrepareRetrieveMany(cid, ["a", "b"], [TOKS, b"abc"], ["", ""]),
                    "bad_request",
                    "not a whole number of uint32",
                ),
                (m.LookupMany("nobody", [TOKS], [""]), "unknown_client", "not registered"),
                (
                    m.PrepareRetrieve(cid, "p", TOKS, part=m.ReadPart(1, 4)),
                    "bad_request",
                    "within the model's 3 layers",
                ),
                (
                    m.PrepareRetrieve(cid, "p", TOKS, part=m.ReadPart(2, 1)),
                    "bad_request",
                    "within the model's 3 layers",
                ),
                (m.PrepareRetrieve(cid, "p", TOKS, part=m.ReadPart(0, 3, 0)), "bad_request", "within the model's"),
                (m.PrepareRetrieve(cid, "p", TOKS, part=m.ReadPart(0, 3, 1, -1)), "bad_request", "first chunk"),
                (
                    m.PrepareRetrieveMany(cid, ["p"], [TOKS], [""], part=m.ReadPart(0, 9)),
                    "bad_request",
                    "within the model's 3 layers",
                ),
            ]
            for msg, code, text in cases:
                err = refused(client, msg)
                assert err.code == code and text in err.message, err
            assert srv.get("/status")["sessions"] == 0  # the refused retrieve of a valid prompt opened nothing
            # a session id that is open already: the whole batch is refused, the open one untouched
            ok = client.call(m.PrepareRetrieve(cid, "open", TOKS)).reply
            assert isinstance(ok, m.RetrievePrepared) and len(ok.slots) == 2
            err = refused(client, m.PrepareRetrieveMany(cid, ["new", "open"], [TOKS, TOKS], ["", ""]))
            assert "'open' is already open" in err.message
            assert srv.get("/status")["sessions"] == 1
            assert isinstance(client.call(m.CommitRetrieve(cid, "open")).reply, m.Done)
            got = client.call(m.LookupMany(cid, [TOKS, TOKS[:-4]], ["", ""])).reply
            assert got == m.LookupManyResult([2 * CHUNK, CHUNK])
        finally:
            client.close()
        assert kvd.check_server_integrity(ctx) == []
        out = kvd.retrieve(ctx, make_tokens(2 * CHUNK, start=70_000))
        assert out is not None and bool((out == kv).all())


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_locate_names_every_tier_holding_a_chunk(make_server, tmp_path, transport: str) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"), *(["--no-shm"] if transport == "inline" else []))
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        kvd.store(ctx, make_kv(2 * CHUNK, seed=4), make_tokens(2 * CHUNK, start=70_000))
        client = ControlClient(srv.url, timeout=10)
        try:
            deadline = time.monotonic() + 30
            while True:  # the write-down to L2 runs behind the store (slow on a loaded machine)
                found = client.call(m.Locate(ctx.client_id, TOKS + TOKS[: 4 * CHUNK])).reply
                if all(len(row) == 2 for row in found.chunks[:2]) or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert [[s.tier for s in row] for row in found.chunks] == [["l1", "l2"], ["l1", "l2"], []]
            first, second = found.chunks[0][0], found.chunks[1][0]
            assert first.parent == 0 and second.parent == first.version  # one version chain
            assert found.chunks[0][1] == m.Stored("l2", first.version, 0)
        finally:
            client.close()

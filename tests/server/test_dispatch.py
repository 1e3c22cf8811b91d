"""The server's handler tables: one handler per request type, each answering exactly the reply
type its request declares (``RequestBase[R]``), spoken to directly over the control plane."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import CHUNK, MODEL
from kvdock.errors import ProtocolError
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.dispatch import HANDLERS, IDENTIFIED
from kvdock.transport.client import ControlClient, check_reply

TOKS = normalize_tokens(list(range(90_000, 90_000 + 2 * CHUNK))).tobytes()


def test_every_request_type_has_exactly_one_handler() -> None:
    assert HANDLERS.types() | IDENTIFIED.types() == set(m.REQUESTS)
    assert not HANDLERS.types() & IDENTIFIED.types()


def test_every_op_answers_its_declared_reply_type(server) -> None:
    """Each request of a store, lookup, prefetch, retrieve and the rest of a client's life, sent
    as an inline client would: the reply is of the request's declared type (never an Error
    here), and the bytes retrieved are the bytes stored."""
    client = ControlClient(server.url, timeout=10)
    answered: set[type] = set()

    def ask(msg: m.RequestBase[m.ReplyBase], payload: list[bytes] | None = None) -> m.ReplyBase:
        answer = client.call(msg, payload or ())
        assert type(answer.reply) is m.reply_type(msg), (msg, answer.reply)
        answered.add(type(msg))
        return answer.reply

    try:
        assert isinstance(ask(m.Ping()), m.Pong)
        desc = ask(m.Describe(m.PROTOCOL_VERSION, MODEL))
        assert isinstance(desc, m.Described) and desc.layout is not None
        reg = ask(m.RegisterModel(m.PROTOCOL_VERSION, desc.layout))
        assert isinstance(reg, m.ModelRegistered) and not reg.created
        me = ask(m.RegisterClient(m.PROTOCOL_VERSION, "dispatch-test", MODEL))
        assert isinstance(me, m.ClientRegistered) and me.transport == "inline"
        cid = me.client_id
        # a store of two chunks, with their bytes as two frames
        prep = ask(m.PrepareStore(cid, "st", TOKS))
        assert isinstance(prep, m.StorePrepared) and [s.index for s in prep.slots] == [0, 1]
        chunks = [np.random.default_rng(i).integers(0, 256, me.slot_nbytes, np.uint8).tobytes() for i in range(2)]
        done = ask(m.CommitStore(cid, "st", [0, 1]), chunks)
        assert isinstance(done, m.StoreCommitted) and done.committed == 2
        prep = ask(m.PrepareStore(cid, "ended", TOKS))
        assert isinstance(prep, m.StorePrepared) and prep.deduped == 2
        assert isinstance(ask(m.EndSession(cid, "ended")), m.Done)
        # lookups, a prefetching lookup's session and its status
        hit = ask(m.Lookup(cid, TOKS, prefetch=True, session_id="pf"))
        assert isinstance(hit, m.LookupResult) and hit.hit_tokens == 2 * CHUNK
        assert isinstance(ask(m.QueryPrefetchStatus(cid, "pf")), m.PrefetchStatus)
        status = ask(m.WaitPrefetch(cid, "pf", 5.0))
        assert isinstance(status, m.PrefetchStatus) and status.done and status.loaded_tokens == 2 * CHUNK
        renewed = ask(m.RenewSessions(cid, ["pf", "never"]))
        assert isinstance(renewed, m.Renewed) and renewed.gone == ["never"]
        assert isinstance(ask(m.CommitRetrieve(cid, "pf")), m.Done)
        many = ask(m.LookupMany(cid, [TOKS, TOKS[: 4 * CHUNK]], ["", ""]))
        assert isinstance(many, m.LookupManyResult) and many.hit_tokens == [2 * CHUNK, CHUNK]
        # retrieves: the inline frames hold the very bytes stored
        answer = client.call(m.PrepareRetrieve(cid, "rt", TOKS))
        got = answer.reply
        assert isinstance(got, m.RetrievePrepared) and len(got.slots) == 2
        assert [bytes(answer.frames[0][s.offset : s.offset + me.slot_nbytes]) for s in got.slots] == chunks
        answered.add(m.PrepareRetrieve)
        answer = client.call(m.PrepareRetrieveMany(cid, ["a", "b"], [TOKS, TOKS[: 4 * CHUNK]], ["", ""]))
        batch = answer.reply
        assert isinstance(batch, m.RetrieveManyPrepared) and [len(s) for s in batch.slots] == [2, 1]
        assert bytes(answer.frames[0][batch.slots[1][0].offset :][: me.slot_nbytes]) == chunks[0]
        answered.add(m.PrepareRetrieveMany)
        located = ask(m.Locate(cid, TOKS))
        assert isinstance(located, m.Located) and [[s.tier for s in c] for c in located.chunks] == [["l1"], ["l1"]]
        report = ask(m.CheckIntegrity())
        assert isinstance(report, m.IntegrityReport) and report.ok, report.problems
        assert client.send_nowait(m.FastReads(cid, 1, 0, 2, 2))  # never answered
        answered.add(m.FastReads)
        assert isinstance(ask(m.CloseClient(cid, idle=True)), m.Done)
        # after the close, the client's requests are refused with an Error (the other reply type)
        gone = client.call(m.Lookup(cid, TOKS)).reply
        assert isinstance(gone, m.Error) and gone.error_code is ErrorCode.UNKNOWN_CLIENT
    finally:
        client.close()
    assert answered == set(m.REQUESTS)


def test_a_reply_of_another_op_is_refused_by_the_client() -> None:
    """A server answering a request with another op's reply is broken: the client raises
    instead of reading one reply's fields as another's."""
    check_reply(m.Lookup("c", b""), m.LookupResult(0))
    check_reply(m.Lookup("c", b""), m.Error("limit", "x"))
    with pytest.raises(ProtocolError, match="a Lookup was answered RetrievePrepared, not LookupResult"):
        check_reply(m.Lookup("c", b""), m.RetrievePrepared([]))

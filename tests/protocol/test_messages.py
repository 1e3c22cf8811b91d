"""The typed messages: every request declares its reply type, the unions decode every message,
old import paths keep working, and the wire limits live in one module."""

from __future__ import annotations

import typing

import msgspec
import pytest

import kvdock.protocol as protocol
from kvdock import config, layout
from kvdock.errors import ProtocolError
from kvdock.protocol import decode_reply, decode_request, encode, limits
from kvdock.protocol import messages as m
from kvdock.protocol._shared import ReplyBase, RequestBase

EXPECTED_REPLY = {
    m.Ping: m.Pong,
    m.RegisterModel: m.ModelRegistered,
    m.RegisterClient: m.ClientRegistered,
    m.Describe: m.Described,
    m.Lookup: m.LookupResult,
    m.QueryPrefetchStatus: m.PrefetchStatus,
    m.WaitPrefetch: m.PrefetchStatus,
    m.PrepareStore: m.StorePrepared,
    m.CommitStore: m.StoreCommitted,
    m.PrepareRetrieve: m.RetrievePrepared,
    m.CommitRetrieve: m.Done,
    m.FastReads: m.Done,
    m.LookupMany: m.LookupManyResult,
    m.PrepareRetrieveMany: m.RetrieveManyPrepared,
    m.Locate: m.Located,
    m.EndSession: m.Done,
    m.RenewSessions: m.Renewed,
    m.CheckIntegrity: m.IntegrityReport,
    m.CloseClient: m.Done,
}


def test_every_request_declares_its_reply() -> None:
    assert set(m.REQUESTS) == set(EXPECTED_REPLY)
    for req, rep in EXPECTED_REPLY.items():
        assert issubclass(req, RequestBase) and m.reply_type(req) is rep
        assert rep in m.REPLIES
    assert set(m.REPLIES) == {*EXPECTED_REPLY.values(), m.Error}
    assert all(issubclass(r, ReplyBase) for r in m.REPLIES)
    assert m.reply_type(m.Lookup("c", b"")) is m.LookupResult  # an instance too


def test_every_request_and_reply_round_trips_and_is_not_the_other() -> None:
    geo = layout.KVGeometry(2, 1, 8, "float16")
    lay = m.ModelLayout("mdl", geo, 16)
    samples: list[msgspec.Struct] = [
        m.Ping(), m.RegisterModel(m.PROTOCOL_VERSION, lay), m.RegisterClient(m.PROTOCOL_VERSION, "i", "mdl"),
        m.Describe(m.PROTOCOL_VERSION), m.Lookup("c", b"\1\0\0\0"), m.QueryPrefetchStatus("c", "s"),
        m.WaitPrefetch("c", "s", 1.0), m.PrepareStore("c", "s", b""), m.CommitStore("c", "s", [0]),
        m.PrepareRetrieve("c", "s", b"", part=m.ReadPart(0, 1), tips=[3]), m.CommitRetrieve("c", "s"),
        m.FastReads("c", 1, 1, 1, 1, [1], [2], [3], 4), m.LookupMany("c", [b""], [""]),
        m.PrepareRetrieveMany("c", ["s"], [b""], [""]), m.Locate("c", b""), m.EndSession("c", "s"),
        m.RenewSessions("c", ["s"]), m.CheckIntegrity(), m.CloseClient("c", True),
    ]  # fmt: skip
    assert {type(s) for s in samples} == set(m.REQUESTS)
    for req in samples:
        assert decode_request(encode(req)) == req
        with pytest.raises(ProtocolError, match="malformed reply"):
            decode_reply(encode(req))
    replies: list[msgspec.Struct] = [
        m.Error("limit", "x"), m.Pong(12, "v"), m.ModelRegistered(True, 64),
        m.ClientRegistered("c", "shm", 16, 64, "", geo), m.Described(16, 8, 1.0, "", lay, ["mdl"]),
        m.LookupResult(16, [1]), m.PrefetchStatus(True, 16), m.StorePrepared([m.SlotRef(0, 64, 1)], 0, 0),
        m.StoreCommitted(1), m.RetrievePrepared([]), m.LookupManyResult([0]), m.RetrieveManyPrepared([[]]),
        m.Located([[m.Stored("l1", 1, 0)]], ["l3"]), m.Done(), m.Renewed([]), m.IntegrityReport(True, []),
    ]  # fmt: skip
    assert {type(r) for r in replies} == set(m.REPLIES)
    for rep in replies:
        assert decode_reply(encode(rep)) == rep
        with pytest.raises(ProtocolError, match="malformed request"):
            decode_request(encode(rep))


def test_the_old_names_stay_importable() -> None:
    assert protocol.Ping is m.Ping and protocol.Request is m.Request and protocol.Reply is m.Reply
    assert protocol.ErrorCode.LIMIT == "limit" and protocol.PROTOCOL_VERSION == m.PROTOCOL_VERSION
    for name in m.__all__:
        assert getattr(protocol, name) is getattr(m, name)
    with pytest.raises(AttributeError):
        protocol.NoSuchThing  # noqa: B018
    assert m.MAX_RENEW == limits.MAX_RENEW
    assert typing.get_args(m.Request) == m.REQUESTS


def test_the_wire_limits_have_one_home() -> None:
    """kvdock.config (and everything importing its names) reads them from kvdock.protocol.limits."""
    for name in ("MAX_BATCH", "MAX_SALT_LEN", "MAX_NAME_LEN", "MAX_NUM_LAYERS", "MAX_NUM_KV_HEADS", "MAX_HEAD_DIM",
                 "MAX_WORLD_SIZE"):  # fmt: skip
        assert getattr(config, name) == getattr(limits, name), name
    assert limits.MAX_BATCH == 4096 and limits.MAX_SALT_LEN == 256 and limits.MAX_RENEW == 4096
    assert limits.max_local_message_bytes(1000) == 4 * 1000 + 4096 * (4 * 256 + 128) + (1 << 20)
    assert limits.max_frame_bytes(1000, 1 << 30) == (1 << 30) + (1 << 20)
    assert limits.max_frame_bytes(1 << 30, 1 << 20) == (4 << 30) + (1 << 20)

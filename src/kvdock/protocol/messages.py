"""Every message of the control plane, under one name (``from kvdock.protocol import messages as
m``): the shared structs and bases (:mod:`._shared`), the requests (:mod:`.requests`), the replies
(:mod:`.replies`), the two unions the codec decodes, and which reply each request gets
(:func:`reply_type`). Field names are part of the wire contract."""

from __future__ import annotations

import typing

from kvdock.protocol._shared import (
    PROTOCOL_VERSION,
    EngineInfo,
    ModelLayout,
    ReadPart,
    ReplyBase,
    RequestBase,
    SlotRef,
    Stored,
    Transport,
)
from kvdock.protocol.limits import MAX_RENEW
from kvdock.protocol.replies import (
    ClientRegistered,
    Described,
    Done,
    Error,
    IntegrityReport,
    Located,
    LookupManyResult,
    LookupResult,
    ModelRegistered,
    Pong,
    PrefetchStatus,
    Renewed,
    Reply,
    RetrieveManyPrepared,
    RetrievePrepared,
    StoreCommitted,
    StorePrepared,
)
from kvdock.protocol.requests import (
    CheckIntegrity,
    CloseClient,
    CommitRetrieve,
    CommitStore,
    Describe,
    EndSession,
    FastReads,
    Locate,
    Lookup,
    LookupMany,
    Ping,
    PrepareRetrieve,
    PrepareRetrieveMany,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterClient,
    RegisterModel,
    RenewSessions,
    Request,
    WaitPrefetch,
)

REQUESTS: tuple[type[RequestBase[ReplyBase]], ...] = typing.get_args(Request)
REPLIES: tuple[type[ReplyBase], ...] = typing.get_args(Reply)

# Requests the server never answers, not even with an error: their senders do not wait, and
# replies nobody reads would pile up in a client that sends nothing else.
UNANSWERED = (FastReads,)


def _declared_reply(cls: type) -> type[ReplyBase]:
    """``R`` of a class declared ``class X(RequestBase[R])``."""
    for base in getattr(cls, "__orig_bases__", ()):
        if typing.get_origin(base) is RequestBase:
            (reply,) = typing.get_args(base)
            assert isinstance(reply, type) and issubclass(reply, ReplyBase), (cls, reply)
            return reply
    raise AssertionError(f"{cls.__name__} does not declare its reply type")


_REPLY_OF: dict[type, type[ReplyBase]] = {cls: _declared_reply(cls) for cls in REQUESTS}


def reply_type(request: type[RequestBase[ReplyBase]] | RequestBase[ReplyBase]) -> type[ReplyBase]:
    """The reply type a request (or request type) gets when it is not refused (then: Error)."""
    cls = request if isinstance(request, type) else type(request)
    return _REPLY_OF[cls]


__all__ = [
    "MAX_RENEW",
    "PROTOCOL_VERSION",
    "REPLIES",
    "REQUESTS",
    "UNANSWERED",
    "Transport",
    "EngineInfo",
    "ModelLayout",
    "ReplyBase",
    "RequestBase",
    "SlotRef",
    "ReadPart",
    "Stored",
    "Ping",
    "RegisterModel",
    "RegisterClient",
    "Describe",
    "Lookup",
    "QueryPrefetchStatus",
    "WaitPrefetch",
    "PrepareStore",
    "CommitStore",
    "PrepareRetrieve",
    "CommitRetrieve",
    "FastReads",
    "LookupMany",
    "PrepareRetrieveMany",
    "Locate",
    "EndSession",
    "RenewSessions",
    "CheckIntegrity",
    "CloseClient",
    "Request",
    "Error",
    "Pong",
    "ModelRegistered",
    "ClientRegistered",
    "Described",
    "LookupResult",
    "PrefetchStatus",
    "StorePrepared",
    "StoreCommitted",
    "RetrievePrepared",
    "LookupManyResult",
    "RetrieveManyPrepared",
    "Located",
    "Done",
    "Renewed",
    "IntegrityReport",
    "Reply",
    "reply_type",
]

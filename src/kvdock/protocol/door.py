"""The messages of the pool door (``transport.door``): a client trades the single-use ticket a
``Described`` reply gave it for the descriptor of its tenant's pool. One request and one reply
per connection, msgpack; the reply that grants the pool carries its descriptors (SCM_RIGHTS)."""

from __future__ import annotations

import msgspec

from kvdock.protocol.codec import decode_with
from kvdock.protocol.messages import Error


class OpenPool(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Hand me the pool ``ticket`` (from ``Described.pool_ticket``) opens."""

    protocol_version: int
    ticket: str


class PoolOpened(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """The pool's two descriptors come with this reply (its metadata, to map read-only, and its
    slot area); ``size``: the segment's bytes, both together."""

    size: int


DoorReply = PoolOpened | Error

_request: msgspec.msgpack.Decoder[OpenPool] = msgspec.msgpack.Decoder(OpenPool)
_reply: msgspec.msgpack.Decoder[DoorReply] = msgspec.msgpack.Decoder(DoorReply)


def decode_open(data: bytes | memoryview) -> OpenPool:
    """ProtocolError for anything but an OpenPool."""
    return decode_with(_request, data, "pool door request")


def decode_door_reply(data: bytes | memoryview) -> PoolOpened | Error:
    """ProtocolError for anything but a PoolOpened or an Error."""
    return decode_with(_reply, data, "pool door reply")

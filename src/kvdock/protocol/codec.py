"""msgpack encoding of messages. Decoding raises :class:`kvdock.errors.ProtocolError`."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvdock.errors import ProtocolError
from kvdock.protocol.messages import Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
T = TypeVar("T")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_with(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview, what: str) -> T:
    """``decoder.decode(data)``; ProtocolError naming ``what`` for anything it does not accept."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed {what}: {e}") from None
    except RecursionError:  # msgspec's answer to absurdly deep nesting
        raise ProtocolError(f"malformed {what}: nested too deeply") from None


def decode_request(data: bytes | memoryview) -> Request:
    """Decode one request; ProtocolError for anything that is not a valid request."""
    return decode_with(_request_decoder, data, "request")


def decode_reply(data: bytes | memoryview) -> Reply:
    """Decode one reply; ProtocolError for anything that is not a valid reply."""
    return decode_with(_reply_decoder, data, "reply")

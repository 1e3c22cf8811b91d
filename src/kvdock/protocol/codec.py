"""msgpack encoding of messages. Decoding raises :class:`kvdock.errors.ProtocolError`."""

from __future__ import annotations

from typing import Any

import msgspec

from kvdock.errors import ProtocolError
from kvdock.protocol.messages import Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> Any:
    """Decode one request; ProtocolError for anything that is not a valid request."""
    try:
        return _request_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed request: {e}") from None
    except RecursionError:  # msgspec's answer to absurdly deep nesting
        raise ProtocolError("malformed request: nested too deeply") from None


def decode_reply(data: bytes | memoryview) -> Any:
    """Decode one reply; ProtocolError for anything that is not a valid reply."""
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed reply: {e}") from None

"""Typed control-plane messages (msgspec), the protocol version and the frame codec.

Every request is a tagged msgspec Struct (the tag is the op name); every request gets exactly one
reply, which is either the op's own reply type or :class:`Error`. Bulk bytes never appear in a
message: they travel in shared-memory slots, or as raw ZMQ frames after the message.
"""

from kvdock.protocol.codec import decode_reply, decode_request, encode
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.messages import *  # noqa: F403
from kvdock.protocol.messages import PROTOCOL_VERSION, Reply, Request

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "Reply", "Request", "decode_reply", "decode_request", "encode"]

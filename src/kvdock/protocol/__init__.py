"""Typed control-plane messages (msgspec), the protocol version, error codes, limits and the codec.

Every request is a tagged msgspec Struct (the tag is the op name) declaring its reply type
(``RequestBase[R]``); every request gets exactly one reply, which is either the op's own reply
type or :class:`Error`. Bulk bytes never appear in a message: they travel in shared-memory slots,
or as raw ZMQ frames after the message.

The names below load lazily, so that :mod:`kvdock.protocol.limits` (which ``kvdock.config`` and
``kvdock.layout`` import) does not import the messages (which import ``kvdock.layout``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdock.protocol.codec import decode_reply, decode_request, encode
    from kvdock.protocol.codes import ErrorCode
    from kvdock.protocol.messages import PROTOCOL_VERSION, Reply, Request

__all__ = ["PROTOCOL_VERSION", "ErrorCode", "Reply", "Request", "decode_reply", "decode_request", "encode"]

_HOMES = {"decode_reply": "codec", "decode_request": "codec", "encode": "codec", "ErrorCode": "codes"}


def __getattr__(name: str) -> Any:
    """The package's names, and every name of :mod:`kvdock.protocol.messages`, on first use
    (anything else, submodules not imported yet included, is an AttributeError as usual)."""
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"kvdock.protocol.{home}"), name)
    messages = importlib.import_module("kvdock.protocol.messages")
    if name in messages.__all__:
        return getattr(messages, name)
    raise AttributeError(f"module 'kvdock.protocol' has no attribute {name!r}")

"""Error codes on the wire: the ``code`` of every :class:`~kvdock.protocol.messages.Error` reply.

The values are part of the wire contract: never rename one. :data:`SDK_ERRORS` is the one table
that maps a code to the SDK exception it raises.
"""

from __future__ import annotations

import enum

from kvdock import errors as e


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # the frames or the message could not be decoded
    BAD_REQUEST = "bad_request"  # a decodable request with impossible values
    BAD_PAYLOAD = "bad_payload"  # payload frames that do not match the request
    LIMIT = "limit"  # a request larger than the server accepts (tokens, models, bytes)
    PROTOCOL_VERSION = "protocol_version"
    UNKNOWN_CLIENT = "unknown_client"  # never registered, closed, or its lease ran out
    UNKNOWN_MODEL = "unknown_model"
    REGISTRATION = "registration"  # a model layout the server refuses
    UNAUTHORIZED = "unauthorized"  # an admin action without the admin token
    SESSION = "session"  # no such session (never opened, ended, or its lease ran out)
    TIER_UNAVAILABLE = "tier_unavailable"  # an overwrite that a tier cannot make durable now
    BUSY = "busy"  # the client has too many bytes of replies it has not read
    INTERNAL = "internal"  # a bug in the server; the request did nothing


SDK_ERRORS: dict[ErrorCode, type[e.KVCacheSDKError]] = {
    ErrorCode.UNKNOWN_MODEL: e.UnknownModelError,
    ErrorCode.LIMIT: e.InvalidInputError,
    ErrorCode.BAD_PAYLOAD: e.InvalidInputError,
    ErrorCode.UNAUTHORIZED: e.PermissionDeniedError,
    ErrorCode.SESSION: e.LeaseExpiredError,
}


def sdk_error(code: str, message: str) -> e.KVCacheSDKError:
    """The SDK exception for an ``Error(code, message)`` reply; codes not in the table (and
    codes this client does not know) become ServerError."""
    try:
        cls = SDK_ERRORS.get(ErrorCode(code))
    except ValueError:
        cls = None
    if cls is None:
        return e.ServerError(code, message)
    err = cls(message)
    err.code = code
    return err

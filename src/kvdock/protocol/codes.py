"""Error codes on the wire: the ``code`` of every :class:`~kvdock.protocol.replies.Error` reply.

The values are part of the wire contract: never rename one. Every code maps to exactly one SDK
exception class of :mod:`kvdock.errors` and back (:data:`SDK_ERRORS`, :data:`ERROR_CODES`): a
refusal becomes that exception on the client (:func:`sdk_error`), and the exception names its
code (:func:`code_of`). A code this side does not know (a newer peer's) becomes a plain
ServerError that says so. Server-side refusals are :class:`kvdock.errors.RequestError`\\ s whose
``code`` is one of these (:func:`wire_code`).
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


# one class per code, no class twice (checked below and by tests/protocol/test_codes.py)
SDK_ERRORS: dict[ErrorCode, type[e.KVCacheSDKError]] = {
    ErrorCode.MALFORMED: e.MalformedRequestError,
    ErrorCode.BAD_REQUEST: e.BadRequestError,
    ErrorCode.BAD_PAYLOAD: e.BadPayloadError,
    ErrorCode.LIMIT: e.LimitExceededError,
    ErrorCode.PROTOCOL_VERSION: e.ProtocolVersionError,
    ErrorCode.UNKNOWN_CLIENT: e.UnknownClientError,
    ErrorCode.UNKNOWN_MODEL: e.UnknownModelError,
    ErrorCode.REGISTRATION: e.RegistrationRefusedError,
    ErrorCode.UNAUTHORIZED: e.PermissionDeniedError,
    ErrorCode.SESSION: e.LeaseExpiredError,
    ErrorCode.TIER_UNAVAILABLE: e.TierUnavailableError,
    ErrorCode.BUSY: e.ServerBusyError,
    ErrorCode.INTERNAL: e.InternalServerError,
}

ERROR_CODES: dict[type[e.KVCacheSDKError], ErrorCode] = {cls: code for code, cls in SDK_ERRORS.items()}
assert len(ERROR_CODES) == len(SDK_ERRORS) == len(ErrorCode), "SDK_ERRORS must be one-to-one"

UNKNOWN_CODE_HINT = "(an error code this client does not know: is the server a newer kvdock?)"


def parse_code(code: str) -> ErrorCode | None:
    """``code`` as an ErrorCode; None for one this side does not know."""
    try:
        return ErrorCode(code)
    except ValueError:
        return None


def sdk_error(code: str, message: str) -> e.KVCacheSDKError:
    """The SDK exception for an ``Error(code, message)`` reply: the class of :data:`SDK_ERRORS`,
    its ``code`` set; a code this client does not know becomes a ServerError whose message says
    so (``code`` stays the server's string)."""
    known = parse_code(code)
    if known is None:
        return e.ServerError(code, f"{message} {UNKNOWN_CODE_HINT}")
    cls = SDK_ERRORS[known]
    if issubclass(cls, e.ServerError):
        return cls(known, message)
    err = cls(message)
    err.code = known
    return err


def code_of(error: e.KVCacheSDKError | type[e.KVCacheSDKError]) -> ErrorCode | None:
    """The wire code an SDK exception (or class) stands for: its class's in :data:`ERROR_CODES`
    (None for an exception no code maps to, such as InvalidInputError or ServerUnavailableError
    themselves)."""
    cls = error if isinstance(error, type) else type(error)
    return ERROR_CODES.get(cls)


def wire_code(error: e.RequestError) -> ErrorCode:
    """The code a server-side refusal is sent with. An unknown code is a bug of the server
    (AssertionError): every RequestError names an ErrorCode."""
    code = parse_code(error.code)
    assert code is not None, f"RequestError with a code that is not an ErrorCode: {error.code!r}"
    return code

"""Wire error codes <-> SDK exceptions: one-to-one, both directions, for every code; a code this
client does not know (a newer server's) gives a clear generic ServerError."""

from __future__ import annotations

import pytest

from kvdock import errors as e
from kvdock.protocol import ErrorCode, decode_reply, encode
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ERROR_CODES, SDK_ERRORS, UNKNOWN_CODE_HINT, code_of, parse_code, sdk_error, wire_code

# what the SDK raised for each code before each got its own class: kept as a base class, so
# ``except`` clauses written against the old classes still catch them
OLD_CLASS = {
    ErrorCode.MALFORMED: e.ServerError,
    ErrorCode.BAD_REQUEST: e.ServerError,
    ErrorCode.BAD_PAYLOAD: e.InvalidInputError,
    ErrorCode.LIMIT: e.InvalidInputError,
    ErrorCode.PROTOCOL_VERSION: e.ServerError,
    ErrorCode.UNKNOWN_CLIENT: e.ServerError,
    ErrorCode.UNKNOWN_MODEL: e.UnknownModelError,
    ErrorCode.REGISTRATION: e.ServerError,
    ErrorCode.UNAUTHORIZED: e.PermissionDeniedError,
    ErrorCode.SESSION: e.LeaseExpiredError,
    ErrorCode.TIER_UNAVAILABLE: e.ServerError,
    ErrorCode.BUSY: e.ServerError,
    ErrorCode.INTERNAL: e.ServerError,
}


def test_every_code_has_exactly_one_class_and_back() -> None:
    assert set(SDK_ERRORS) == set(ErrorCode) == set(OLD_CLASS)
    assert len(set(SDK_ERRORS.values())) == len(ErrorCode)  # no class twice
    for code, cls in SDK_ERRORS.items():
        assert ERROR_CODES[cls] is code and code_of(cls) is code
        assert issubclass(cls, e.KVCacheSDKError) and cls.__module__ == "kvdock.errors"
    assert code_of(e.InvalidInputError) is None and code_of(e.ServerUnavailableError) is None


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_round_trips_through_the_wire_and_the_sdk(code: ErrorCode) -> None:
    """Server side: a RequestError with the code becomes an Error reply; on the wire the code is a
    plain string; the client decodes it, raises the code's own class (a subclass of the class
    raised before), and that exception names the same code."""
    refusal = e.RequestError(f"refused with {code.value}", code)
    assert wire_code(refusal) is code
    reply = decode_reply(encode(m.Error(wire_code(refusal), str(refusal))))
    assert isinstance(reply, m.Error) and reply.code == code.value and reply.error_code is code
    err = sdk_error(reply.code, reply.message)
    assert type(err) is SDK_ERRORS[code] and isinstance(err, OLD_CLASS[code])
    assert err.code == code.value and err.code is code and code_of(err) is code
    assert f"refused with {code.value}" in str(err)
    if isinstance(err, e.ServerError):  # str and fields as ServerError always had them
        assert str(err) == f"{code.value}: refused with {code.value}" and err.message == f"refused with {code.value}"
    else:
        assert str(err) == f"refused with {code.value}"


def test_an_unknown_code_from_a_newer_server_is_a_clear_generic_error() -> None:
    reply = decode_reply(encode(m.Error("quota_exceeded", "tenant a is over its quota")))  # still decodes
    assert isinstance(reply, m.Error) and reply.error_code is None and parse_code("quota_exceeded") is None
    err = sdk_error(reply.code, reply.message)
    assert type(err) is e.ServerError and err.code == "quota_exceeded" and code_of(err) is None
    assert str(err) == f"quota_exceeded: tenant a is over its quota {UNKNOWN_CODE_HINT}"
    assert "newer" in str(err)


def test_server_side_refusals_name_known_codes() -> None:
    assert wire_code(e.RequestError("x")) is ErrorCode.BAD_REQUEST
    assert wire_code(e.SessionError("x")) is ErrorCode.SESSION
    assert wire_code(e.RegistrationError("x")) is ErrorCode.REGISTRATION
    with pytest.raises(AssertionError, match="not an ErrorCode: 'nonsense'"):
        wire_code(e.RequestError("x", "nonsense"))


def test_codes_are_the_wire_contract() -> None:
    """Renaming a value breaks every deployed client: pin them."""
    assert {c.value for c in ErrorCode} == {
        "malformed", "bad_request", "bad_payload", "limit", "protocol_version", "unknown_client",
        "unknown_model", "registration", "unauthorized", "session", "tier_unavailable", "busy", "internal",
    }  # fmt: skip

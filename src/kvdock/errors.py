"""The exception tree of kvdock: every exception kvdock defines lives here.

    KVDockError                     root of everything kvdock raises on purpose
    ├── ConfigError                 bad flag, env variable or config file value
    ├── ProtocolError               a message that cannot be decoded or is out of place
    ├── ControlTimeout              (transport) no reply within the timeout
    │   └── ConnectionLost          the server closed the connection: no reply will come
    │       └── HandshakeRefused    the CURVE handshake failed (key not authorized, wrong server key)
    ├── DiskInUseError              (storage) another live server holds the L2 directory
    ├── CorruptObject               (storage) bytes that are not the object they claim to be
    ├── UnexpectedReply             (storage) an L3 reply the fast read does not parse: it falls back
    ├── NoRoom                      (storage) an object that does not fit in a tier: write skipped
    ├── UnsupportedLayoutError      (codecs) an engine KV layout no codec knows: refused, never guessed
    ├── RequestError                (server) a request refused with an ErrorCode
    │   ├── SessionError            no such session
    │   └── RegistrationError       a model or client registration refused
    └── KVCacheSDKError             every failure an SDK user can cause or meet
        ├── ServerUnavailableError  server unreachable or not answering in time
        ├── UnknownModelError       model not registered with the server
        ├── InvalidInputError       wrong shape, dtype, length, token ids or absurd sizes
        ├── PoolFullError           the server's L1 pool had no room for a store
        ├── StoreConflictError      chunks being written by another client now; an overwrite superseded
        ├── LeaseExpiredError       a transfer outlived its lease; its bytes were not used
        ├── PermissionDeniedError   no right to it: admin token, CURVE key, tenant's models or salts
        └── ServerError             any other refusal; ``code`` says which
            ├── MalformedRequestError     a request the server could not decode
            ├── BadRequestError           a request with impossible values
            ├── ProtocolVersionError      client and server speak different protocol versions
            ├── UnknownClientError        a client id the server does not know (any more)
            ├── RegistrationRefusedError  a model registration the server refuses
            ├── TierUnavailableError      an overwrite a tier cannot make durable now
            ├── ServerBusyError           too many unread replies: read them first, or retry
            └── InternalServerError       a bug in the server; the request did nothing
        (and under InvalidInputError: LimitExceededError, BadPayloadError)

Server-side errors travel as an ``Error(code, message)`` reply with a code of
:class:`kvdock.protocol.codes.ErrorCode`; ``kvdock.protocol.codes.SDK_ERRORS`` maps every code to
one SDK exception class and back (one-to-one); a code the client does not know (a newer server's)
becomes a plain ServerError that says so. This module imports nothing of kvdock.
Broken internal invariants are ``AssertionError``s, never one of these.
"""

from __future__ import annotations


class KVDockError(Exception):
    """Root of the kvdock exception tree."""


class ConfigError(KVDockError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


class ProtocolError(KVDockError):
    """A control-plane message could not be decoded or is not valid here."""


class ControlTimeout(KVDockError, TimeoutError):
    """No reply arrived within the timeout."""


class ConnectionLost(ControlTimeout):
    """The connection to the server closed (it exited, or dropped this client's local channel):
    no reply will come, so the caller learns it at once instead of at the timeout. ``sent``:
    whether the request had left (if not, it can go another way without running twice)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class HandshakeRefused(ConnectionLost):
    """The server refused the connection's CURVE handshake (this client's key is not authorized,
    it has the wrong server key, or only one side speaks CURVE): no request can get through."""


class DiskInUseError(KVDockError, RuntimeError):
    """Another live server holds the L2 directory."""


class CorruptObject(KVDockError, ValueError):
    """Bytes that are not a valid object, or not the object they were expected to be."""


class UnexpectedReply(KVDockError):
    """An L3 reply that is not the one the fast read expects (storage.resp): the caller falls back
    to a plain GET, and the connection may hold the rest of the reply, so it is never reused."""


class NoRoom(KVDockError):
    """An object does not fit in a tier's budget (or the disk is full): its write is skipped."""


class WriteFenced(KVDockError):
    """L3 refused a write-down: an overwrite on some server replaced the object since it was
    stored (kvdock.storage.coherence). The write is skipped; the object was a stale version."""


class UnsupportedLayoutError(KVDockError, ValueError):
    """An engine's KV cache layout (engine, attention backend, layout, kernel variant, dtype) that
    no codec knows, or tensors that do not have the shape the codec expects."""


class RequestError(KVDockError):
    """A request the server refuses; becomes an ``Error(code, message)`` reply."""

    default_code = "bad_request"  # an ErrorCode value

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = str(code or self.default_code)


class SessionError(RequestError):
    """A request names a session that does not exist (never opened, ended, or its lease ran out)."""

    default_code = "session"


class RegistrationError(RequestError, ValueError):
    """A layout or client registration that the server refuses; the message says why."""

    default_code = "registration"


class KVCacheSDKError(KVDockError):
    """Any failure reported by the SDK (``kvdock.sdk``). ``code`` is the server's error code
    when the server refused the request, else None."""

    code: str | None = None


class ServerUnavailableError(KVCacheSDKError):
    """The server could not be reached, or did not answer within the timeout."""


class UnknownModelError(KVCacheSDKError):
    """The model is not registered with the server."""


class InvalidInputError(KVCacheSDKError, ValueError):
    """An argument has the wrong type, shape, dtype, length or value."""


class PoolFullError(KVCacheSDKError):
    """The server had no room in its L1 pool for any new chunk of a store."""


class StoreConflictError(KVCacheSDKError):
    """Chunks of a store are being written by another client (its reservation is still open), so
    this store could neither write nor dedup them; or an overwrite was not kept whole (a later
    overwrite of its chunks through another server of the fleet). Retry later."""


class LeaseExpiredError(KVCacheSDKError):
    """A transfer took longer than its lease (the process was paused?): the server reused its
    slots, so the bytes were discarded. Nothing wrong was returned or stored; retry."""


class PermissionDeniedError(KVCacheSDKError):
    """The server refused this client: an admin action without the right token, a CURVE key it
    does not authorize, or a model or cache_salt that is not this client's tenant's."""


class ServerError(KVCacheSDKError):
    """The server refused a request; ``code`` is the server's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- one SDK exception per wire error code (kvdock.protocol.codes.SDK_ERRORS) ---------------------
# Each refines the class the SDK raised for its code before (ServerError or InvalidInputError), so
# ``except ServerError`` / ``except InvalidInputError`` and ``.code`` keep working.


class MalformedRequestError(ServerError):
    """The server could not decode the request (``malformed``): a client bug, or a peer that
    speaks another protocol."""


class BadRequestError(ServerError):
    """A decodable request with impossible values (``bad_request``)."""


class ProtocolVersionError(ServerError):
    """Client and server speak different protocol versions (``protocol_version``)."""


class UnknownClientError(ServerError):
    """The client id is not registered with the server (``unknown_client``): never registered,
    closed, or its lease ran out (the SDK registers again where it can)."""


class RegistrationRefusedError(ServerError):
    """The server refused a model or client registration (``registration``); the message says why."""


class TierUnavailableError(ServerError):
    """An overwrite that a tier cannot make durable now (``tier_unavailable``): nothing was
    replaced; retry later."""


class ServerBusyError(ServerError):
    """The client (or all clients) left too many reply bytes unread (``busy``): read them, retry."""


class InternalServerError(ServerError):
    """A bug in the server (``internal``); the request did nothing."""


class LimitExceededError(InvalidInputError):
    """A request larger than the server accepts (``limit``): tokens, batch size, models, bytes."""


class BadPayloadError(InvalidInputError):
    """Payload frames that do not match their request (``bad_payload``)."""


class PrefixMissingError(KVDockError):
    """A store's chunk before the caller's own was asked for: the server no longer holds the
    prefix the caller's chunks chain after (SGLang's backend then stores nothing: a miss)."""


class WriteLate(WriteFenced):
    """L3 refused a write-down that reached it more than the issue limit after it was issued
    (kvdock.storage.coherence: a stalled write); unlike a fenced one, the version itself may still
    be current, so its server keeps it (an overwrite's version is written again by its holder)."""

"""The exception tree of kvdock.

    KVDockError                     root of everything kvdock raises on purpose
    ├── ConfigError                 bad flag, env variable or config file value
    ├── ProtocolError               a message that cannot be decoded or is out of place
    └── KVCacheSDKError             every failure an SDK user can cause or meet
        ├── ServerUnavailableError  server unreachable or not answering in time
        ├── UnknownModelError       model not registered with the server
        ├── InvalidInputError       wrong shape, dtype, length or token ids
        ├── PoolFullError           the server's L1 pool had no room for a store
        └── ServerError             the server answered a request with an error

Broken internal invariants are ``AssertionError``s, never one of these.
"""

from __future__ import annotations


class KVDockError(Exception):
    """Root of the kvdock exception tree."""


class ConfigError(KVDockError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


class ProtocolError(KVDockError):
    """A control-plane message could not be decoded or is not valid here."""


class KVCacheSDKError(KVDockError):
    """Any failure reported by the SDK (``kvdock.sdk``)."""


class ServerUnavailableError(KVCacheSDKError):
    """The server could not be reached, or did not answer within the timeout."""


class UnknownModelError(KVCacheSDKError):
    """The model is not registered with the server."""


class InvalidInputError(KVCacheSDKError, ValueError):
    """An argument has the wrong type, shape, dtype, length or value."""


class PoolFullError(KVCacheSDKError):
    """The server had no room in its L1 pool for any new chunk of a store."""


class ServerError(KVCacheSDKError):
    """The server refused a request; ``code`` is the server's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SessionError(KVDockError):
    """A request names a session that does not exist (never opened, ended, or its lease ran out)."""

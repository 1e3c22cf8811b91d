"""CURVE keys: ZMQ's authenticated, encrypted mechanism for the control plane and KV events.

A keypair is a pair of certificate files that ``kvdock keygen`` writes (zmq's format,
``zmq.auth.create_certificates``): ``NAME.key`` holds the public key (give it away),
``NAME.key_secret`` both keys (mode 0600, never leaves its host). Keys are kept as Z85 text, the
form libzmq's socket options and its ZAP handler use.

- The server takes its own secret certificate and an *authorized-clients directory* of public
  certificates (:class:`ServerCurve`); a tenants file may authorize more keys.
- A client takes the server's public certificate and its own secret one (:class:`ClientCurve`),
  from arguments or from ``KVDOCK_CURVE_SERVER_KEY`` / ``KVDOCK_CURVE_CLIENT_KEY``.

Every function raises ConfigError for a file that is missing, unreadable or not a certificate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.auth.thread

from kvdock.errors import ConfigError

SERVER_KEY_ENV = "KVDOCK_CURVE_SERVER_KEY"  # a client's path to the server's public certificate
CLIENT_KEY_ENV = "KVDOCK_CURVE_CLIENT_KEY"  # a client's path to its own secret certificate
log = logging.getLogger("kvdock.transport.zap")
Z85_KEY_LEN = 40  # characters of a Z85-encoded 32-byte key
ZAP_DOMAIN = "kvdock"  # the server sockets' ZAP domain: their Gate answers for it


def available() -> bool:
    """Whether this libzmq was built with CURVE (libsodium or its own tweetnacl)."""
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class KeyPair:
    """A Z85 public key and, for one's own pair, the secret key (b"" for a peer's)."""

    public: bytes
    secret: bytes = b""

    def __repr__(self) -> str:  # a secret never lands in a log line or a traceback
        return f"KeyPair(public={self.public.decode()!r}{', secret=...' if self.secret else ''})"


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write a new keypair as ``directory/NAME.key`` and ``directory/NAME.key_secret`` (the
    directory is created 0700 if missing; the secret file is 0600). ConfigError if either file
    exists (a key is never overwritten) or ``name`` is not a plain file name."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name")
    root = Path(directory)
    public, secret = root / f"{name}.key", root / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists: a key is never overwritten (remove it first, or pick another name)")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        old = os.umask(0o077)  # the secret file is private from its first byte
        try:
            made_public, made_secret = zmq.auth.create_certificates(str(root), name)
        finally:
            os.umask(old)
        Path(made_public).chmod(0o644)
    except OSError as e:
        raise ConfigError(f"cannot write a keypair in {root}: {e}") from None
    return Path(made_public), Path(made_secret)


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the CURVE certificate {path}: {e}") from None
    if public is None or len(public) != Z85_KEY_LEN or (secret is not None and len(secret) != Z85_KEY_LEN):
        raise ConfigError(f"{path} is not a CURVE certificate (no 40-character Z85 public key)")
    return public, secret


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """One's own keypair from a secret certificate (``NAME.key_secret``)."""
    public, secret = _load(path)
    if not secret:
        raise ConfigError(f"{path} holds no secret key: give the NAME.key_secret file of the pair")
    return KeyPair(public, secret)


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key of a certificate (a public or a secret one)."""
    return _load(path)[0]


def load_authorized(directory: str | Path) -> frozenset[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory`` (ConfigError if it is not
    a directory or holds an unreadable one). Secret certificates there are refused: a directory
    handed around for authorization must not carry secrets."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"the authorized-clients directory {root} does not exist")
    keys = set()
    for path in sorted(root.iterdir()):
        if path.name.endswith(".key_secret"):
            raise ConfigError(f"{path} is a secret key: the authorized-clients directory holds public keys only")
        if path.suffix == ".key":
            keys.add(load_public(path))
    return frozenset(keys)


@dataclass(frozen=True)
class ServerCurve:
    """The server's keypair and the client keys it lets in (their handshake fails otherwise)."""

    keys: KeyPair
    authorized: frozenset[bytes]

    @classmethod
    def load(cls, secret_key: str | Path, authorized_dir: str | Path, extra: Iterable[bytes] = ()) -> ServerCurve:
        """From the server's secret certificate and the authorized-clients directory (``""``:
        only the ``extra`` keys, e.g. a tenants file's)."""
        authorized = load_authorized(authorized_dir) if authorized_dir else frozenset()
        return cls(load_keypair(secret_key), authorized | frozenset(extra))

    def allows(self, public: bytes) -> bool:
        return public in self.authorized


@dataclass(frozen=True)
class ClientCurve:
    """What a client needs: the server's public key, and its own keypair."""

    server_key: bytes
    keys: KeyPair

    @classmethod
    def load(cls, server_key: str | os.PathLike[str], client_key: str | os.PathLike[str]) -> ClientCurve:
        """From the server's public certificate and this client's secret one."""
        return cls(load_public(server_key), load_keypair(client_key))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientCurve | None:
        """From ``KVDOCK_CURVE_SERVER_KEY`` and ``KVDOCK_CURVE_CLIENT_KEY`` (None when neither is
        set; ConfigError when only one is)."""
        env = os.environ if env is None else env
        server, client = env.get(SERVER_KEY_ENV, ""), env.get(CLIENT_KEY_ENV, "")
        if not server and not client:
            return None
        if not server or not client:
            raise ConfigError(f"CURVE needs both {SERVER_KEY_ENV} and {CLIENT_KEY_ENV}")
        return cls.load(server, client)


def resolve_client(
    server_key: str | os.PathLike[str] | None = None,
    client_key: str | os.PathLike[str] | None = None,
    curve: ClientCurve | None = None,
) -> ClientCurve | None:
    """The client's CURVE settings: ``curve``, else the two paths (both or neither), else the
    environment; None means a plain connection."""
    if curve is not None:
        return curve
    if server_key or client_key:
        if not server_key or not client_key:
            raise ConfigError("CURVE needs both the server's public key and this client's secret key")
        return ClientCurve.load(server_key, client_key)
    return ClientCurve.from_env()


def apply_server(sock: zmq.Socket[bytes], curve: ServerCurve) -> None:
    """Make ``sock`` a CURVE server (before bind); its context must run a :class:`Gate`."""
    sock.curve_server = True
    sock.curve_secretkey = curve.keys.secret
    sock.curve_publickey = curve.keys.public
    sock.zap_domain = ZAP_DOMAIN.encode()


def apply_client(sock: zmq.Socket[bytes], curve: ClientCurve) -> None:
    """Make ``sock`` a CURVE client of the server whose public key ``curve`` holds (before connect)."""
    sock.curve_serverkey = curve.server_key
    sock.curve_publickey = curve.keys.public
    sock.curve_secretkey = curve.keys.secret


class Gate:
    """The ZAP handler of one zmq context: a thread that answers the handshake of every CURVE
    server socket of the context, letting in the keys ``curve`` allows (the rest fail with
    HANDSHAKE_FAILED_AUTH at the client). A socket's messages then carry the client's Z85 public
    key as their ``User-Id`` property."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], curve: ServerCurve) -> None:
        self.curve = curve
        self.refused = 0  # handshakes refused (a count: read from any thread)
        self._logged: set[bytes] = set()
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=log)
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:  # the authenticator's thread
        if self.curve.allows(key):
            return True
        self.refused += 1
        if key not in self._logged and len(self._logged) < 1000:  # once per key: a flood stays quiet
            self._logged.add(key)
            log.warning("refused a CURVE client whose key %s is not authorized", key.decode(errors="replace"))
        return False

    def stop(self) -> None:
        self._auth.stop()

"""Tenants: who may use which models and ``cache_salt`` namespaces, and how many bytes of each tier.

A tenants file (``--tenants FILE``, TOML) names each tenant and how its clients prove who they
are: CURVE public keys (Z85 text, or ``*.key`` certificate files relative to the file) and/or
bearer tokens. Example::

    [tenants.acme]
    keys = ["keys/acme-engine.key"]       # CURVE clients with this key are acme's
    tokens = ["a-long-random-token"]      # ... and so are clients that present this token
    models = ["llama-8b"]                 # the models it may register and use ("*": any)
    salts = ["acme", "acme/*"]            # its namespaces: exact, or a prefix ending in "*"
    l1 = "2GiB"                           # byte quotas per tier (absent: no quota of its own)
    l2 = "20GiB"
    l3 = "10GiB"

Every salt belongs to at most one tenant: two tenants whose salts overlap are refused, so that an
object's tenant is a function of its key (quotas charge it, events go to it) and no grant can be
read as sharing another tenant's namespace. A client without a tenant (no key or token in the file)
is refused everything once tenants are configured. Loaded once at start; a ConfigError names the
problem.
"""

from __future__ import annotations

import hmac
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdock.errors import ConfigError
from kvdock.protocol.limits import MAX_SALT_LEN, MAX_TOKEN_LEN, MIN_TOKEN_LEN
from kvdock.sizes import parse_size
from kvdock.transport.curve import load_public

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TIERS = ("l1", "l2", "l3")
_KEYS = {"keys", "tokens", "models", "salts", *TIERS}


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, credentials, models (``"*"``: any), salts and byte quotas (0: none)."""

    name: str
    keys: frozenset[bytes] = frozenset()
    tokens: tuple[str, ...] = ()
    models: frozenset[str] = frozenset()
    salts: frozenset[str] = frozenset()  # exact salts
    prefixes: tuple[str, ...] = ()  # salt prefixes (from entries ending in "*")
    quotas: Mapping[str, int] = field(default_factory=dict)  # tier -> bytes

    def __repr__(self) -> str:  # tokens never land in a log line
        return f"Tenant({self.name!r})"

    def allows_model(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def allows_salt(self, salt: str) -> bool:
        return salt in self.salts or any(salt.startswith(p) for p in self.prefixes)

    def quota(self, tier: str) -> int:
        return int(self.quotas.get(tier, 0))


class Tenants:
    """Every tenant of a server, found by CURVE key, by token or by salt. Read-only after start:
    any thread may use it."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.all = {t.name: t for t in tenants}
        self._by_key = {k: t for t in self.all.values() for k in t.keys}
        self._check_overlaps()

    def __len__(self) -> int:
        return len(self.all)

    @property
    def keys(self) -> frozenset[bytes]:
        """Every tenant's CURVE public keys (the server authorizes them)."""
        return frozenset(self._by_key)

    def by_key(self, key: bytes) -> Tenant | None:
        return self._by_key.get(key) if key else None

    def by_token(self, token: str) -> Tenant | None:
        """The tenant with ``token``; every token is compared, in constant time each."""
        if not token:
            return None
        found = None
        given = token.encode()
        for t in self.all.values():
            for candidate in t.tokens:
                if hmac.compare_digest(given, candidate.encode()):
                    found = t
        return found

    def identify(self, key: bytes, token: str) -> Tenant | None:
        """The tenant a caller proves it is: by its CURVE key, else by its token. None when it
        proves none, or when key and token name different tenants."""
        by_key, by_token = self.by_key(key), self.by_token(token)
        if by_key is not None and by_token is not None and by_key is not by_token:
            return None
        return by_key or by_token

    def owner(self, salt: str) -> Tenant | None:
        """The tenant whose namespace ``salt`` is (at most one: overlaps are refused at load)."""
        for t in self.all.values():
            if t.allows_salt(salt):
                return t
        return None

    def _check_overlaps(self) -> None:
        seen: list[tuple[str, str, bool]] = []  # (tenant, salt or prefix, is a prefix)
        for t in self.all.values():
            mine = [(t.name, s, False) for s in t.salts] + [(t.name, p, True) for p in t.prefixes]
            for name, salt, prefix in mine:
                for other, theirs, their_prefix in seen:
                    if other == name:
                        continue
                    clash = (
                        (prefix and theirs.startswith(salt))
                        or (their_prefix and salt.startswith(theirs))
                        or (not prefix and not their_prefix and salt == theirs)
                    )
                    if clash:
                        raise ConfigError(
                            f"tenants {other!r} and {name!r} both claim cache_salt {salt!r}"
                            f"{'*' if prefix else ''} (overlapping {theirs!r}{'*' if their_prefix else ''}): "
                            "every namespace belongs to one tenant"
                        )
            seen.extend(mine)


def load_tenants(path: str | Path) -> Tenants:
    """Read and check a tenants file (ConfigError naming the tenant and key at fault)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the tenants file {path}: {e}") from None
    if set(doc) != {"tenants"} or not isinstance(doc["tenants"], dict) or not doc["tenants"]:
        raise ConfigError(f"{path}: expected one or more [tenants.NAME] tables and nothing else")
    tenants = Tenants(_tenant(path, name, entry) for name, entry in doc["tenants"].items())
    tokens = [tok for t in tenants.all.values() for tok in t.tokens]
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"{path}: a token is given to two tenants")
    keys = [k for t in tenants.all.values() for k in t.keys]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{path}: a CURVE key is given to two tenants")
    return tenants


def _tenant(path: Path, name: str, entry: Any) -> Tenant:
    where = f"{path}: tenant {name!r}"
    if not NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.', '-'")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (known: {sorted(_KEYS)})")
    lists = {k: entry.get(k, []) for k in ("keys", "tokens", "models", "salts")}
    for k, v in lists.items():
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise ConfigError(f"{where}: {k} must be a list of non-empty strings")
    if not lists["keys"] and not lists["tokens"]:
        raise ConfigError(f"{where} has neither keys nor tokens: no client could be it")
    if any(not MIN_TOKEN_LEN <= len(t) <= MAX_TOKEN_LEN for t in lists["tokens"]):
        raise ConfigError(f"{where}: tokens must be {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters")
    if not lists["models"]:
        raise ConfigError(f'{where} has no models (list them, or "*" for any)')
    salts, prefixes = set(), []
    for s in lists["salts"] or []:
        if len(s) > MAX_SALT_LEN:
            raise ConfigError(f"{where}: salt {s[:20]!r}... is over {MAX_SALT_LEN} characters")
        if s.endswith("*"):
            if "*" in s[:-1] or len(s) == 1:
                raise ConfigError(f'{where}: salt {s!r}: a prefix is TEXT* (a lone "*" would claim every salt)')
            prefixes.append(s[:-1])
        elif "*" in s:
            raise ConfigError(f"{where}: salt {s!r}: '*' only ends a prefix")
        else:
            salts.add(s)
    if not salts and not prefixes:
        raise ConfigError(f"{where} has no salts: it could store nothing")
    quotas = {}
    for tier in TIERS:
        if tier in entry:
            value = entry[tier]
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ConfigError(f'{where}: {tier} must be a size (e.g. "2GiB")')
            quotas[tier] = parse_size(value)
    return Tenant(
        name,
        frozenset(_key(path, k, where) for k in lists["keys"]),
        tuple(lists["tokens"]),
        frozenset(lists["models"]),
        frozenset(salts),
        tuple(prefixes),
        quotas,
    )


def _key(path: Path, text: str, where: str) -> bytes:
    """A Z85 key given inline, or read from a certificate file (relative to the tenants file)."""
    if len(text) == 40 and not text.endswith(".key"):
        return text.encode()
    cert = Path(text) if Path(text).is_absolute() else path.parent / text
    try:
        return load_public(cert)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None

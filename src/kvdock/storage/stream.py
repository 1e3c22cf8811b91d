"""The entries of the fleet's invalidation stream (storage.coherence) as this server reads and
writes them: stream positions as ordered ints, an entry's payload of keys, what one poll read,
and the fence a write-down carries to L3. Plain data and codecs: no I/O."""

from __future__ import annotations

import logging
import secrets
from typing import NamedTuple

import msgspec

from kvdock.keys import ObjectKey

__all__ = [
    "Fence",
    "Invalidation",
    "PollResult",
    "decode_keys",
    "encode_keys",
    "fresh_incarnation",
    "pos_int",
    "pos_text",
]

log = logging.getLogger(__name__)


def pos_int(text: bytes | str) -> int:
    """A stream id ``ms-seq`` as one ordered int."""
    s = text.decode() if isinstance(text, bytes) else text
    ms, _, seq = s.partition("-")
    return int(ms) << 64 | int(seq or 0)


def pos_text(pos: int) -> str:
    return f"{pos >> 64}-{pos & (2**64 - 1)}"


class Fence(NamedTuple):
    """What a write-down carries to L3: its server's position when issued, and when that was
    (L3's clock, ms)."""

    position: int
    issued_ms: int
    incarnation: bytes = b""  # the stream's the server knew: L3 keys name it (a write issued before
    # L3 lost everything lands under a key nobody reads)


class Invalidation(NamedTuple):
    """One stream entry: the keys an overwrite replaced, at stream position ``position``."""

    position: int
    keys: list[ObjectKey]


class PollResult(NamedTuple):
    """One poll: when it was sent (monotonic), L3's clock then, the entries after the position it
    asked from, whether entries were lost (trimmed, or the stream itself), the position and the
    count of entries consumed after it, and whether it read everything there was. ``recent``: on
    the first poll of a run and after a gap, the entries of the last :data:`~kvdock.storage.coherence.RECENT_MS` (L3's
    clock) whatever the position, so that a server started (or restarted on its L2, past them)
    during another's overwrite knows its keys were overwritten lately (R-FLEET)."""

    sent: float
    redis_ms: int
    entries: list[Invalidation]
    lost: bool
    position: int
    consumed: int
    caught_up: bool
    recent: tuple[Invalidation, ...] = ()


def fresh_incarnation() -> bytes:
    return secrets.token_hex(16).encode()


def encode_keys(keys: list[ObjectKey]) -> bytes:
    """An entry's payload: the keys grouped by (model, rank, salt)."""
    groups: dict[tuple[str, int, str], list[bytes]] = {}
    for k in keys:
        groups.setdefault((k.model, k.rank, k.salt), []).append(k.chunk)
    return msgspec.msgpack.encode([[m, r, s, b"".join(c)] for (m, r, s), c in groups.items()])


def decode_keys(data: bytes) -> list[ObjectKey]:
    """The keys of an entry; [] for anything that is not one (never raises)."""
    try:
        groups = msgspec.msgpack.decode(data, type=list[tuple[str, int, str, bytes]])
    except msgspec.DecodeError:
        log.warning("coherence: an invalidation that is not one was ignored")
        return []
    return [ObjectKey(m, r, s, c[i : i + 32]) for m, r, s, c in groups for i in range(0, len(c), 32)]

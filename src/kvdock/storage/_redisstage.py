"""Staged write-downs of plain versions to a shared L3 (storage.redis, storage.coherence).

A plain version's write-down issued before its server learned of an overwrite must never land
after that overwrite. The overwrite's floor (storage.coherence: fenced writes) refuses it while
the floor lives, but Redis may evict a floor (``allkeys-lru``) with the overwrite's value
within the seconds such a write may take, and then nothing in L3 remembers the overwrite but its
invalidation stream. So a plain write-down lands in two steps:

1. **stage** (WRITE_SCRIPT): the value goes to a staged key beside the object's (same hash slot)
   with a random nonce, both expiring after STAGED_TTL_MS; readers never read it;
2. **check and commit** (:func:`settle`): once its batch is staged, the server reads the stream's
   entries after the batch's positions (CHECK_SCRIPT, on the stream's node); a staged write
   whose key an entry after its own position names is dropped, the others are committed
   (COMMIT_SCRIPT: renamed onto the object's key if the nonce is still theirs).

Why no replaced version can land: an overwrite appends its first entry (E1) before it deletes
the key, and its deletion (DELETE_SCRIPT) deletes a staged write too. If E1 was appended before
the staged write landed, the check (sent after it landed) reads E1; if after, the deletion comes
after the staging and removes it, so the commit finds nothing (or, having come first, the
committed value is deleted as any value is). Both hold whatever Redis evicts: a staged write, its
nonce, a floor or a value gone is a write that does not land (a miss), and a stream that cannot
show every entry after the position (another incarnation, trimmed, deleted) fails the check.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

from kvdock.errors import WriteFenced, WriteLate
from kvdock.keys import ObjectKey
from kvdock.storage._coherence_lua import (
    CHECK_SCRIPT,
    COMMIT_SCRIPT,
    INCARNATION_KEY,
    NONCE_SUFFIX,
    STAGED_SUFFIX,
    STREAM_KEY,
    WRITE_SCRIPT,
)
from kvdock.storage.stream import Fence, decode_keys, pos_int, pos_text

__all__ = [
    "CHECK_COUNT",
    "COMMITTED",
    "COMMIT_SCRIPT",
    "GONE",
    "REFUSED",
    "UNPROVEN",
    "Staged",
    "commit_args",
    "nonce",
    "refusal",
    "settle",
    "staged_keys",
    "write",
]

CHECK_COUNT = 10_000  # stream entries one check reads at most (more: the batch is not committed)
COMMITTED, GONE, REFUSED, UNPROVEN = 1, 0, -1, -2  # a staged write's outcome (settle)


class Staged(NamedTuple):
    """A plain version's write staged in L3: its object key, L3 key, nonce, its server's position
    when issued and the stream's incarnation then, its size, and whether its server's L3 budget
    counted an earlier write of that key when it was staged (storage.redis)."""

    key: ObjectKey
    final: bytes
    nonce: str
    position: int
    incarnation: bytes
    size: int
    counted: bool = False


def nonce() -> str:
    return secrets.token_hex(12)


def staged_keys(final: bytes) -> tuple[bytes, bytes]:
    """The staged write's key and its nonce's, beside ``final`` in its hash slot."""
    return final + STAGED_SUFFIX, final + NONCE_SUFFIX


def write(
    client: Any,
    key: ObjectKey,
    final: bytes,
    floor: bytes,
    header: bytes,
    payload: memoryview,
    fence: Fence,
    overwrite: str,
) -> Staged | None:
    """[writer] WRITE_SCRIPT (storage.coherence) for ``key``'s object at ``final``: an overwrite's
    version (``overwrite``: its E2, from its header) written (None), a plain version ("") staged (its Staged, for
    :func:`settle`); raises WriteLate (issued too long ago) or WriteFenced (stale)."""
    keys: tuple[bytes, ...] = (final, floor)
    args: tuple[Any, ...] = (header, payload, pos_text(fence.position), fence.issued_ms, overwrite)
    staged = None
    if not overwrite:
        staged = Staged(key, final, nonce(), fence.position, fence.incarnation, len(header) + len(payload))
        keys, args = (*keys, *staged_keys(final)), (*args, staged.nonce)
    written = int(client.eval(WRITE_SCRIPT, len(keys), *keys, *args))
    if written != 1:
        err = WriteLate if written == 0 else WriteFenced
        raise err(f"L3 refused a write-down of {key.chunk.hex()[:16]} ({'late' if written == 0 else 'stale'})")
    return staged


def _named(entries: list[Any]) -> dict[ObjectKey, int]:
    """The latest position at which the stream's ``entries`` name each key."""
    named: dict[ObjectKey, int] = {}
    for entry_id, fields in entries:
        data = dict(zip(fields[::2], fields[1::2], strict=True)).get(b"k", b"")
        pos = pos_int(entry_id)
        for key in decode_keys(data):
            named[key] = max(named.get(key, 0), pos)
    return named


def settle(
    stream: Any, run: Callable[[list[Staged], list[bool]], list[int]], staged: list[Staged], incarnation: bytes
) -> list[int]:
    """[writer] Check and commit ``staged`` (module docstring): one CHECK_SCRIPT on ``stream``
    (the client of the stream's node) from the earliest position, then ``run(staged, commit)``
    (COMMIT_SCRIPT for each, pipelined; ``commit[i]`` False drops it). Per write: COMMITTED,
    GONE (not there any more), REFUSED (an entry after its position names its key, or stale by
    then) or UNPROVEN (the stream could not show every entry after its position, or the write was
    issued under another incarnation of it than ``incarnation``, the current one)."""
    if not staged:
        return []
    start = min(s.position for s in staged)
    found = stream.eval(CHECK_SCRIPT, 2, STREAM_KEY, INCARNATION_KEY, incarnation, pos_text(start), CHECK_COUNT)
    if not isinstance(found, list):  # -1: cannot tell
        run(staged, [False] * len(staged))
        return [UNPROVEN] * len(staged)
    named = _named(found)
    current = [s.incarnation == incarnation for s in staged]
    commit = [c and named.get(s.key, 0) <= s.position for s, c in zip(staged, current, strict=True)]
    done = run(staged, commit)
    return [d if ok else REFUSED if c else UNPROVEN for d, ok, c in zip(done, commit, current, strict=True)]


def commit_args(s: Staged, floor: bytes, commit: bool) -> tuple[Any, ...]:
    """COMMIT_SCRIPT's ``numkeys, *keys, *args`` for ``s`` (its object's ``floor`` key)."""
    staged_key, nonce_key = staged_keys(s.final)
    return (4, s.final, floor, staged_key, nonce_key, s.nonce, pos_text(s.position), "1" if commit else "0")


def refusal(s: Staged, outcome: int) -> Exception | None:
    """What :func:`settle`'s ``outcome`` for ``s`` means to its lane: None (committed), WriteFenced
    (an overwrite replaced it: its server drops its copy) or WriteLate (gone or unproven: skipped)."""
    if outcome == COMMITTED:
        return None
    what = {REFUSED: "stale", UNPROVEN: "unproven"}.get(outcome, "gone")
    err = WriteFenced if outcome == REFUSED else WriteLate
    return err(f"L3 did not commit a write-down of {s.key.chunk.hex()[:16]} ({what})")

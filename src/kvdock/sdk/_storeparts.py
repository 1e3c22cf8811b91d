"""A store's copy in parts: the server commits the chunks copied so far while the SDK copies the
next ones (issue 26: the commit's server work, and its wake-up, behind the copy).

Over shared memory, a plain store of at least ``2 * PART_BYTES`` copies its slots in up to
``MAX_PARTS`` parts of whole chunks (every shard of a chunk in one part), in slot order, and
after each part but the last sends ``CommitStore(more=True)`` for that part without waiting for
the answer. Its last ``CommitStore`` (``ops._store_once``) names every chunk of the store and is
the one that decides: a part the server refused or has not seen yet is committed there, and its
answer counts what the parts committed (``server/storing.py:_commit_part``). What a failure
between parts leaves: the parts committed so far, whole chunks of one version each (a prefix of
the store), the rest never visible (a miss). An overwrite, or an inline client (its bytes go with
the CommitStore), commits in one step."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvdock.protocol import messages as m
from kvdock.sdk._transfer import ShmTransfer, Transfer
from kvdock.sdk.chunks import ChunkSource
from kvdock.sdk.context import KVCacheContext

PART_BYTES = 16 << 20  # the least a part copies: below, its commit's fixed cost is not worth it
MAX_PARTS = 4

__all__ = ["MAX_PARTS", "PART_BYTES", "bounds", "write"]


def write(
    ctx: KVCacheContext,
    t: Transfer,
    slots: Sequence[m.SlotRef],
    source: ChunkSource,
    commit: tuple[str, str] | None,
) -> list[memoryview]:
    """``t.write(slots, source)``; with ``commit`` (client id, session id: a plain store) over
    shared memory, in parts, each but the last committed once copied (see the module docs)."""
    cuts = bounds(slots, ctx.shards, t.chunk_nbytes) if commit is not None and isinstance(t, ShmTransfer) else []
    if len(cuts) <= 2:
        return t.write(slots, source)
    assert commit is not None
    for a, b in itertools.pairwise(cuts):
        t.write(slots[a:b], source)
        if b < len(slots):
            ctx.notify(m.CommitStore(commit[0], commit[1], [s.index for s in slots[a:b]], more=True))
    return []


def bounds(slots: Sequence[m.SlotRef], shards: int, slot_nbytes: int) -> list[int]:
    """Where the parts of a copy of ``slots`` (chunk-major, ``shards`` slots a chunk) start, and
    its end: ``[0, ..., len(slots)]``; ``[0, len(slots)]`` for a copy too small to split. Each
    part holds whole chunks and at least ``PART_BYTES``."""
    n = len(slots)
    parts = min(MAX_PARTS, n * slot_nbytes // PART_BYTES)
    if parts < 2:
        return [0, n]
    firsts = [k for k in range(n) if not k or slots[k].index // shards != slots[k - 1].index // shards]
    parts = min(parts, len(firsts))  # (a chunk's shards stay together: parts start at its first slot)
    return [firsts[p * len(firsts) // parts] for p in range(parts)] + [n]

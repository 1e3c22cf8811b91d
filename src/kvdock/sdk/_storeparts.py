"""A store's copy in parts: the server commits the chunks copied so far while the SDK copies the
next ones (issue 26: the commit's server work, and its wake-up, behind the copy).

Only where a CPU is left for the server while the copy's threads run (more CPUs than
:func:`kvdock.memcpy.default_threads`), unless ``PART_BYTES`` is set: on a machine whose every
CPU copies, the server's work and each part's wake-up take them from the copy, and a set was
slower in parts (docs/benchmarks.md, SGLang section: 2 vCPUs, 0.40-0.70x a memcpy in 2 or 4 parts
against 0.78-0.79x in one step, A/B in one process).

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
import os
from collections.abc import Sequence

from kvdock.memcpy import default_threads
from kvdock.protocol import messages as m
from kvdock.sdk._transfer import ShmTransfer, Transfer
from kvdock.sdk.chunks import ChunkSource
from kvdock.sdk.context import KVCacheContext

AUTO_PART_BYTES = 16 << 20  # the least a part copies: below, its commit's fixed cost is not worth it
PART_BYTES: int | None = None  # None: AUTO_PART_BYTES where a CPU is left for the server, else no parts
MAX_PARTS = 4

__all__ = ["AUTO_PART_BYTES", "MAX_PARTS", "PART_BYTES", "bounds", "part_bytes", "write"]


def write(
    ctx: KVCacheContext,
    t: Transfer,
    slots: Sequence[m.SlotRef],
    source: ChunkSource,
    commit: tuple[str, str] | None,
) -> list[memoryview]:
    """``t.write(slots, source)``; with ``commit`` (client id, session id: a plain store) over
    shared memory, in parts, each but the last committed once copied (see the module docs)."""
    least = part_bytes()
    parted = commit is not None and least is not None and isinstance(t, ShmTransfer)
    cuts = bounds(slots, ctx.shards, t.chunk_nbytes, least) if parted and least is not None else []
    if len(cuts) <= 2:
        return t.write(slots, source)
    assert commit is not None
    for a, b in itertools.pairwise(cuts):
        t.write(slots[a:b], source)
        if b < len(slots):
            ctx.notify(m.CommitStore(commit[0], commit[1], [s.index for s in slots[a:b]], more=True))
    return []


def part_bytes() -> int | None:
    """The least a part copies (``PART_BYTES`` if set), or None: no parts (every CPU copies)."""
    if PART_BYTES is not None:
        return PART_BYTES
    return AUTO_PART_BYTES if len(os.sched_getaffinity(0)) > default_threads() else None


def bounds(slots: Sequence[m.SlotRef], shards: int, slot_nbytes: int, least: int = AUTO_PART_BYTES) -> list[int]:
    """Where the parts of a copy of ``slots`` (chunk-major, ``shards`` slots a chunk) start, and
    its end: ``[0, ..., len(slots)]``; ``[0, len(slots)]`` for a copy too small to split. Each
    part holds whole chunks and at least ``least`` bytes."""
    n = len(slots)
    parts = min(MAX_PARTS, n * slot_nbytes // least)
    if parts < 2:
        return [0, n]
    firsts = [k for k in range(n) if not k or slots[k].index // shards != slots[k - 1].index // shards]
    parts = min(parts, len(firsts))  # (a chunk's shards stay together: parts start at its first slot)
    return [firsts[p * len(firsts) // parts] for p in range(parts)] + [n]

"""Where one engine rank's KV lies among the shards a model is stored in (pure, no I/O).

A model is stored in the shards of its first registration (:class:`~kvdock.layout.KVGeometry`);
an engine sharded otherwise still reads and writes it, through the SDK context that holds its
heads (:func:`place`):

============================  ==============================  ===========================
the engine's rank holds       reads and writes through         stores
============================  ==============================  ===========================
the same heads as a shard     that rank's context              yes
every head (TP=1)             the whole-model context          yes (split into the shards)
part of one shard's heads     that shard's rank's context,     no: loads only (it holds
                              its heads cut out                part of a stored chunk)
heads of several shards       -- (refused)                     --
============================  ==============================  ===========================

An MLA latent is the same on every rank and one shard: every rank reads and writes it whole.
Pipeline stages must be the stored ones (or the engine a single rank, TP=1 and PP=1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdock.layout import KVGeometry


@dataclass(frozen=True)
class Placement:
    """How one rank reaches its KV: the SDK context of ``kv_rank`` (None: the whole model's);
    ``dims``, its values ``[start, stop)`` along the last axis of that context's chunks (None:
    all of them); ``writable``, whether it may store (it holds whole shards)."""

    kv_rank: int | None
    dims: tuple[int, int] | None
    writable: bool


def place(stored: KVGeometry, mine: KVGeometry) -> Placement:
    """Where the KV of rank ``mine.rank`` (of ``mine.world_size``, in stage ``mine.pp_rank``) lies in
    a model stored as ``stored`` (rank 0's geometry of its first registration). ValueError, saying
    why, when that rank's KV is not of the same model, is in other pipeline stages, or spans
    several stored shards without being all of them."""
    if stored.logical() != mine.logical():
        raise ValueError(f"the model is stored with geometry {stored.logical()}; this engine's is {mine.logical()}")
    if mine.canonical() == stored.canonical():
        return Placement(mine.global_rank, None, True)
    if mine.ranks == 1:
        return Placement(None, None, True)
    if mine.pp_size != stored.pp_size:
        raise ValueError(
            f"this engine's {mine.pp_size} pipeline stage(s) are not the {stored.pp_size} the model is stored in; "
            "run it with those stages, or as one rank"
        )
    width = stored.num_kv_heads  # heads per stored shard
    first = mine.shard_of(mine.rank) * mine.num_kv_heads  # the rank's heads: [first, last)
    last = first + mine.num_kv_heads
    shard = first // width  # of the stage's
    if (last - 1) // width != shard:
        raise ValueError(
            f"rank {mine.rank} of {mine.world_size} holds KV heads [{first}, {last}), which span several of the "
            f"{stored.tp_shards} shards the model is stored in (tensor-parallel degree {stored.world_size}); run "
            "this engine at that degree, at 1, or at a degree that splits those shards"
        )
    # the first stored rank of the stage holding that shard
    kv_rank = mine.pp_rank * stored.world_size - (-shard * stored.world_size // stored.tp_shards)
    lo, hi = (first - shard * width) * mine.head_dim, (last - shard * width) * mine.head_dim
    whole = (lo, hi) == (0, width * mine.head_dim)
    return Placement(kv_rank, None if whole else (lo, hi), whole)


__all__ = ["Placement", "place"]

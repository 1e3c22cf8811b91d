"""store / retrieve / lookup: whole-chunk transfers of ``KV_2LTD`` tensors addressed by token ids."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvdock.errors import InvalidInputError, KVDockError, PoolFullError, StoreConflictError
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk import _edits as edits
from kvdock.sdk import _fastpath as fastpath
from kvdock.sdk import _retry
from kvdock.sdk import _validate as validate
from kvdock.sdk._requests import Landing, keyed, prepare, shards_of, whole_chunks
from kvdock.sdk._retry import CONFLICT_WAIT_S
from kvdock.sdk.chunks import ChunkSink, ChunkSource, TensorChunks
from kvdock.sdk.context import KVCacheContext, checked

log = logging.getLogger("kvdock.sdk")


@dataclass(frozen=True)
class StoreResult:
    """What a store did, each chunk counted once, as its last attempt found it: written, already
    there (dedup), refused (pool full), being written by another client when this store stopped
    waiting (``in_flight``: not known to be stored at all), not written because they would extend
    an edited prefix the KV was not computed over (``diverged``: :func:`store`'s ``over``), or
    written but not kept (``superseded``: a later overwrite of them through another server of the
    fleet, or this overwrite came to its commit too late; kvdock holds the other's bytes or none)."""

    stored_chunks: int
    deduped_chunks: int
    pool_full_chunks: int
    in_flight_chunks: int = 0
    diverged_chunks: int = 0
    superseded_chunks: int = 0


def store_chunks(
    ctx: KVCacheContext,
    kv: object,
    tokens: object,
    cache_salt: str = "",
    overwrite: bool = False,
    *,
    over: Sequence[int] | None = None,
    edited: bool = True,
) -> StoreResult:
    """Like :func:`store` (``over`` and ``edited`` too), returning the per-chunk outcome. Raises
    PoolFullError only when no new chunk could be stored for lack of room.

    Chunks that another client is writing at that moment are neither written nor counted as
    deduped: the store waits (up to ``CONFLICT_WAIT_S``) for that write to finish and asks again,
    then reports what is still unresolved as ``in_flight_chunks``. An overwrite does not wait."""
    ctx = checked(ctx)
    arr = validate.tokens(tokens)
    kv_t = validate.kv(ctx, kv, len(arr))
    source = TensorChunks(kv_t, ctx.chunk_size)
    arr = arr[: kv_t.shape[2]]
    return _store(ctx, shards_of(ctx, source), arr, cache_salt, overwrite, over=over, edited=edited, kv=kv_t)


def store_from(
    ctx: KVCacheContext,
    source: ChunkSource,
    tokens: object,
    cache_salt: str = "",
    overwrite: bool = False,
    conflict_wait_s: float = CONFLICT_WAIT_S,
    *,
    over: Sequence[int] | None = None,
    edited: bool = False,
) -> StoreResult:
    """Like :func:`store_chunks` (``over`` too), with the KV coming from ``source``: ``source.put(i, slot)`` is
    asked for chunk ``i`` of ``tokens`` (whole chunks only) straight into the shared-memory slot
    it goes to -- only for chunks the server does not already hold. This is the engines' seam
    (their paged KV goes to kvdock in one copy); the SDK cannot check what ``source`` writes.
    ``conflict_wait_s``: how long to wait for chunks another client is writing (an engine passes 0:
    a step never waits; those chunks are reported in flight).

    ``edited`` defaults to False here: an engine's KV is what its model computed for ``tokens``
    (a source of other bytes, e.g. a user's edit, passes True; see :func:`store`). A store past
    an edited stored prefix needs ``over`` (never checked against the bytes here, unlike
    :func:`store_chunks`: the SDK does not read ``source`` back)."""
    ctx = checked(ctx)
    arr = validate.tokens(tokens)
    return _store(ctx, shards_of(ctx, source), arr, cache_salt, overwrite, conflict_wait_s, over, edited)


def _store(
    ctx: KVCacheContext,
    source: ChunkSource,
    arr: np.ndarray,
    cache_salt: str,
    overwrite: bool,
    conflict_wait_s: float = CONFLICT_WAIT_S,
    over: Sequence[int] | None = None,
    edited: bool = False,
    kv: torch.Tensor | None = None,
) -> StoreResult:
    """The stores of :func:`store_chunks` (``kv``: its tensor, for _edits.vouch) and :func:`store_from`."""
    cache_salt, overwrite = validate.cache_salt(cache_salt), validate.overwrite(overwrite)
    tips = validate.tips(ctx, over)  # (the same shape as retrieve_into's tips: one per shard)
    edited = validate.flag("edited", edited)
    arr, cache_salt = keyed(ctx, arr, cache_salt)
    whole = whole_chunks(ctx, arr)
    if not whole:
        return StoreResult(0, 0, 0)
    total = len(whole) // TOKEN_DTYPE.itemsize // ctx.chunk_size * ctx.shards
    pauses = _retry.conflict_pauses(conflict_wait_s, ctx.timeout)

    def attempt(tips: list[int] | None) -> tuple[m.StorePrepared, int, int]:  # (last plan, committed, superseded)
        stored = 0
        # while another client is writing some, ask again (_retry); an overwrite does not wait
        while True:
            prep, n = _store_once(ctx, source, whole, cache_salt, overwrite, tips, edited)
            stored += n
            if not prep.in_flight or overwrite or next(pauses, None) is None:
                return prep, stored, len(prep.slots) - n  # (each chunk counted as the last plan found it)

    prep, stored, superseded = attempt(tips)
    if prep.diverged and tips is None and kv is not None:
        # the stored prefix holds an edit: KV of exactly its bytes extends it (sdk._edits)
        read: edits.Read = lambda w, sink, t: _retrieve_with_retry(ctx, w, cache_salt, sink, tips=t)  # noqa: E731
        vouched = edits.vouch(ctx, kv, whole, cache_salt, read)
        if vouched is not None:
            prep, n, superseded = attempt(vouched)
            stored += n
    if not stored and prep.pool_full and not prep.slots:
        raise PoolFullError(
            f"the server's L1 pool has no room for {prep.pool_full} chunk(s) of {ctx.model_name!r} "
            "(everything else is pinned or of another slot size)"
        )
    if prep.pool_full:
        log.warning("pool full: stored %d chunk(s), %d did not fit", stored, prep.pool_full)
    unresolved = prep.pool_full + prep.in_flight + prep.diverged + superseded
    return StoreResult(stored, total - stored - unresolved, prep.pool_full, prep.in_flight, prep.diverged, superseded)


def _store_once(
    ctx: KVCacheContext,
    source: ChunkSource,
    whole: bytes,
    cache_salt: str,
    overwrite: bool,
    over: list[int] | None = None,
    edited: bool = False,
) -> tuple[m.StorePrepared, int]:
    """One PrepareStore / copy / CommitStore; returns the plan and how many chunks were committed."""
    sid = ctx.new_session_id()
    msg = m.PrepareStore(ctx.client_id, sid, whole, cache_salt, overwrite, over, edited)
    prep, _ = prepare(ctx, sid, msg)
    if not prep.slots:
        return prep, 0
    cid = ctx._answered_client_id()  # the session's client, even if another thread registers again
    committed = False
    try:
        with ctx.transfer() as t:
            payload = t.write(prep.slots, source)
        n = ctx.ask(m.CommitStore(cid, sid, [s.index for s in prep.slots]), payload).committed
        committed = True
    finally:
        if not committed:
            ctx.end_session(sid, cid)
    return prep, int(n)


def store(
    ctx: KVCacheContext,
    kv: torch.Tensor,
    tokens: object,
    cache_salt: str = "",
    overwrite: bool = False,
    *,
    over: Sequence[int] | None = None,
    edited: bool = True,
) -> bool:
    """Store ``kv`` (``[2, L, T, D]``) under the first ``T`` ids of ``tokens``, whole chunks only.

    ``tokens`` may be longer than ``kv`` (never shorter): the ids past its ``T`` tokens are
    ignored, so the KV :func:`retrieve` returned for a prompt (its cached whole-chunk prefix)
    stores with the whole prompt's ids.

    Returns True when at least one chunk was newly written, False when every whole chunk was
    already stored (or there is no whole chunk). ``overwrite=True`` replaces stored chunks.

    Edits. The chunks this call writes are marked *edited* (``edited=True``, the default): KV a
    user hands in may be anything (another prompt's KV under these tokens, a changed tensor),
    not what the model computes for ``tokens``, so an engine that computed these tokens itself
    never extends it with KV computed over other bytes (its save writes nothing past them). Pass
    ``edited=False`` only for KV the model computed for exactly ``tokens`` (an engine's own
    save, e.g. :func:`kvdock.integrations.hf.save_kv`).

    A stored prefix holding an edit (this call's earlier stores, a bundle import, an overwrite)
    is extended only by KV computed over exactly its bytes. ``over``: when the KV was computed
    over a prefix loaded from kvdock, that prefix's tips (the ``versions`` of the
    :func:`lookup_tips` whose prefix was then loaded, e.g. with ``retrieve_into(..., tips=)``;
    one per shard ``ctx`` reads). Without ``over``, the SDK reads the stored prefix back and, if
    ``kv``'s first tokens are byte-identical to it, stores the rest over its tips (so storing P,
    then P+Q from the same tensor, stores Q). Otherwise -- other bytes (an engine's own KV for
    those tokens included), or the prefix overwritten or extended meanwhile, even between that
    read and the store -- no chunk past it is written (a False return; ``store_chunks`` counts
    them ``diverged_chunks``), never an error, and the stored prefix keeps its bytes. With
    ``edited=False`` (the KV is the model's own for ``tokens``) only a prefix holding an edit is
    checked, against ``over``.
    Raises InvalidInputError (shape, dtype, length, token ids), PoolFullError, StoreConflictError
    (nothing written: another client is still writing those chunks; or an overwrite not kept
    whole: ``StoreResult.superseded_chunks``), KVCacheSDKError."""
    result = store_chunks(ctx, kv, tokens, cache_salt, overwrite, over=over, edited=edited)
    if not result.stored_chunks and result.in_flight_chunks:
        raise StoreConflictError(
            f"{result.in_flight_chunks} chunk(s) are being written by another client (its store has not "
            f"committed within {CONFLICT_WAIT_S:g}s); nothing was stored by this call, retry later"
        )
    if overwrite and result.superseded_chunks:
        raise StoreConflictError(
            f"{result.superseded_chunks} chunk(s) of this overwrite were not kept: an overwrite of them through "
            "another server came after it, or it reached its commit too late (kvdock holds the other overwrite's bytes "
            "or nothing there); retry if this overwrite must be the one kept"
        )
    return result.stored_chunks > 0


def retrieve(
    ctx: KVCacheContext,
    tokens: object,
    cache_salt: str = "",
    *,
    out: torch.Tensor | None = None,
    layers: range | None = None,
    start: int = 0,
) -> torch.Tensor | None:
    """The KV of the longest cached whole-chunk prefix of ``tokens`` as a new contiguous CPU tensor
    ``[2, L, hit_tokens, D]``, or None (empty or sub-chunk input, or nothing cached).

    Partial reads: ``layers=range(a, b)`` returns only those layers (``[2, len(layers), ...]``),
    ``start=k`` (a multiple of chunk_size) only the tokens from ``k`` on (``hit_tokens - k`` of
    them; None when no more than ``k`` are cached). The whole prefix is still looked up and pinned
    (its keys chain), but only the asked-for bytes are copied out of the slots (over the inline
    transport the server copies them, and only they cross the wire).

    With ``out`` (a CPU tensor ``[2, L', T, D]`` of the model's dtype, ``L'`` the layers asked
    for, T at least the whole-chunk length of ``tokens`` minus ``start``), the KV is written into
    it instead and the view ``out[:, :, :hit_tokens - start]`` is returned: reusing one buffer
    avoids the page faults of a fresh tensor, the main cost of a large retrieve. Nothing past that
    view is written, but zeros where a copy that had to be redone (a slot moved during it) wrote. Raises
    InvalidInputError for an unusable ``out``, ``layers`` or ``start``; LeaseExpiredError if the
    copy outlived its lease twice in a row (the process was paused: nothing wrong is returned)."""
    ctx = checked(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    picked = validate.layers(ctx, layers)
    if ctx.shards > 1 and ctx.layout.geometry.pp_size > 1 and picked != range(ctx.geometry.num_layers):
        validate.whole_model_only(ctx, "a read of some layers")
    start = validate.start(ctx, start)
    n_whole = len(whole) // TOKEN_DTYPE.itemsize
    if out is not None:
        validate.out(ctx, out, max(n_whole - start, 0), len(picked))
    if not whole or start >= n_whole:
        return None
    landing = Landing(ctx, picked, start, out)
    try:
        hit = _retrieve_with_retry(ctx, whole, cache_salt, landing.sink, landing.part)
    except RuntimeError as e:  # torch refusing to write into the caller's ``out``
        landing.result(0)
        if out is None or isinstance(e, KVDockError):
            raise
        raise InvalidInputError(f"cannot write into out: {e}") from None
    except BaseException:
        landing.result(0)
        raise
    return landing.result(hit)


def retrieve_into(
    ctx: KVCacheContext, tokens: object, sink: ChunkSink, cache_salt: str = "", *, tips: Sequence[int] | None = None
) -> int:
    """Retrieve the longest cached whole-chunk prefix of ``tokens`` chunk by chunk into ``sink``
    (``sink.take(i, slot)`` for chunk ``i``, straight from the shared-memory slot); returns the
    number of tokens handed over (0: nothing cached). The engines' seam, like :func:`store_from`.
    LeaseExpiredError when the copy outlived its lease twice (what ``sink`` got is then garbage).

    ``tips`` (from :func:`lookup_tips`, the entries of the shards ``ctx`` reads): retrieve every
    whole chunk of ``tokens`` only if they are still the versions that lookup saw, else nothing
    (0; ``sink`` got nothing): the ranks of a tensor-parallel engine each load their shard of the
    KV one lookup saw, never one rank a version overwritten since and another the new one. With
    ``tips`` a copy that outlives its lease is not tried again: LeaseExpiredError (the sink holds
    garbage; a second try could find the versions gone and answer 0 after the first one's takes)."""
    ctx = checked(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    vouch = validate.tips(ctx, tips)
    if not whole:
        return 0
    return _retrieve_with_retry(ctx, whole, cache_salt, lambda hit: shards_of(ctx, sink), tips=vouch)


def _retrieve_with_retry(
    ctx: KVCacheContext,
    whole: bytes,
    cache_salt: str,
    sink: Callable[[int], ChunkSink],
    part: m.ReadPart | None = None,
    tips: list[int] | None = None,
) -> int:
    """A read's hit, under the rules of :func:`kvdock.sdk._retry.read` (the pool directory first,
    unless ``tips``)."""
    fast = None if tips is not None else lambda: fastpath.retrieve(ctx, whole, cache_salt, sink, part)
    return _retry.read(fast, lambda: _retrieve_once(ctx, whole, cache_salt, sink, part, tips), tips is not None)


def _retrieve_once(
    ctx: KVCacheContext,
    whole: bytes,
    cache_salt: str,
    make_sink: Callable[[int], ChunkSink],
    part: m.ReadPart | None,
    tips: list[int] | None = None,
) -> int:
    """One PrepareRetrieve / copy / CommitRetrieve; ``make_sink(hit_tokens)`` gives the sink once
    the hit is known, which gets ``part`` of the chunks (all of them when None). Returns the hit
    in tokens."""
    sid = ctx.new_session_id()
    # the server loads chunks that only L2/L3 hold into L1 first; it must answer before we give up
    msg = m.PrepareRetrieve(ctx.client_id, sid, whole, cache_salt, wait_s=ctx.timeout / 2, part=part, tips=tips)
    prepared, frames = prepare(ctx, sid, msg)
    slots = prepared.slots
    if not slots:
        return 0
    cid = ctx._answered_client_id()
    hit = len(slots) // ctx.shards * ctx.chunk_size  # (a model's chunk is ctx.shards slots, in order)
    if part is not None and ctx.shards > 1:  # the transfer counts slots, the server chunks
        part = msgspec.structs.replace(part, first_chunk=part.first_chunk * ctx.shards)
    try:
        sink = make_sink(hit)
        with ctx.transfer() as t:
            t.read(slots, frames, sink, part)
            commits = t.commits_reads
    except BaseException:
        ctx.end_session(sid, cid)
        raise
    # Releasing the pins needs no answer: the session's lease covers a lost or late one (it
    # goes over zmq if the local socket has no room for 50 ms, and may then overtake later
    # requests: a pin is released late, nothing else). Not waiting saves a round trip.
    if commits:
        ctx.notify(m.CommitRetrieve(cid, sid))
    return hit


def lookup(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> int:
    """How many leading tokens of ``tokens`` are cached in any tier (a multiple of chunk_size);
    moves no data."""
    ctx = checked(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    if not whole:
        return 0
    hit = fastpath.lookup(ctx, whole, cache_salt)
    if hit is not None:
        return hit
    return int(ctx.ask(m.Lookup(ctx.client_id, whole, cache_salt)).hit_tokens)


@dataclass(frozen=True)
class Tips:
    """What :func:`lookup_tips` saw: the cached whole-chunk prefix, and the version of its last
    chunk in each shard the context reads (none without a hit)."""

    hit_tokens: int
    versions: tuple[int, ...]


def lookup_tips(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> Tips:
    """:func:`lookup`, with the versions that :func:`retrieve_into` ``tips=`` then loads (or nothing):
    what the scheduler of a tensor-parallel engine hands its ranks. Always asks the server."""
    ctx = checked(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    if not whole:
        return Tips(0, ())
    reply = ctx.ask(m.Lookup(ctx.client_id, whole, cache_salt))
    return Tips(int(reply.hit_tokens), tuple(int(v) for v in reply.tips))


def check_server_integrity(ctx: KVCacheContext, admin_token: str = "") -> list[str]:
    """Ask the server to run its ``check_integrity()``; returns the problems found (empty = sound).
    A server with tenants needs its ``admin_token`` (PermissionDeniedError)."""
    return list(checked(ctx).ask(m.CheckIntegrity(admin_token)).problems)

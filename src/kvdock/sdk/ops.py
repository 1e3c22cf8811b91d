"""store / retrieve / lookup: whole-chunk transfers of ``KV_2LTD`` tensors addressed by token ids."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import numpy as np
import torch

from kvdock import keying
from kvdock.errors import (
    InvalidInputError,
    KVCacheSDKError,
    KVDockError,
    LeaseExpiredError,
    PoolFullError,
    ServerUnavailableError,
    StoreConflictError,
)
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk import fastpath, validate
from kvdock.sdk.buffers import buffer_pool
from kvdock.sdk.chunks import ChunkSink, ChunkSource, ShardedChunks, TensorChunks
from kvdock.sdk.context import KVCacheContext
from kvdock.transport.client import Response

log = logging.getLogger("kvdock.sdk")


def whole_chunks(ctx: KVCacheContext, arr: np.ndarray) -> bytes:
    """``arr``'s whole chunks as the wire's token bytes; InvalidInputError (code ``limit``) past
    the server's max_request_tokens."""
    n = len(arr) // ctx.chunk_size * ctx.chunk_size
    cap = ctx.max_request_tokens
    if cap and n > cap:
        err = InvalidInputError(
            f"request of {n} tokens is over the server's limit of {cap} tokens "
            f"(max_request_tokens; raise it with --max-request-tokens)"
        )
        err.code = "limit"
        raise err
    return arr[:n].tobytes()


def keyed(ctx: KVCacheContext, arr: np.ndarray, cache_salt: str) -> tuple[np.ndarray, str]:
    """``(arr, cache_salt)`` as the server names ``ctx``'s chunks (:mod:`kvdock.keying`): as they
    are under kvdock's key scheme; under SGLang's (a model SGLang registered), the key tokens of
    SGLang's page hashes of ``arr`` seeded by ``cache_salt`` ("": none), under salt "". The
    scheme is ``ctx.chunk_keys`` when set (``"kvdock"`` / ``"sglang"``: to read one engine's KV of
    a model that both serve), else the registered engine's."""
    scheme = getattr(ctx, "chunk_keys", None) or keying.scheme_of(ctx.layout.engine.name)
    if scheme == keying.SGLANG:
        return keying.sglang_tokens(arr, ctx.chunk_size, cache_salt=cache_salt or None), ""
    return arr, cache_salt


E = TypeVar("E", bound=ChunkSource | ChunkSink)


def shards_of(ctx: KVCacheContext, end: E, layers: int | None = None) -> E:
    """``end`` as the end of a transfer of ``ctx``'s stored chunks: itself, or, when each of the
    context's chunks is stored in several shards, a :class:`ShardedChunks` over it (of
    ``layers`` layers, default all)."""
    if ctx.shards == 1:
        return end
    p, n, c, d = ctx.geometry.chunk_shape(ctx.chunk_size)
    stages = ctx.layout.geometry.pp_size
    shape = (p, n if layers is None else layers, c, d)
    return ShardedChunks(end, ctx.shards, shape, ctx.dtype, stages)  # type: ignore[return-value]


def prepare(ctx: KVCacheContext, sid: str, msg: m.PrepareStore | m.PrepareRetrieve) -> Response:
    """A prepare whose reply may never come (timeout): release whatever it may have opened."""
    try:
        return ctx.call(msg)
    except ServerUnavailableError:
        ctx.end_session(sid)
        raise


@dataclass(frozen=True)
class StoreResult:
    """What a store did, chunk by chunk: written, already there (dedup), refused (pool full), or
    being written by another client when this store stopped waiting for it (``in_flight``: not
    stored by this call, and not known to be stored at all)."""

    stored_chunks: int
    deduped_chunks: int
    pool_full_chunks: int
    in_flight_chunks: int = 0


CONFLICT_WAIT_S = 2.0  # how long a store waits for another client's write of the same chunks


def store_chunks(
    ctx: KVCacheContext, kv: object, tokens: object, cache_salt: str = "", overwrite: bool = False
) -> StoreResult:
    """Like :func:`store`, returning the per-chunk outcome. Raises PoolFullError only when no new
    chunk could be stored for lack of room.

    Chunks that another client is writing at that moment are neither written nor counted as
    deduped: the store waits (up to ``CONFLICT_WAIT_S``) for that write to finish and asks again,
    then reports what is still unresolved as ``in_flight_chunks``. An overwrite does not wait."""
    ctx = validate.context(ctx)
    arr = validate.tokens(tokens)
    checked = validate.kv(ctx, kv, len(arr))
    source = TensorChunks(checked, ctx.chunk_size)
    return _store(ctx, shards_of(ctx, source), arr[: checked.shape[2]], cache_salt, overwrite)


def store_from(
    ctx: KVCacheContext,
    source: ChunkSource,
    tokens: object,
    cache_salt: str = "",
    overwrite: bool = False,
    conflict_wait_s: float = CONFLICT_WAIT_S,
) -> StoreResult:
    """Like :func:`store_chunks`, with the KV coming from ``source``: ``source.put(i, slot)`` is
    asked for chunk ``i`` of ``tokens`` (whole chunks only) straight into the shared-memory slot
    it goes to -- only for chunks the server does not already hold. This is the engines' seam
    (their paged KV goes to kvdock in one copy); the SDK cannot check what ``source`` writes.
    ``conflict_wait_s``: how long to wait for chunks another client is writing (an engine passes 0:
    a step never waits; those chunks are reported in flight)."""
    ctx = validate.context(ctx)
    return _store(ctx, shards_of(ctx, source), validate.tokens(tokens), cache_salt, overwrite, conflict_wait_s)


def _store(
    ctx: KVCacheContext,
    source: ChunkSource,
    arr: np.ndarray,
    cache_salt: str,
    overwrite: bool,
    conflict_wait_s: float = CONFLICT_WAIT_S,
) -> StoreResult:
    cache_salt, overwrite = validate.cache_salt(cache_salt), validate.overwrite(overwrite)
    arr, cache_salt = keyed(ctx, arr, cache_salt)
    whole = whole_chunks(ctx, arr)
    if not whole:
        return StoreResult(0, 0, 0)
    total = len(whole) // TOKEN_DTYPE.itemsize // ctx.chunk_size * ctx.shards
    stored = 0
    deadline = time.monotonic() + min(conflict_wait_s, ctx.timeout)
    delay = 0.005
    while True:
        prep, n = _store_once(ctx, source, whole, cache_salt, overwrite)
        stored += n
        if not prep.in_flight or overwrite or time.monotonic() + delay > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    if not stored and prep.pool_full and not prep.slots:
        raise PoolFullError(
            f"the server's L1 pool has no room for {prep.pool_full} chunk(s) of {ctx.model_name!r} "
            "(everything else is pinned or of another slot size)"
        )
    if prep.pool_full:
        log.warning("pool full: stored %d chunk(s), %d did not fit", stored, prep.pool_full)
    unresolved = prep.pool_full + prep.in_flight
    return StoreResult(stored, total - stored - unresolved, prep.pool_full, prep.in_flight)


def _store_once(
    ctx: KVCacheContext, source: ChunkSource, whole: bytes, cache_salt: str, overwrite: bool
) -> tuple[m.StorePrepared, int]:
    """One PrepareStore / copy / CommitStore; returns the plan and how many chunks were committed."""
    sid = ctx.new_session_id()
    prep = prepare(ctx, sid, m.PrepareStore(ctx.client_id, sid, whole, cache_salt, overwrite)).reply
    if not prep.slots:
        return prep, 0
    cid = ctx.answered_client_id()  # the session's client, even if another thread registers again
    committed = False
    try:
        with ctx.transfer() as t:
            payload = t.write(prep.slots, source)
        n = ctx.call(m.CommitStore(cid, sid, [s.index for s in prep.slots]), payload).reply.committed
        committed = True
    finally:
        if not committed:
            ctx.end_session(sid, cid)
    return prep, int(n)


def store(ctx: KVCacheContext, kv: torch.Tensor, tokens: object, cache_salt: str = "", overwrite: bool = False) -> bool:
    """Store ``kv`` (``[2, L, T, D]``) under the first ``T`` ids of ``tokens``, whole chunks only.

    ``tokens`` may be longer than ``kv`` (never shorter): the ids past its ``T`` tokens are
    ignored, so the KV :func:`retrieve` returned for a prompt (its cached whole-chunk prefix)
    stores with the whole prompt's ids.

    Returns True when at least one chunk was newly written, False when every whole chunk was
    already stored (or there is no whole chunk). ``overwrite=True`` replaces stored chunks.
    Raises InvalidInputError (shape, dtype, length, token ids), PoolFullError, StoreConflictError
    (nothing written because another client is still writing those chunks), KVCacheSDKError."""
    result = store_chunks(ctx, kv, tokens, cache_salt, overwrite)
    if not result.stored_chunks and result.in_flight_chunks:
        raise StoreConflictError(
            f"{result.in_flight_chunks} chunk(s) are being written by another client (its store has not "
            f"committed within {CONFLICT_WAIT_S:g}s); nothing was stored by this call, retry later"
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
    ctx = validate.context(ctx)
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


class Landing:
    """Where the bytes of one retrieve land, layers ``layers`` from token ``start`` on: a new
    tensor, or the caller's ``out``. :meth:`sink` is asked once the hit is known."""

    def __init__(self, ctx: KVCacheContext, layers: range, start: int, out: torch.Tensor | None = None) -> None:
        self.ctx, self.layers, self.start, self.out = ctx, layers, start, out
        self.kv: torch.Tensor | None = None
        self.handed = 0  # tokens of ``out`` a sink was given (a copy that was redone may have left garbage)
        whole = layers == range(ctx.geometry.num_layers) and not start
        # what to ask the server for (an inline reply then carries only these bytes)
        self.part = None if whole else m.ReadPart(layers.start, layers.stop, layers.step, start // ctx.chunk_size)

    def sink(self, hit: int) -> ChunkSink:
        n = max(hit - self.start, 0)
        if self.out is None:
            p, _, _, d = self.ctx.geometry.chunk_shape(n)
            self.kv = buffer_pool().empty((p, len(self.layers), n, d), self.ctx.dtype)
        else:
            self.kv = self.out[:, :, :n]
            self.handed = max(self.handed, n)
        return shards_of(self.ctx, TensorChunks(self.kv, self.ctx.chunk_size, self.start // self.ctx.chunk_size))

    def result(self, hit: int) -> torch.Tensor | None:
        """What retrieve returns for a hit of ``hit`` tokens: None when it does not pass ``start``.
        The part of ``out`` past it that an earlier attempt was given (it was discarded: a slot
        moved during its copy) is zeroed, so ``out`` never holds another object's bytes there."""
        n = max(hit - self.start, 0)
        if self.out is not None and self.handed > n:
            with contextlib.suppress(RuntimeError):  # (an out torch cannot write: refused already)
                self.out[:, :, n : self.handed].zero_()
            self.handed = n
        return self.kv if hit > self.start else None


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
    ctx = validate.context(ctx)
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
    hit = None if tips is not None else fastpath.retrieve(ctx, whole, cache_salt, sink, part)
    if hit is not None:
        return hit
    try:
        return _retrieve_once(ctx, whole, cache_salt, sink, part, tips)
    except LeaseExpiredError:
        if tips is not None:  # (what the sink got is garbage, and a retry may find other versions)
            raise
        log.warning("a retrieve outlived its lease; trying once more")
        return _retrieve_once(ctx, whole, cache_salt, sink, part, tips)


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
    resp = prepare(ctx, sid, msg)
    slots = resp.reply.slots
    if not slots:
        return 0
    cid = ctx.answered_client_id()
    hit = len(slots) // ctx.shards * ctx.chunk_size  # (a model's chunk is ctx.shards slots, in order)
    if part is not None and ctx.shards > 1:  # the transfer counts slots, the server chunks
        part = msgspec.structs.replace(part, first_chunk=part.first_chunk * ctx.shards)
    try:
        sink = make_sink(hit)
        with ctx.transfer() as t:
            t.read(slots, resp.frames, sink, part)
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
    ctx = validate.context(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    if not whole:
        return 0
    hit = fastpath.lookup(ctx, whole, cache_salt)
    if hit is not None:
        return hit
    return int(ctx.call(m.Lookup(ctx.client_id, whole, cache_salt)).reply.hit_tokens)


@dataclass(frozen=True)
class Tips:
    """What :func:`lookup_tips` saw: the cached whole-chunk prefix, and the version of its last
    chunk in each shard the context reads (none without a hit)."""

    hit_tokens: int
    versions: tuple[int, ...]


def lookup_tips(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> Tips:
    """:func:`lookup`, with the versions that :func:`retrieve_into` ``tips=`` then loads (or
    nothing): what the scheduler of a tensor-parallel engine hands its ranks. Always asks the
    server."""
    ctx = validate.context(ctx)
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    if not whole:
        return Tips(0, ())
    reply = ctx.call(m.Lookup(ctx.client_id, whole, cache_salt)).reply
    return Tips(int(reply.hit_tokens), tuple(int(v) for v in reply.tips))


def check_server_integrity(ctx: KVCacheContext, admin_token: str = "") -> list[str]:
    """Ask the server to run its ``check_integrity()``; returns the problems found (empty = sound).
    A server with tenants needs its ``admin_token`` (PermissionDeniedError)."""
    report = validate.context(ctx).call(m.CheckIntegrity(admin_token)).reply
    if not isinstance(report, m.IntegrityReport):
        raise KVCacheSDKError(f"unexpected reply {type(report).__name__}")
    return list(report.problems)

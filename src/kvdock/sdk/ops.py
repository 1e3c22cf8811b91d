"""store / retrieve / lookup: whole-chunk transfers of ``KV_2LTD`` tensors addressed by token ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvdock.errors import InvalidInputError, KVCacheSDKError, PoolFullError, ServerUnavailableError
from kvdock.keys import TOKEN_DTYPE, normalize_tokens
from kvdock.protocol import messages as m
from kvdock.sdk.context import KVCacheContext
from kvdock.transport.client import Response

log = logging.getLogger("kvdock.sdk")


def _tokens(tokens: object) -> np.ndarray:
    try:
        return normalize_tokens(tokens)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(str(e)) from None


def _whole_chunks(ctx: KVCacheContext, arr: np.ndarray) -> bytes:
    n = len(arr) // ctx.chunk_size * ctx.chunk_size
    return arr[:n].tobytes()


def _check_kv(ctx: KVCacheContext, kv: object, num_tokens: int) -> torch.Tensor:
    if not isinstance(kv, torch.Tensor):
        raise InvalidInputError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    geo = ctx.geometry
    want = (2, geo.num_layers, num_tokens, geo.hidden_dim)
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != geo.num_layers or kv.shape[3] != geo.hidden_dim:
        raise InvalidInputError(
            f"kv must be KV_2LTD [2, num_layers={geo.num_layers}, tokens, D={geo.hidden_dim}] for "
            f"{ctx.model_name!r}, got {list(kv.shape)}"
        )
    if kv.shape[2] != num_tokens:
        raise InvalidInputError(
            f"kv has {kv.shape[2]} tokens but {num_tokens} token ids were given (want {list(want)})"
        )
    if kv.dtype != ctx.dtype:
        raise InvalidInputError(f"kv dtype {kv.dtype} does not match {ctx.model_name!r}'s {ctx.dtype}")
    return kv if kv.device.type == "cpu" else kv.cpu()


def _prepare(ctx: KVCacheContext, sid: str, msg: m.PrepareStore | m.PrepareRetrieve) -> Response:
    """A prepare whose reply may never come (timeout): release whatever it may have opened."""
    try:
        return ctx.call(msg)
    except ServerUnavailableError:
        ctx.end_session(sid)
        raise


@dataclass(frozen=True)
class StoreResult:
    """What a store did, chunk by chunk: written, already there (dedup), refused (pool full)."""

    stored_chunks: int
    deduped_chunks: int
    pool_full_chunks: int


def store_chunks(
    ctx: KVCacheContext, kv: object, tokens: object, cache_salt: str = "", overwrite: bool = False
) -> StoreResult:
    """Like :func:`store`, returning the per-chunk outcome. Raises PoolFullError only when no new
    chunk could be stored for lack of room."""
    arr = _tokens(tokens)
    kv_t = _check_kv(ctx, kv, len(arr))
    whole = _whole_chunks(ctx, arr)
    if not whole:
        return StoreResult(0, 0, 0)
    sid = ctx.new_session_id()
    prep = _prepare(ctx, sid, m.PrepareStore(ctx.client_id, sid, whole, cache_salt, overwrite)).reply
    if not prep.slots:
        if prep.pool_full:
            raise PoolFullError(
                f"the server's L1 pool has no room for {prep.pool_full} chunk(s) of {ctx.model_name!r} "
                "(everything else is pinned or of another slot size)"
            )
        return StoreResult(0, prep.deduped, 0)
    committed = False
    try:
        payload = ctx._transfer.write(prep.slots, kv_t)
        n = ctx.call(m.CommitStore(ctx.client_id, sid, [s.index for s in prep.slots]), payload).reply.committed
        committed = True
    finally:
        if not committed:
            ctx.end_session(sid)
    if prep.pool_full:
        log.warning("pool full: stored %d chunk(s), %d did not fit", n, prep.pool_full)
    return StoreResult(n, prep.deduped, prep.pool_full)


def store(ctx: KVCacheContext, kv: torch.Tensor, tokens: object, cache_salt: str = "", overwrite: bool = False) -> bool:
    """Store ``kv`` (``[2, L, T, D]``, ``len(tokens) == T``) under ``tokens``, whole chunks only.

    Returns True when at least one chunk was newly written, False when every whole chunk was
    already stored (or there is no whole chunk). ``overwrite=True`` replaces stored chunks.
    Raises InvalidInputError (shape, dtype, length, token ids), PoolFullError, KVCacheSDKError."""
    return store_chunks(ctx, kv, tokens, cache_salt, overwrite).stored_chunks > 0


def retrieve(
    ctx: KVCacheContext, tokens: object, cache_salt: str = "", *, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The KV of the longest cached whole-chunk prefix of ``tokens`` as a new contiguous CPU tensor
    ``[2, L, hit_tokens, D]``, or None (empty or sub-chunk input, or nothing cached).

    With ``out`` (a CPU tensor ``[2, L, T, D]`` of the model's dtype, T at least the whole-chunk
    length of ``tokens``), the KV is written into it instead and the view ``out[:, :, :hit_tokens]``
    is returned: reusing one buffer avoids the page faults of a fresh tensor, the main cost of a
    large retrieve. Raises InvalidInputError for an unusable ``out``."""
    whole = _whole_chunks(ctx, _tokens(tokens))
    if out is not None:
        _check_out(ctx, out, len(whole) // TOKEN_DTYPE.itemsize)
    if not whole:
        return None
    sid = ctx.new_session_id()
    # the server loads chunks that only L2/L3 hold into L1 first; it must answer before we give up
    resp = _prepare(ctx, sid, m.PrepareRetrieve(ctx.client_id, sid, whole, cache_salt, wait_s=ctx.timeout / 2))
    slots = resp.reply.slots
    if not slots:
        return None
    hit = len(slots) * ctx.chunk_size
    try:
        geo = ctx.geometry
        shape = (2, geo.num_layers, hit, geo.hidden_dim)
        given = out is not None
        out = torch.empty(shape, dtype=ctx.dtype) if out is None else out[:, :, :hit]
        try:
            ctx._transfer.read(slots, resp.buffers(), out)
        except RuntimeError as e:
            if not given:
                raise
            raise InvalidInputError(f"cannot write into out: {e}") from None
    except BaseException:
        ctx.end_session(sid)
        raise
    # Releasing the pins needs no answer: messages on one socket arrive in order, and the
    # session's lease covers a lost one. Not waiting saves a round trip per retrieve.
    ctx.notify(m.CommitRetrieve(ctx.client_id, sid))
    return out


def _check_out(ctx: KVCacheContext, out: object, num_tokens: int) -> None:
    if not isinstance(out, torch.Tensor):
        raise InvalidInputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    geo = ctx.geometry
    if out.dim() != 4 or out.shape[0] != 2 or out.shape[1] != geo.num_layers or out.shape[3] != geo.hidden_dim:
        raise InvalidInputError(f"out must be [2, {geo.num_layers}, tokens, {geo.hidden_dim}], got {list(out.shape)}")
    if out.shape[2] < num_tokens:
        raise InvalidInputError(f"out holds {out.shape[2]} tokens, fewer than the {num_tokens} asked for")
    if out.dtype != ctx.dtype or out.device.type != "cpu":
        raise InvalidInputError(f"out must be a CPU tensor of {ctx.dtype}, got {out.dtype} on {out.device}")
    if out.requires_grad:
        raise InvalidInputError("out must not require grad (retrieve writes into it in place)")
    if any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape, strict=True)):
        raise InvalidInputError("out must not have overlapping elements (a stride of 0, e.g. from expand())")


def lookup(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> int:
    """How many leading tokens of ``tokens`` are cached in any tier (a multiple of chunk_size);
    moves no data."""
    whole = _whole_chunks(ctx, _tokens(tokens))
    if not whole:
        return 0
    return int(ctx.call(m.Lookup(ctx.client_id, whole, cache_salt)).reply.hit_tokens)


def check_server_integrity(ctx: KVCacheContext) -> list[str]:
    """Ask the server to run its ``check_integrity()``; returns the problems found (empty = sound)."""
    report = ctx.call(m.CheckIntegrity()).reply
    if not isinstance(report, m.IntegrityReport):
        raise KVCacheSDKError(f"unexpected reply {type(report).__name__}")
    return list(report.problems)

"""lookup_many / retrieve_many: many prompts in one round trip.

Each prompt gets what its single call would give (:func:`~kvdock.sdk.ops.lookup`,
:func:`~kvdock.sdk.ops.retrieve`); prompts the pool directory answers (:mod:`kvdock.sdk._fastpath`)
are answered there, and the rest share one message to the server and one reply.
A batch larger than one request may be (``MAX_BATCH`` prompts, or more tokens than the server's
``max_request_tokens`` together) is sent as several messages, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvdock.config import MAX_BATCH
from kvdock.errors import InvalidInputError, KVCacheSDKError, LeaseExpiredError, ServerUnavailableError
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk import _fastpath as fastpath
from kvdock.sdk import _validate as validate
from kvdock.sdk._requests import Landing, keyed, whole_chunks
from kvdock.sdk.context import KVCacheContext, checked
from kvdock.sdk.ops import retrieve

INLINE_BATCH_BYTES = 256 << 20  # the most one inline batch reply may carry (the server's cap is 1 GiB)


def _requests(
    ctx: KVCacheContext, prompts: object, cache_salt: object
) -> tuple[list[bytes], list[str], list[tuple[np.ndarray, str]]]:
    """Each prompt's whole chunks and salt as the server names them (:func:`keyed`), and the
    prompts and salts as given (what a single call takes)."""
    arrays = validate.prompts(prompts)
    given = validate.cache_salts(cache_salt, len(arrays))
    wholes, salts = [], []
    for i, raw in enumerate(arrays):
        a, salt = keyed(ctx, raw, given[i])  # (an SGLang model's page keys: kvdock.keying)
        salts.append(salt)
        try:
            wholes.append(whole_chunks(ctx, a))
        except InvalidInputError as e:
            err = InvalidInputError(f"prompt {i}: {e}")
            err.code = e.code
            raise err from None
    return wholes, salts, list(zip(arrays, given, strict=True))


def _groups(ctx: KVCacheContext, wholes: list[bytes], todo: list[int], reply_bytes: int = 0) -> list[list[int]]:
    """``todo`` (indexes into ``wholes``) cut into runs that each fit in one request (and, with
    ``reply_bytes``, whose replies carry at most that many bytes, counting whole chunks)."""
    cap = ctx.max_request_tokens
    per_token = ctx.geometry.chunk_nbytes(ctx.chunk_size) // ctx.chunk_size
    groups: list[list[int]] = []
    tokens = 0
    for i in todo:
        n = len(wholes[i]) // TOKEN_DTYPE.itemsize
        full = len(groups[-1]) >= MAX_BATCH if groups else True
        if full or (cap and tokens + n > cap) or (reply_bytes and (tokens + n) * per_token > reply_bytes):
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups


def lookup_many(ctx: KVCacheContext, prompts: Sequence[object], cache_salt: str | Sequence[str] = "") -> list[int]:
    """``[lookup(ctx, p, salt) for p in prompts]`` in one round trip: how many leading tokens of
    each prompt are cached (multiples of chunk_size). ``cache_salt``: one for all prompts, or a
    list with one per prompt. InvalidInputError names the first bad prompt."""
    ctx = checked(ctx)
    validate.whole_model_only(ctx, "a batch")
    wholes, salts, _ = _requests(ctx, prompts, cache_salt)
    hits = [0] * len(wholes)
    todo = []  # the prompts the pool directory cannot answer (sdk._fastpath), for the server
    for i, w in enumerate(wholes):
        hit = fastpath.lookup(ctx, w, salts[i]) if w else 0
        if hit is None:
            todo.append(i)
        else:
            hits[i] = hit
    for group in _groups(ctx, wholes, todo):
        msg = m.LookupMany(ctx.client_id, [wholes[i] for i in group], [salts[i] for i in group])
        reply = ctx.ask(msg)
        if len(reply.hit_tokens) != len(group):
            raise KVCacheSDKError(f"malformed reply: {len(reply.hit_tokens)} hits for {len(group)} prompts")
        for i, hit in zip(group, reply.hit_tokens, strict=True):
            hits[i] = int(hit)
    return hits


def retrieve_many(
    ctx: KVCacheContext,
    prompts: Sequence[object],
    cache_salt: str | Sequence[str] = "",
    *,
    layers: range | None = None,
    start: int = 0,
) -> list[torch.Tensor | None]:
    """``[retrieve(ctx, p, salt, layers=layers, start=start) for p in prompts]`` in one round
    trip: each prompt's longest cached prefix as a new tensor, or None. Prompts sharing a prefix
    share its chunks on the server (each gets its own copy). Raises what retrieve raises; a
    prompt whose copy outlived its lease is retrieved once more on its own."""
    ctx = checked(ctx)
    validate.whole_model_only(ctx, "a batch")
    wholes, salts, given = _requests(ctx, prompts, cache_salt)
    picked = validate.layers(ctx, layers)
    start = validate.start(ctx, start)
    results: list[torch.Tensor | None] = [None] * len(wholes)
    todo = []  # the prompts the pool directory cannot answer (sdk._fastpath), for the server
    for i, w in enumerate(wholes):
        if len(w) // TOKEN_DTYPE.itemsize <= start:
            continue
        landing = Landing(ctx, picked, start)
        hit = fastpath.retrieve(ctx, w, salts[i], landing.sink, landing.part)
        if hit is None:
            todo.append(i)
        else:
            results[i] = landing.result(hit)
    # inline replies carry the bytes: keep each one well under the server's cap per client
    reply_bytes = INLINE_BATCH_BYTES if ctx.transport == "inline" else 0
    for group in _groups(ctx, wholes, todo, reply_bytes):
        expired = _retrieve_group(ctx, group, wholes, salts, picked, start, results)
        for i in expired:
            tokens, salt = given[i]
            results[i] = retrieve(ctx, tokens, salt, layers=picked, start=start)
    return results


def _retrieve_group(
    ctx: KVCacheContext,
    group: list[int],
    wholes: list[bytes],
    salts: list[str],
    layers: range,
    start: int,
    results: list[torch.Tensor | None],
) -> list[int]:
    """One PrepareRetrieveMany / copies / CommitRetrieves for the prompts ``group``, filling
    ``results``; returns the prompts whose copy outlived its lease (their results are unset)."""
    sids = [ctx.new_session_id() for _ in group]
    part = Landing(ctx, layers, start).part
    first = part.first_chunk if part else 0
    toks, group_salts = [wholes[i] for i in group], [salts[i] for i in group]
    msg = m.PrepareRetrieveMany(ctx.client_id, sids, toks, group_salts, wait_s=ctx.timeout / 2, part=part)
    try:
        prepared, frames = ctx.ask_frames(msg)
    except ServerUnavailableError:  # the reply may never come: release whatever it opened
        for sid in sids:
            ctx.end_session(sid)
        raise
    cid = ctx._answered_client_id()
    rows: list[list[m.SlotRef]] = prepared.slots
    opened = [sid for sid, row in zip(sids, rows, strict=False) if row]
    expired: list[int] = []
    try:
        if len(rows) != len(group):
            raise KVCacheSDKError(f"malformed reply: {len(rows)} slot lists for {len(group)} prompts")
        with ctx.transfer() as t:
            for i, row in zip(group, rows, strict=True):
                if len(row) <= first:
                    continue  # a miss, or no hit past ``start``: None
                landing = Landing(ctx, layers, start)
                try:
                    t.read(row, frames, landing.sink(len(row) * ctx.chunk_size), part)
                except LeaseExpiredError:
                    expired.append(i)
                    continue
                results[i] = landing.result(len(row) * ctx.chunk_size)
            commits = t.commits_reads
    except BaseException:
        for sid in opened:
            ctx.end_session(sid, cid)
        raise
    if commits:
        for sid in opened:
            ctx.notify(m.CommitRetrieve(cid, sid))
    return expired

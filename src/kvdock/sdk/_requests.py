"""The plumbing of one request of the SDK's calls: the whole chunks it names, the ends of its
copy (shards, the landing of a read) and the prepare that opens its session."""

from __future__ import annotations

import contextlib
from typing import TypeVar

import numpy as np
import torch

from kvdock import keying, reach
from kvdock.errors import ServerUnavailableError
from kvdock.protocol import messages as m
from kvdock.sdk.buffers import buffer_pool
from kvdock.sdk.chunks import ChunkSink, ChunkSource, ShardedChunks, TensorChunks
from kvdock.sdk.context import KVCacheContext


def whole_chunks(ctx: KVCacheContext, arr: np.ndarray) -> bytes:
    """``arr``'s whole chunks as the wire's token bytes; LimitExceededError (an InvalidInputError,
    code ``limit``: what the server's own refusal raises) past the server's max_request_tokens."""
    return reach.whole_chunks(arr, ctx.chunk_size, ctx.max_request_tokens)


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


P = TypeVar("P", bound=m.ReplyBase)


def prepare(ctx: KVCacheContext, sid: str, msg: m.RequestBase[P]) -> tuple[P, list[memoryview]]:
    """A prepare (its reply and frames) whose reply may never come (timeout): then release
    whatever it may have opened."""
    try:
        return ctx.ask_frames(msg)
    except ServerUnavailableError:
        ctx.end_session(sid)
        raise


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

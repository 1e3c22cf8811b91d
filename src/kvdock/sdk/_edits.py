"""The SDK's side of edited prefixes (docs/architecture.md, "Edited prefixes"): when a plain store
of a user's tensor is refused past a stored prefix (``diverged``: edited stores extend only a
prefix they read back, `storage.plans.write_limit`), the store
reads that prefix back and, if the tensor's first tokens are byte-identical to it, stores again
over its tips (:func:`vouch`). A user who stored P stores P+Q of the same tensor and Q lands; a
tensor of other bytes for P writes nothing past P."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvdock.errors import LeaseExpiredError
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk._requests import shards_of
from kvdock.sdk.chunks import ChunkSink
from kvdock.sdk.context import KVCacheContext

# read(whole, make_sink, tips) -> hit tokens: a retrieve of exactly the versions ``tips`` or nothing
Read = Callable[[bytes, Callable[[int], ChunkSink], list[int]], int]


class Compare:
    """A sink that compares each chunk it is handed with the same chunk of ``kv`` (bytes, not
    values: NaNs and signed zeros too), keeping nothing. What it saw counts only once the
    transfer is over without LeaseExpiredError (a sink's contract: its bytes are verified then)."""

    def __init__(self, kv: torch.Tensor, chunk_size: int) -> None:
        self.kv, self.chunk_size = kv, chunk_size
        self.same = True
        self.taken = 0

    def take(self, index: int, src: torch.Tensor) -> None:
        c = self.chunk_size
        mine = self.kv[:, :, index * c : (index + 1) * c]
        self.taken += 1
        if self.same:
            self.same = mine.shape == src.shape and _same_bytes(mine, src)

    def finish(self) -> None:
        pass


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    except RuntimeError:  # (a view of another dtype needs a last axis of stride 1)
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def vouch(ctx: KVCacheContext, kv: torch.Tensor, whole: bytes, cache_salt: str, read: Read) -> list[int] | None:
    """The tips (one per shard ``ctx`` reads) of the stored prefix of ``whole`` (the store's key
    tokens, ``cache_salt`` as the server names them) when ``kv``'s first tokens are byte-identical
    to it, else None: nothing cached, other bytes, or the prefix changed between the lookup and
    the read (``read`` loads exactly the versions the lookup saw, or nothing). A store over these
    tips is refused by the server if the prefix changes after this read (an overwrite): a miss,
    never a mix."""
    seen = ctx.ask(m.Lookup(ctx.client_id, whole, cache_salt))
    hit, tips = int(seen.hit_tokens), [int(v) for v in seen.tips]
    if not hit or len(tips) != ctx.shards or hit > kv.shape[2]:
        return None
    sinks: list[Compare] = []

    def make_sink(n: int) -> ChunkSink:
        sinks.append(Compare(kv, ctx.chunk_size))
        return shards_of(ctx, sinks[-1])

    try:
        got = read(whole[: hit * TOKEN_DTYPE.itemsize], make_sink, tips)
    except LeaseExpiredError:
        return None  # (what the sink compared may have been garbage)
    if got != hit or not sinks or sinks[-1].taken != hit // ctx.chunk_size or not sinks[-1].same:
        return None
    return tips

"""One request over the shards it covers: the general case of the store and retrieve handlers.

Each rank of a tensor-parallel engine stores the KV heads it holds as the objects of its shard,
keyed ``(model, shard, salt, chunk)`` (:meth:`kvdock.layout.KVGeometry.shard_of`). A client's
request covers :func:`shards_of` it: its own shard (a per-rank client, or any client of a model
stored in one shard), or every shard of the model (a client registered with ``kv_rank =
ALL_RANKS`` of a model stored in several: :attr:`ClientEntry.sharded`). The handlers of
:mod:`.storing` and :mod:`.retrieval` run every request once per shard it covers, in one code
path; a model stored in one shard is the case of one shard.

The model's chunk ``i`` is cached when every shard holds it. Slots are listed chunk-major
(:class:`Interleave`: ``SlotRef.index = chunk * shards + shard``). Shard ``s``'s session of a
request with session id ``sid`` is ``sid`` for the first shard and ``sid`` + ``"/s"`` for the
others (:func:`session_ids`).

What keeps a reader from ever assembling two versions of a chunk (an overwrite replaces every
shard, and a reader must see all of them old or all new):

* a store prepares every shard in one step of the event loop and commits every shard in one step,
  after every shard's deletions of older versions are done (an overwrite refused for one shard,
  a lower tier that could not delete, is refused for all);
* an overwrite reserves nothing while another client writes any shard's chunks;
* a retrieve hands out the chunks whose objects every shard holds, each still current (not
  replaced since pinned) in the step that answers (:func:`retrieval.retrieve_later`, ``common``).

Ops that name one session per request and carry per-shard state the client would have to tell
apart (prefetch status, batches, inspection, view renewals) are refused for a request of several
shards (:func:`one_shard`): such clients connect per rank (``kv_rank=r``) for those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvdock.errors import RequestError, SessionError
from kvdock.keys import ObjectKey
from kvdock.protocol import messages as m
from kvdock.server.handlers import check_request, client_of, shard_keys
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, ServerState

T = TypeVar("T")


@dataclass(frozen=True)
class Interleave:
    """How the slots of one request over ``shards`` shards are numbered: chunk-major, slot
    ``chunk * shards + shard`` (of one shard: the chunk itself). The one place the server computes
    it; the SDK's ``ShardedChunks`` reads it back on the client side."""

    shards: int

    def index(self, chunk: int, shard: int) -> int:
        """The slot of ``shard``'s part of ``chunk``."""
        return chunk * self.shards + shard

    def split(self, index: int) -> tuple[int, int]:
        """``(chunk, shard)`` of slot ``index``."""
        return divmod(index, self.shards)

    def merge(self, per_shard: Sequence[Sequence[m.SlotRef]]) -> list[m.SlotRef]:
        """One request's slots, in slot order, from each shard's (numbered by chunk)."""
        if len(per_shard) == 1:
            return list(per_shard[0])
        slots = [
            m.SlotRef(self.index(ref.index, s), ref.offset, ref.gen)
            for s, refs in enumerate(per_shard)
            for ref in refs
        ]
        return sorted(slots, key=lambda ref: ref.index)

    def route(self, indexes: Sequence[int], items: Sequence[T]) -> list[list[T]]:
        """``items[k]`` (of slot ``indexes[k]``) by shard, in their order."""
        if self.shards == 1:  # (the common case: every slot is the shard's, numbered by chunk)
            if len(indexes) != len(items):
                raise ValueError(f"{len(indexes)} slot indexes for {len(items)} items")
            return [list(items)]
        out: list[list[T]] = [[] for _ in range(self.shards)]
        for index, item in zip(indexes, items, strict=True):
            out[self.split(index)[1]].append(item)
        return out

    def chunks(self, indexes: Sequence[int]) -> list[list[int]]:
        """Each shard's chunks of slots ``indexes``, in their order."""
        if self.shards == 1:
            return [list(indexes)]
        return self.route(indexes, [self.split(index)[0] for index in indexes])


def shards_of(client: ClientEntry) -> list[int]:
    """The shards each request of ``client`` covers, in slot order."""
    return list(range(client.model.geometry.shards)) if client.sharded else [client.shard]


def session_ids(session_id: str, shards: int) -> list[str]:
    """The sessions of one request's shards."""
    return [session_id] + [f"{session_id}/{s}" for s in range(1, shards)]


def request_keys(
    state: ServerState, client: ClientEntry, tokens: bytes, salt: str, session_id: str = ""
) -> list[list[ObjectKey]]:
    """The chunk keys of a request in each shard it covers (:func:`check_request` first); a
    request of several shards may not name a session id with ``/`` (it names the shards)."""
    check_request(state, tokens, salt)
    shards = shards_of(client)
    if len(shards) > 1 and "/" in session_id:
        raise RequestError(f"a whole-model client's session ids must not contain '/': {session_id[:64]!r}")
    return shard_keys(state, client, tokens, salt, shards)


def stage_part(client: ClientEntry, part: m.ReadPart | None) -> m.ReadPart | None:
    """``part`` (of the whole model's layers) as the part of each shard: the same layers, unless
    the model's pipeline stages split them, where only every layer (from a chunk on) is a part
    every shard has. A per-rank client's part is its own shard's already."""
    geo = client.model.geometry
    if part is None or not client.sharded or geo.pp_size == 1:
        return part
    if (part.layer_start, part.layer_stop, part.layer_step) != (0, geo.num_layers * geo.pp_size, 1):
        raise RequestError(refusal("a read of some layers of a model in pipeline stages"))
    return m.ReadPart(0, geo.num_layers, 1, part.first_chunk)


def check_free(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    """SessionError when one of a request's shard sessions is in use (a client reusing ids)."""
    taken = [sid for sid in sids if state.manager.sessions.in_use(client.client_id, sid)]
    if taken:
        raise SessionError(f"session {taken[0]!r} is already open")


def end_all(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    for sid in sids:
        state.manager.end_session(client.client_id, sid)


# --- refused for several shards ------------------------------------------------------------------


def refusal(what: str) -> str:
    return (
        f"{what} is not supported for a client of every rank of a model stored in several shards "
        "(tensor parallelism or pipeline stages); connect with kv_rank=r for per-shard access"
    )


class ClientRequest(Protocol):
    """A request that names a registered client."""

    @property
    def client_id(self) -> str: ...


C = TypeVar("C", bound=ClientRequest)


def one_shard(
    what: str, handler: Callable[[ServerState, C, Payload], Outcome]
) -> Callable[[ServerState, C, Payload], Outcome]:
    """``handler``, refused (after the client's lease is renewed) for a client whose requests
    cover several shards."""

    @functools.wraps(handler)
    def checked(state: ServerState, req: C, payload: Payload) -> Outcome:
        client = state.registry.clients.get(req.client_id)
        if client is not None and client.sharded:
            client_of(state, req.client_id)
            raise RequestError(refusal(what))
        return handler(state, req, payload)

    return checked

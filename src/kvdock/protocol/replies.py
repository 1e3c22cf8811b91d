"""The replies of the control plane: one type per op (several ops share ``Done`` and
``PrefetchStatus``), and ``Error`` for any of them. Field names are part of the wire contract."""

from __future__ import annotations

import msgspec

from kvdock.layout import KVGeometry
from kvdock.protocol._shared import ModelLayout, ReplyBase, SlotRef, Stored, Transport
from kvdock.protocol.codes import ErrorCode, parse_code

# --- replies ------------------------------------------------------------------------------------


class Error(ReplyBase, frozen=True):
    """A refused request, the reply to any op. ``code`` is an :class:`ErrorCode` value; it travels
    as a plain string so that a reply with a code this peer does not know (a newer peer's) still
    decodes (:attr:`error_code` is then None, and the SDK raises a generic ServerError naming it:
    :func:`kvdock.protocol.codes.sdk_error`)."""

    code: str
    message: str

    @property
    def error_code(self) -> ErrorCode | None:
        """``code`` as an ErrorCode; None for a code this side does not know."""
        return parse_code(self.code)


class Pong(ReplyBase, frozen=True):
    protocol_version: int
    server_version: str


class ModelRegistered(ReplyBase, frozen=True):
    created: bool
    slot_nbytes: int


class Described(ReplyBase, frozen=True):
    """``layout``: the model's (None when it is not registered, or not the caller's to use);
    ``models``: the registered models the caller may use; ``shm_name``: the shared-memory pool a
    client may map and prove in RegisterClient ("" when none is offered to this caller).
    ``pool_url`` and ``pool_ticket``: with tenants, the pool door (``unix://PATH``) and a
    single-use ticket there for the caller's tenant's own pool (a memfd, handed over as a
    descriptor: ``transport.door``) to the process Describe named, to map and prove in
    RegisterClient ("": none offered)."""

    chunk_size: int
    max_request_tokens: int
    session_ttl: float
    shm_name: str
    layout: ModelLayout | None
    models: list[str]
    pool_url: str = ""
    pool_ticket: str = ""


class ClientRegistered(ReplyBase, frozen=True):
    """``local_url`` (``unix://PATH``, shared-memory clients only, "" when not offered): the
    server's local control socket, where the same messages take a fraction of zmq's round trip."""

    client_id: str
    transport: Transport
    chunk_size: int
    slot_nbytes: int
    local_url: str = ""
    geometry: KVGeometry | None = None  # the model's, as the server stores it (its shards)


class LookupResult(ReplyBase, frozen=True):
    """``tips``: the version of the hit's last chunk in each shard the client reads (one entry
    for a single-shard client; none without a hit), for PrepareRetrieve.tips."""

    hit_tokens: int
    tips: list[int] = msgspec.field(default_factory=list)


class PrefetchStatus(ReplyBase, frozen=True):
    """``loaded_tokens`` of the prefix are pinned in L1 for the session; ``done`` once it stopped."""

    done: bool
    loaded_tokens: int


class StorePrepared(ReplyBase, frozen=True):
    """Slots to fill for chunks that are new (or all, when overwriting); ``deduped`` were already
    stored; ``in_flight`` are being written by another client now (not stored, not reserved);
    ``pool_full`` chunks found no room; ``diverged`` were not written because they would extend
    an edited prefix the client did not compute over (PrepareStore.over)."""

    slots: list[SlotRef]
    deduped: int
    pool_full: int
    in_flight: int = 0
    diverged: int = 0


class StoreCommitted(ReplyBase, frozen=True):
    committed: int


class RetrievePrepared(ReplyBase, frozen=True):
    """The leading ``len(slots)`` chunks are pinned (shared memory). Inline replies carry one
    frame holding the chunks (their ``part``, if one was asked for) in order, each slot's
    ``offset`` its chunk's offset in it; chunks before the part's ``first_chunk`` have no bytes,
    and a reply with no bytes at all has no frame."""

    slots: list[SlotRef]


class LookupManyResult(ReplyBase, frozen=True):
    hit_tokens: list[int]


class RetrieveManyPrepared(ReplyBase, frozen=True):
    """``slots[i]`` are prompt ``i``'s, as in RetrievePrepared. An inline reply carries one frame
    with every prompt's bytes (each slot's ``offset`` points into it), or none if it has none."""

    slots: list[list[SlotRef]]


class Located(ReplyBase, frozen=True):
    """``chunks[i]``: the objects stored under chunk ``i``'s key, L1 first. A tier without a local
    index (L3) is read for the leading chunks it holds only; ``unreachable`` tiers (down) were not
    asked at all."""

    chunks: list[list[Stored]]
    unreachable: list[str] = msgspec.field(default_factory=list)


class Done(ReplyBase, frozen=True):
    pass


class Renewed(ReplyBase, frozen=True):
    """The sessions of a RenewSessions that are no longer open (ended, or their lease ran out):
    their pins are gone. The others were renewed."""

    gone: list[str]


class IntegrityReport(ReplyBase, frozen=True):
    ok: bool
    problems: list[str]


Reply = (
    Error
    | Pong
    | ModelRegistered
    | ClientRegistered
    | Described
    | LookupResult
    | PrefetchStatus
    | StorePrepared
    | StoreCommitted
    | RetrievePrepared
    | LookupManyResult
    | RetrieveManyPrepared
    | Located
    | Done
    | Renewed
    | IntegrityReport
)

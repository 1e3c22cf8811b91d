"""One request and one reply type per op. Field names are part of the wire contract."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvdock.layout import KVGeometry

# 12: model fingerprints (ModelLayout.fingerprint); 11: tenants' own pools (Described.pool_*);
# 10: tenants (Describe, tokens); 9: pipeline stages; 8: tensor-parallel shards
PROTOCOL_VERSION = 12

Transport = Literal["shm", "inline"]


class _Msg(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    pass


# --- shared structs -----------------------------------------------------------------------------


class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who registered a layout and how it holds its KV (descriptive: no stored byte depends on it)."""

    name: str = "sdk"
    version: str = ""
    attention_backend: str = ""
    kv_cache_layout: str = "NHD"  # the engine's own axis order name, e.g. "NHD", "HND"
    view_shape: list[int] = []  # one layer's KV tensor as the engine holds it
    view_strides: list[int] = []
    pp_rank: int = 0
    pp_size: int = 1


class ModelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an engine (or the SDK) registers for a model, and what /status shows of it under
    ``cache_context_meta[i]["layout"]``. Only ``geometry`` decides what a stored chunk holds.

    ``fingerprint`` names the model whose KV it is beyond its shapes (its config and weights:
    engines compute it, :mod:`kvdock.integrations.fingerprint`); "" asserts nothing and matches any.
    The first non-empty fingerprint registered under a name sticks, and a registration with another
    is refused (the server's registry, and fleet-wide through L3). It is not part of where objects
    are stored: a model registered first without one keeps its KV when one is added."""

    model_name: str
    geometry: KVGeometry
    tokens_per_block: int
    engine: EngineInfo = EngineInfo()
    fingerprint: str = ""


class SlotRef(msgspec.Struct, frozen=True, array_like=True):
    """Chunk ``index`` of a request lives at byte ``offset`` of the L1 pool; ``gen`` is the slot's
    generation when it was handed out (a reader checks it is unchanged after copying)."""

    index: int
    offset: int
    gen: int = 0


class ReadPart(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The part of each chunk a retrieve wants: layers ``range(layer_start, layer_stop,
    layer_step)`` of the chunks from ``first_chunk`` on. An inline reply carries only those bytes
    (per chunk, the chosen layers of each plane in order); shared-memory clients copy their part
    out of the slots themselves."""

    layer_start: int
    layer_stop: int
    layer_step: int = 1
    first_chunk: int = 0


# --- requests -----------------------------------------------------------------------------------


class Ping(_Msg, frozen=True):
    pass


class RegisterModel(_Msg, frozen=True):
    """Needs the admin token when the server has one, or (with tenants) a tenant that may use the
    model: proven by the CURVE key the request came with, or by ``token``."""

    protocol_version: int
    layout: ModelLayout
    admin_token: str = ""  # required (the server's --admin-token) when the server has one
    token: str = ""  # a tenant's token


class Describe(_Msg, frozen=True):
    """What a client needs before it registers: the server's settings and ``model_name``'s layout,
    as the caller may see them (with tenants: only its tenant's models; ``token``: a tenant's token
    when the CURVE key does not say). ``pid`` and ``pid_start`` (as in RegisterClient) name the
    process that will map a tenant's pool: its ticket is that process's only."""

    protocol_version: int
    model_name: str = ""
    token: str = ""
    pid: int = 0
    pid_start: int = 0


class RegisterClient(_Msg, frozen=True):
    """Bind a client to one model and rank (-1: every rank, the whole model's KV: for a model stored
    in several shards each request is then run once per shard, see ``server.shards``);
    ``shm_proof`` is the pool nonce if the client mapped it.
    ``pid`` and ``pid_start`` (its start time in clock ticks, from /proc) name the client process:
    shared memory is granted only when the server sees that very process, so that it can tell
    when a paused writer is gone."""

    protocol_version: int
    instance_id: str
    model_name: str
    kv_rank: int = 0
    shm_proof: str = ""
    pid: int = 0
    pid_start: int = 0
    token: str = ""  # a tenant's token (with tenants, when the CURVE key does not name the tenant)


class Lookup(_Msg, frozen=True):
    """Count the cached prefix in every tier. With ``prefetch``, also open retrieve session
    ``session_id``: pin what L1 holds and start loading the rest from L2/L3 into L1."""

    client_id: str
    tokens: bytes  # uint32 little-endian
    cache_salt: str = ""
    prefetch: bool = False
    session_id: str = ""


class QueryPrefetchStatus(_Msg, frozen=True):
    """Idempotent: how far a session's prefetch got, without waiting."""

    client_id: str
    session_id: str


class WaitPrefetch(_Msg, frozen=True):
    """Like QueryPrefetchStatus, but answers when the prefetch is done or ``timeout_s`` passed."""

    client_id: str
    session_id: str
    timeout_s: float


class PrepareStore(_Msg, frozen=True):
    client_id: str
    session_id: str
    tokens: bytes
    cache_salt: str = ""
    overwrite: bool = False


class CommitStore(_Msg, frozen=True):
    """Makes the listed chunks visible; inline clients send one frame per chunk, in order."""

    client_id: str
    session_id: str
    chunks: list[int]


class PrepareRetrieve(_Msg, frozen=True):
    """Pin the cached prefix and hand out its slots. Chunks only in L2/L3 are loaded into L1
    first, waiting at most ``wait_s`` (a session opened by a prefetching Lookup is reused)."""

    client_id: str
    session_id: str
    tokens: bytes
    cache_salt: str = ""
    wait_s: float = 30.0
    part: ReadPart | None = None  # None: whole chunks
    # the versions a lookup saw (LookupResult.tips): hand out every chunk of ``tokens`` if the last
    # one is this version in each shard the client reads (then so is every chunk before it: versions
    # chain), or nothing. Ranks of a tensor-parallel engine load what one lookup saw, never each
    # another version.
    tips: list[int] | None = None


class CommitRetrieve(_Msg, frozen=True):
    client_id: str
    session_id: str


class FastReads(_Msg, frozen=True):
    """Sent without waiting for a reply after lookups and retrieves that a shared-memory client
    answered from the pool directory, without a session (``kvdock.sdk.fastpath``; one message
    reports the reads of up to a few milliseconds). The server counts them as it would count
    the ops, renews the client's lease, and makes the objects the retrieves copied most recently
    used. ``asked`` and ``hit`` are whole chunks over all the reads; the retrieves list the
    (``entries``, ``offsets``, ``gens``) they found each copied chunk at, and ``nbytes`` copied."""

    client_id: str
    lookups: int
    retrieves: int
    asked: int
    hit: int
    entries: list[int] = []
    offsets: list[int] = []
    gens: list[int] = []
    nbytes: int = 0


# Requests the server never answers, not even with an error: their senders do not wait, and
# replies nobody reads would pile up in a client that sends nothing else.
UNANSWERED = (FastReads,)


class LookupMany(_Msg, frozen=True):
    """Lookups of several prompts in one message: prompt ``i`` is ``tokens[i]`` under
    ``cache_salts[i]`` (the lists have the same length, at most MAX_BATCH; the token counts add up
    to at most max_request_tokens)."""

    client_id: str
    tokens: list[bytes]
    cache_salts: list[str]


class PrepareRetrieveMany(_Msg, frozen=True):
    """PrepareRetrieve for several prompts in one message (the limits of LookupMany): prompt
    ``i`` opens session ``session_ids[i]``, released by its own CommitRetrieve (shared memory)."""

    client_id: str
    session_ids: list[str]
    tokens: list[bytes]
    cache_salts: list[str]
    wait_s: float = 30.0
    part: ReadPart | None = None  # the same part of every prompt


class Locate(_Msg, frozen=True):
    """Where each whole chunk of ``tokens`` is stored, tier by tier (for inspection; moves no data)."""

    client_id: str
    tokens: bytes
    cache_salt: str = ""


class EndSession(_Msg, frozen=True):
    client_id: str
    session_id: str


MAX_RENEW = 4096  # sessions per RenewSessions


class RenewSessions(_Msg, frozen=True):
    """Renew the leases of open sessions (zero-copy views keep their pins while they are open),
    at most MAX_RENEW. Answered Renewed."""

    client_id: str
    session_ids: list[str]


class CheckIntegrity(_Msg, frozen=True):
    """Run the server's check_integrity(); with tenants it needs the admin token (it walks every
    object on the event loop, and its findings may name anyone's keys)."""

    admin_token: str = ""


class CloseClient(_Msg, frozen=True):
    """The client is going away: end its sessions and forget it. ``idle``: no copy of the client
    into slots is in progress, so its reservations can be freed rather than quarantined."""

    client_id: str
    idle: bool = False


Request = (
    Ping
    | RegisterModel
    | RegisterClient
    | Describe
    | Lookup
    | QueryPrefetchStatus
    | WaitPrefetch
    | PrepareStore
    | CommitStore
    | PrepareRetrieve
    | CommitRetrieve
    | FastReads
    | LookupMany
    | PrepareRetrieveMany
    | Locate
    | EndSession
    | RenewSessions
    | CheckIntegrity
    | CloseClient
)

# --- replies ------------------------------------------------------------------------------------


class Error(_Msg, frozen=True):
    code: str
    message: str


class Pong(_Msg, frozen=True):
    protocol_version: int
    server_version: str


class ModelRegistered(_Msg, frozen=True):
    created: bool
    slot_nbytes: int


class Described(_Msg, frozen=True):
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


class ClientRegistered(_Msg, frozen=True):
    """``local_url`` (``unix://PATH``, shared-memory clients only, "" when not offered): the
    server's local control socket, where the same messages take a fraction of zmq's round trip."""

    client_id: str
    transport: Transport
    chunk_size: int
    slot_nbytes: int
    local_url: str = ""
    geometry: KVGeometry | None = None  # the model's, as the server stores it (its shards)


class LookupResult(_Msg, frozen=True):
    """``tips``: the version of the hit's last chunk in each shard the client reads (one entry
    for a single-shard client; none without a hit), for PrepareRetrieve.tips."""

    hit_tokens: int
    tips: list[int] = []


class PrefetchStatus(_Msg, frozen=True):
    """``loaded_tokens`` of the prefix are pinned in L1 for the session; ``done`` once it stopped."""

    done: bool
    loaded_tokens: int


class StorePrepared(_Msg, frozen=True):
    """Slots to fill for chunks that are new (or all, when overwriting); ``deduped`` were already
    stored; ``in_flight`` are being written by another client now (not stored, not reserved);
    ``pool_full`` chunks found no room."""

    slots: list[SlotRef]
    deduped: int
    pool_full: int
    in_flight: int = 0


class StoreCommitted(_Msg, frozen=True):
    committed: int


class RetrievePrepared(_Msg, frozen=True):
    """The leading ``len(slots)`` chunks are pinned (shared memory). Inline replies carry one
    frame holding the chunks (their ``part``, if one was asked for) in order, each slot's
    ``offset`` its chunk's offset in it; chunks before the part's ``first_chunk`` have no bytes,
    and a reply with no bytes at all has no frame."""

    slots: list[SlotRef]


class LookupManyResult(_Msg, frozen=True):
    hit_tokens: list[int]


class RetrieveManyPrepared(_Msg, frozen=True):
    """``slots[i]`` are prompt ``i``'s, as in RetrievePrepared. An inline reply carries one frame
    with every prompt's bytes (each slot's ``offset`` points into it), or none if it has none."""

    slots: list[list[SlotRef]]


class Stored(msgspec.Struct, frozen=True, array_like=True):
    """One tier's object under a chunk's key: its version and its predecessor's (0: the first chunk)."""

    tier: str
    version: int
    parent: int


class Located(_Msg, frozen=True):
    """``chunks[i]``: the objects stored under chunk ``i``'s key, L1 first. A tier without a local
    index (L3) is read for the leading chunks it holds only; ``unreachable`` tiers (down) were not
    asked at all."""

    chunks: list[list[Stored]]
    unreachable: list[str] = []


class Done(_Msg, frozen=True):
    pass


class Renewed(_Msg, frozen=True):
    """The sessions of a RenewSessions that are no longer open (ended, or their lease ran out):
    their pins are gone. The others were renewed."""

    gone: list[str]


class IntegrityReport(_Msg, frozen=True):
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

__all__ = [
    "MAX_RENEW",
    "PROTOCOL_VERSION",
    "Transport",
    "EngineInfo",
    "ModelLayout",
    "SlotRef",
    "ReadPart",
    "Ping",
    "RegisterModel",
    "RegisterClient",
    "Lookup",
    "QueryPrefetchStatus",
    "WaitPrefetch",
    "PrepareStore",
    "CommitStore",
    "PrepareRetrieve",
    "CommitRetrieve",
    "LookupMany",
    "PrepareRetrieveMany",
    "Locate",
    "EndSession",
    "CheckIntegrity",
    "CloseClient",
    "Request",
    "Error",
    "Pong",
    "ModelRegistered",
    "ClientRegistered",
    "Describe",
    "Described",
    "LookupResult",
    "PrefetchStatus",
    "StorePrepared",
    "StoreCommitted",
    "RetrievePrepared",
    "LookupManyResult",
    "RetrieveManyPrepared",
    "Stored",
    "Located",
    "Done",
    "IntegrityReport",
    "Reply",
]

"""The requests of the control plane: one per op, each a ``RequestBase[its reply type]``. Field
names are part of the wire contract."""

from __future__ import annotations

import msgspec

from kvdock.protocol._shared import ModelLayout, ReadPart, RequestBase
from kvdock.protocol.replies import (
    ClientRegistered,
    Described,
    Done,
    IntegrityReport,
    Located,
    LookupManyResult,
    LookupResult,
    ModelRegistered,
    Pong,
    PrefetchStatus,
    Renewed,
    RetrieveManyPrepared,
    RetrievePrepared,
    StoreCommitted,
    StorePrepared,
)

# --- requests -----------------------------------------------------------------------------------


class Ping(RequestBase[Pong], frozen=True):
    pass


class RegisterModel(RequestBase[ModelRegistered], frozen=True):
    """Needs the admin token when the server has one, or (with tenants) a tenant that may use the
    model: proven by the CURVE key the request came with, or by ``token``."""

    protocol_version: int
    layout: ModelLayout
    admin_token: str = ""  # required (the server's --admin-token) when the server has one
    token: str = ""  # a tenant's token


class Describe(RequestBase[Described], frozen=True):
    """What a client needs before it registers: the server's settings and ``model_name``'s layout,
    as the caller may see them (with tenants: only its tenant's models; ``token``: a tenant's token
    when the CURVE key does not say). ``pid`` and ``pid_start`` (as in RegisterClient) name the
    process that will map a tenant's pool: its ticket is that process's only."""

    protocol_version: int
    model_name: str = ""
    token: str = ""
    pid: int = 0
    pid_start: int = 0


class RegisterClient(RequestBase[ClientRegistered], frozen=True):
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


class Lookup(RequestBase[LookupResult], frozen=True):
    """Count the cached prefix in every tier. With ``prefetch``, also open retrieve session
    ``session_id``: pin what L1 holds and start loading the rest from L2/L3 into L1."""

    client_id: str
    tokens: bytes  # uint32 little-endian
    cache_salt: str = ""
    prefetch: bool = False
    session_id: str = ""


class QueryPrefetchStatus(RequestBase[PrefetchStatus], frozen=True):
    """Idempotent: how far a session's prefetch got, without waiting."""

    client_id: str
    session_id: str


class WaitPrefetch(RequestBase[PrefetchStatus], frozen=True):
    """Like QueryPrefetchStatus, but answers when the prefetch is done or ``timeout_s`` passed."""

    client_id: str
    session_id: str
    timeout_s: float


class PrepareStore(RequestBase[StorePrepared], frozen=True):
    client_id: str
    session_id: str
    tokens: bytes
    cache_salt: str = ""
    overwrite: bool = False
    # per shard the request covers (like PrepareRetrieve.tips): the version of the last chunk of
    # the prefix the client loaded from kvdock and computed the KV it stores over. A plain store
    # whose already-stored leading run holds an edit (an overwrite's version) writes nothing past
    # that run unless this names the run's tip (StorePrepared.diverged counts what it left).
    over: list[int] | None = None
    # the KV is not what the model computes for these tokens (a user's: the SDK's store, a bundle
    # import): a plain store's new versions then carry the EDITED bit, as an overwrite's do, so
    # that KV computed over other bytes never extends them (above). Engines' saves say False.
    edited: bool = False


class CommitStore(RequestBase[StoreCommitted], frozen=True):
    """Makes the listed chunks visible; inline clients send one frame per chunk, in order."""

    client_id: str
    session_id: str
    chunks: list[int]


class PrepareRetrieve(RequestBase[RetrievePrepared], frozen=True):
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


class CommitRetrieve(RequestBase[Done], frozen=True):
    client_id: str
    session_id: str


class FastReads(RequestBase[Done], frozen=True):
    """Sent without waiting for a reply after lookups and retrieves that a shared-memory client
    answered from the pool directory, without a session (``kvdock.sdk._fastpath``; one message
    reports the reads of up to a few milliseconds). The server counts them as it would count
    the ops, renews the client's lease, and makes the objects the retrieves copied most recently
    used. ``asked`` and ``hit`` are whole chunks over all the reads; the retrieves list the
    (``entries``, ``offsets``, ``gens``) they found each copied chunk at, and ``nbytes`` copied."""

    client_id: str
    lookups: int
    retrieves: int
    asked: int
    hit: int
    entries: list[int] = msgspec.field(default_factory=list)
    offsets: list[int] = msgspec.field(default_factory=list)
    gens: list[int] = msgspec.field(default_factory=list)
    nbytes: int = 0


# Requests the server never answers, not even with an error: their senders do not wait, and
# replies nobody reads would pile up in a client that sends nothing else.
UNANSWERED = (FastReads,)


class LookupMany(RequestBase[LookupManyResult], frozen=True):
    """Lookups of several prompts in one message: prompt ``i`` is ``tokens[i]`` under
    ``cache_salts[i]`` (the lists have the same length, at most MAX_BATCH; the token counts add up
    to at most max_request_tokens)."""

    client_id: str
    tokens: list[bytes]
    cache_salts: list[str]


class PrepareRetrieveMany(RequestBase[RetrieveManyPrepared], frozen=True):
    """PrepareRetrieve for several prompts in one message (the limits of LookupMany): prompt
    ``i`` opens session ``session_ids[i]``, released by its own CommitRetrieve (shared memory)."""

    client_id: str
    session_ids: list[str]
    tokens: list[bytes]
    cache_salts: list[str]
    wait_s: float = 30.0
    part: ReadPart | None = None  # the same part of every prompt


class Locate(RequestBase[Located], frozen=True):
    """Where each whole chunk of ``tokens`` is stored, tier by tier (for inspection; moves no data)."""

    client_id: str
    tokens: bytes
    cache_salt: str = ""


class EndSession(RequestBase[Done], frozen=True):
    client_id: str
    session_id: str


class RenewSessions(RequestBase[Renewed], frozen=True):
    """Renew the leases of open sessions (zero-copy views keep their pins while they are open),
    at most MAX_RENEW. Answered Renewed."""

    client_id: str
    session_ids: list[str]


class CheckIntegrity(RequestBase[IntegrityReport], frozen=True):
    """Run the server's check_integrity(); with tenants it needs the admin token (it walks every
    object on the event loop, and its findings may name anyone's keys)."""

    admin_token: str = ""


class CloseClient(RequestBase[Done], frozen=True):
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

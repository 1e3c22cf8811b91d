"""What the scheduler side tells the worker side each step (vLLM ships it between processes).

Block ids are those of the request's KV cache group (its main group, :mod:`.groups`, when vLLM's
hybrid manager made several), in token order: block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)``. With several groups ``groups`` has every group's ids
(the same length; vLLM's null block, id 0, where a sliding-window group keeps no block). Token
ranges are whole blocks; ``end`` is a whole number of kvdock chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` (the request's first ``end`` token ids) from
    kvdock into the request's blocks. ``start`` is where vLLM's own prefix hit ends."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    cache_salt: str
    # the versions the scheduler's lookup saw at token ``end`` (one per stored shard: kvd.Tips):
    # every rank loads exactly those, or nothing; empty when the lookup saw no hit at ``end``
    tips: tuple[int, ...] = ()
    # loaded in the background while vLLM holds the request back (``load_kv_async``): reported
    # through ``get_finished``, its failed blocks no later than that; else before this step's forward
    is_async: bool = False
    # every KV cache group's block ids (empty: one group, ``block_ids``)
    groups: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Store the KV of ``tokens`` (whole chunks, computed by the end of this step) from the
    request's blocks; chunks kvdock already holds are deduplicated by the server, not stored again,
    and those before ``first`` are not even copied out of the pages."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    cache_salt: str
    # the tips of the prefix the request loaded from kvdock (the lookup's, one per stored shard),
    # when all of its KV before the save's new chunks was computed over exactly that load (kvdock
    # sent blocks ``[0, hit)`` in full); None otherwise (nothing loaded, a load that failed
    # partly, vLLM's own prefix hit supplied blocks). The store passes it as ``over``: KV computed
    # over an edited prefix (an SDK overwrite) may extend it only with these (mixed_spec)
    over: tuple[int, ...] | None = None
    # tokens ``[0, first)`` are believed held by kvdock already (the request's earlier saves or its
    # load): only blocks from ``first`` on are copied out of vLLM's pages. The store still names
    # the whole prefix; if kvdock lacks a chunk before ``first`` it writes nothing (never an orphan
    # chunk) and the worker's next save of the request copies from that chunk on (Transfers)
    first: int = 0
    # every KV cache group's block ids (empty: one group, ``block_ids``)
    groups: tuple[list[int], ...] = ()
    # the first token from which every group's blocks are real (a sliding-window group's blocks
    # before it are freed or were never filled): nothing before it is copied (:mod:`.groups`)
    real_from: int = 0


@dataclass
class KvdockMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests vLLM preempted in this step (their blocks are free again: a save still reading them
    # must be finished or dropped before the forward pass, ``handle_preemptions``)
    preempted: set[str] = field(default_factory=set)
    # finished requests whose blocks vLLM keeps until the worker reports them finished sending
    # (``request_finished`` returned True: a save was planned for them)
    delayed: set[str] = field(default_factory=set)

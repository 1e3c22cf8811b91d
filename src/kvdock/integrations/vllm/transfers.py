"""The worker's transfers, off vLLM's model-runner thread: a step never waits for kvdock.

Two background threads, so that a slow or stopped server can never hold vLLM's pages:

* the **copier** copies the KV of each planned save out of vLLM's pages into a host staging
  tensor (on a GPU: device -> pinned host on a side stream, waited on here). Until a save's copy is
  done its request's blocks are *being read*: vLLM keeps a finished request's blocks while
  :meth:`Transfers.delay` has them (``request_finished`` returned True) and frees them once
  :meth:`Transfers.finished` reports the request finished sending; a preempted request's blocks
  are free at once, so :meth:`Transfers.preempt` (``handle_preemptions``, before the forward pass
  that may overwrite them) waits for its copies in flight and drops those not started.
* the **network** thread owns the kvdock link: it stores staged saves, and runs loads -- those
  vLLM waits for (:meth:`Transfers.load_now`, before the forward pass) ahead of everything, then
  background loads (``load_kv_async``: reported by :meth:`finished` as finished receiving, with
  their failed blocks in the same report, never later).

Staging is bounded (``kvdock.save_buffer_mb``): a save that does not fit is dropped and counted
(a later miss), never queued without bound and never waited for. KV computed over a failed load is
not the copier's business: the worker never submits it.

Only new chunks are copied: a save names the request's whole prefix, but the copier copies only
its blocks from ``SaveSpec.first`` (what the request's earlier saves or its load put in kvdock),
lowered to what this worker actually staged of the request (``_covered``: a save dropped, cut,
cancelled or that failed to copy leaves a gap, and the next save copies from there). The store
still names the whole prefix, so the server allocates slots for every chunk it lacks; if one lies
before the staged bytes (evicted meanwhile, an earlier store failed), the store writes nothing
(:class:`~kvdock.errors.PrefixMissingError`: never an orphan chunk, never other bytes) and the
request's next save copies from that chunk on. Under chunked prefill each chunk is copied once.

Threads: :meth:`save`, :meth:`load`, :meth:`load_now`, :meth:`delay`, :meth:`preempt`,
:meth:`finished` and :meth:`take_stats` are called by the model-runner thread; ``Transfers``'
own threads do the rest; every shared field is guarded by one condition variable.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvdock.errors import PrefixMissingError
from kvdock.integrations.vllm._jobs import STAT_KEYS, Worker, _Load, _Save
from kvdock.integrations.vllm.groups import NULL_BLOCK
from kvdock.integrations.vllm.plan import LoadSpec, SaveSpec

log = logging.getLogger("kvdock.vllm")


class Transfers:
    def __init__(self, worker: Worker, budget_bytes: int, bytes_per_token: int) -> None:
        self.w = worker
        self.budget = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._cv = threading.Condition()
        self._reading: dict[str, int] = {}  # request -> its saves not copied out yet
        self._cancelled: set[str] = set()  # preempted while being read: their copies are dropped
        self._delayed: set[str] = set()  # finished; vLLM keeps their blocks until reported
        self._sent: set[str] = set()  # to report as finished sending
        self._recved: set[str] = set()  # background loads over, to report as finished receiving
        self._errors: set[int] = set()  # failed blocks of loads, to report
        self._failed: set[str] = set()  # background loads that failed, with KV cache groups
        self._staged = 0  # bytes of staging reserved
        self._busy = 0  # jobs queued or running
        self._bg_loads = 0  # background loads queued or running
        self._stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0.0)
        # live request -> the end of its tokens whose KV this worker staged for kvdock (or the
        # scheduler's word for it, until a gap is known): the next save copies from at most there
        self._covered: dict[str, int] = {}
        self.copied_bytes = 0  # bytes copied out of vLLM's pages since start (tests, benchmarks)
        self.copies = 0  # copy-outs done since start
        self._copy_q: queue.Queue[_Save | None] = queue.Queue()
        self._net_q: queue.PriorityQueue[tuple[int, int, _Save | _Load | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._copy_q.get, self._copy), name="kvdock-copy", daemon=True),
            threading.Thread(target=self._loop, args=(self._net_get, self._net), name="kvdock-net", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- model-runner thread ----------------------------------------------------------------------

    def save(self, spec: SaveSpec) -> bool:
        """Queue ``spec``'s copy-out (its blocks from ``first`` on, see the module) and store;
        False (dropped and counted) when staging is full. A save larger than the staging left is
        cut to its first whole blocks that fit (counted as dropped too; the request's next save
        copies from the cut on), so a prompt whose KV is larger than ``kvdock.save_buffer_mb``
        (2048 tokens of an 8B model by default) is still saved, its head at least."""
        rid = spec.req_id
        bs = len(spec.tokens) // len(spec.block_ids) if spec.block_ids else 0
        with self._cv:
            first = min(spec.first, self._covered.get(rid, spec.first), len(spec.tokens))
            first = max(first, spec.real_from)  # (blocks a sliding window gave back are never copied)
            first = first // bs * bs if bs else 0  # (whole blocks: the copy is of blocks)
            if first >= len(spec.tokens):
                if spec.real_from >= len(spec.tokens):
                    self._stats["saves_dropped"] += 1  # its window's blocks are gone: a miss later
                    return False
                return True  # nothing new (the scheduler plans only new chunks: not reached)
            spec = replace(spec, first=first)
            nbytes = (len(spec.tokens) - first) * self.bytes_per_token
            room = self.budget - self._staged
            if nbytes > room:
                self._stats["saves_dropped"] += 1
                keep = room // (bs * self.bytes_per_token) if bs and self.bytes_per_token else 0
                if not keep:
                    log.info("kvdock: staging full (%d bytes); the save of %s is dropped", self._staged, rid)
                    self._covered[rid] = first
                    return False
                n, end = len(spec.block_ids), first + keep * bs
                log.info("kvdock: staging has room for %d of the %d new blocks of %s's save: cut", keep, n, rid)
                spec = replace(spec, tokens=spec.tokens[:end], block_ids=spec.block_ids[: end // bs])
                nbytes = (end - first) * self.bytes_per_token
            self._covered[rid] = len(spec.tokens)
            self._staged += nbytes
            self._busy += 1
            self._reading[spec.req_id] = self._reading.get(spec.req_id, 0) + 1
        pre, ready = None, None
        try:  # (several groups) the sliding-window layers now: their blocks may be another's next step
            if spec.groups:  # (on a GPU only enqueued: the copier waits for ``ready``, see .hybrid)
                hybrid = self.w.hybrid
                assert hybrid is not None, "a save of several KV cache groups without them"
                pre, ready = hybrid.presave(spec)
        except Exception:
            log.exception("kvdock: copying the KV of %s out of vLLM's pages failed", rid)
            with self._cv:
                self._reading[rid] -= 1
                if not self._reading[rid]:
                    del self._reading[rid]
                self._gap(rid, first)
            self._done(nbytes)  # (notifies)
            return False
        self._copy_q.put(_Save(spec, nbytes, self.w.mark(), pre, ready))
        return True

    def load(self, spec: LoadSpec) -> None:
        """Load ``spec`` in the background; :meth:`finished` reports it."""
        with self._cv:
            self._busy += 1
            self._bg_loads += 1
        self._net_q.put((0, next(self._seq), _Load(spec)))

    def wait_loaded(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until a background load is over, or a finished request's
        copies are (its blocks come back), if one is in flight: in a step without a forward pass
        waiting holds nothing up, and it saves vLLM steps of spinning -- before the loaded request
        can run, or while a request waits for blocks that delayed frees hold (vLLM then neither
        preempts nor schedules it, and steps empty until they are reported)."""
        with self._cv:
            self._cv.wait_for(lambda: self._recved or self._sent or not (self._bg_loads or self._delayed), timeout)

    def load_now(self, specs: list[LoadSpec]) -> list[set[int]]:
        """Load ``specs`` ahead of any other network work and wait for them (each kvdock call is
        bounded by ``kvdock.timeout``); each one's planned blocks it did not fill."""
        jobs = [_Load(s, threading.Event()) for s in specs]
        with self._cv:
            self._busy += len(jobs)
        for job in jobs:
            self._net_q.put((-1, next(self._seq), job))
        for job in jobs:
            assert job.done is not None
            job.done.wait()
        return [job.failed for job in jobs]

    def forget(self, req_ids: set[str]) -> None:
        """These requests finished: nothing more is saved of them."""
        with self._cv:
            for rid in req_ids:
                self._covered.pop(rid, None)

    def delay(self, req_ids: set[str]) -> None:
        """vLLM keeps these finished requests' blocks until :meth:`finished` reports them."""
        with self._cv:
            for rid in req_ids:
                (self._delayed if self._reading.get(rid) else self._sent).add(rid)

    def preempt(self, req_ids: set[str], timeout: float = 30.0) -> None:
        """These requests' blocks are free again: drop their copies not started, wait for those
        in flight (a memory copy, never the network)."""
        with self._cv:
            for rid in req_ids:  # a copy dropped leaves a gap; after resuming, save from the start
                if rid in self._covered:
                    self._covered[rid] = 0
            hit = {r for r in req_ids if self._reading.get(r)}
            if not hit:
                return
            self._cancelled |= hit
            if not self._cv.wait_for(lambda: not any(self._reading.get(r) for r in hit), timeout):
                log.error("kvdock: copies of preempted %s still running after %.0fs", sorted(hit), timeout)

    def finished(self) -> tuple[set[str], set[str], set[int]]:
        """(finished sending, finished receiving, failed blocks): each reported once; a background
        load's failed blocks are reported no later than the load itself."""
        with self._cv:
            sent, recved, errors = self._sent, self._recved, self._errors
            self._sent, self._recved, self._errors = set(), set(), set()
        return sent, recved, errors

    def take_failed(self) -> set[str]:
        """Background loads that failed with KV cache groups (several, or a sliding window): reported per
        request, vLLM recomputes them from the start."""
        with self._cv:
            failed, self._failed = self._failed, set()
        return failed

    def take_stats(self) -> dict[str, float]:
        with self._cv:
            stats, self._stats = self._stats, dict.fromkeys(STAT_KEYS, 0.0)
        return stats

    def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until nothing reads or writes vLLM's pages: no copy-out in
        flight or queued, no background load (stores read only staging). Before vLLM releases
        its KV caches (``unregister_kv_caches``, sleep mode)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._reading and not self._bg_loads, timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued transfer is over (tests, benchmarks, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._busy, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the threads once the work queued so far is done, waiting at most ``timeout``: the
        copier first (no copy reads vLLM's pages after this returns, which vLLM releases next), then
        the network thread (the worker closes its link next, which must not happen under a store;
        a stopped server costs one ``kvdock.timeout``, then the link is down and the rest is
        quick). Threads still running at the deadline are daemons, left behind with a warning."""
        deadline = time.monotonic() + timeout
        copier, net = self._threads
        self._copy_q.put(None)
        copier.join(max(0.0, deadline - time.monotonic()))
        self._net_q.put((2, next(self._seq), None))  # after every save the copier has handed on
        net.join(max(0.0, deadline - time.monotonic()))
        if copier.is_alive() or net.is_alive():
            log.warning("kvdock: transfers still running %.0fs after shutdown began; left behind", timeout)

    # -- background threads -----------------------------------------------------------------------

    def _net_get(self) -> _Save | _Load | None:
        return self._net_q.get()[2]

    def _loop(self, get: Callable[[], Any], run: Callable[[Any], None]) -> None:
        while (job := get()) is not None:
            try:
                run(job)
            except Exception:  # a bug here must never stop the thread (vLLM would wait forever)
                log.exception("kvdock transfer failed")

    def _copy(self, job: _Save) -> None:
        rid = job.spec.req_id
        with self._cv:
            skip = rid in self._cancelled
        start = time.perf_counter()
        staged = None
        first_block = job.spec.first * len(job.spec.block_ids) // len(job.spec.tokens)
        try:
            if job.ready is not None:  # (several groups, GPU) the window layers' download, enqueued in the step
                job.ready.synchronize()
            if skip:
                pass
            elif job.staged is not None:  # (several groups: the sliding-window layers are in it)
                assert self.w.hybrid is not None
                staged = self.w.hybrid.copy_rest(job.spec, first_block, job.mark, job.staged)
            else:
                staged = self.w.copy_out(job.spec.block_ids[first_block:], job.mark)
        except Exception:
            log.exception("kvdock: copying the KV of %s out of vLLM's pages failed", rid)
        with self._cv:
            if rid in self._cancelled:  # preempted meanwhile: what was read may be another's KV
                staged = None
            if staged is None:
                self._gap(rid, job.spec.first)
            else:
                self.copied_bytes += job.nbytes
                self.copies += 1
                self._stats["copy_bytes"] += job.nbytes
            left = self._reading[rid] - 1
            if left:
                self._reading[rid] = left
            else:
                del self._reading[rid]
                self._cancelled.discard(rid)
                if rid in self._delayed:
                    self._delayed.discard(rid)
                    self._sent.add(rid)
            self._stats["copy_s"] += time.perf_counter() - start
            self._cv.notify_all()
        if staged is None:
            self._done(job.nbytes)
            return
        job.staged = staged
        self._net_q.put((1, next(self._seq), job))

    def _net(self, job: _Save | _Load) -> None:
        start = time.perf_counter()
        if isinstance(job, _Save):
            assert job.staged is not None
            written = 0
            try:
                written = self.w.store(job.spec, job.staged)
            except PrefixMissingError as e:  # nothing written; the next save copies from the gap
                log.info("kvdock: %s", e)
                with self._cv:
                    self._gap(job.spec.req_id, int(getattr(e, "at", 0)))
            finally:
                job.staged = None
                with self._cv:
                    self._stats["saves"] += 1
                    self._stats["save_s"] += time.perf_counter() - start
                self._done(job.nbytes)
            with self._cv:
                self._stats["save_bytes"] += written
                self._stats["saved_tokens"] += len(job.spec.tokens) if written else 0
            return
        spec = job.spec
        bs = len(spec.tokens) // len(spec.block_ids) if spec.block_ids else 1  # whole blocks of the tokens
        # if fetch raises: the planned blocks, never vLLM's own prefix-hit blocks before them (shared)
        planned = set(spec.block_ids[spec.start // bs : spec.end // bs])
        failed, nbytes = planned - ({NULL_BLOCK} if spec.groups else set()), 0
        try:
            failed, nbytes = self.w.fetch(spec)
        finally:
            with self._cv:
                s = self._stats
                s["loads"] += 1
                s["load_s"] += time.perf_counter() - start
                s["load_bytes"] += nbytes
                s["load_errors"] += len(failed)
                tokens = (0 if failed else spec.end - spec.start) if spec.groups else nbytes // self.bytes_per_token
                s["loaded_tokens"] += tokens  # (with groups bytes are not tokens: windows fill fewer blocks)
                job.failed = failed
                if job.done is None and failed and spec.groups:
                    # (vLLM takes no block ids with several groups; and a sliding-window group
                    # recomputed from a failed block would attend to the null blocks before it,
                    # which hold no KV: the whole request is recomputed)
                    self._failed.add(spec.req_id)
                elif job.done is None:
                    self._errors |= failed
                    self._recved.add(spec.req_id)
                if job.done is None:
                    self._bg_loads -= 1  # (over, failed or not)
                self._busy -= 1
                self._cv.notify_all()
            if job.done is not None:
                job.done.set()

    def _gap(self, rid: str, at: int) -> None:
        """(Under the lock.) kvdock lacks ``rid``'s chunk at token ``at`` or will: the request's
        next save copies from there."""
        if rid in self._covered:
            self._covered[rid] = min(self._covered[rid], at)

    def _done(self, nbytes: int) -> None:
        with self._cv:
            self._staged -= nbytes
            self._busy -= 1
            self._cv.notify_all()

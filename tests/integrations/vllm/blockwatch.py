"""An engine plugin (``EngineProcess(..., plugin=this file)``, see engine.py): it records, in one
totally ordered log, vLLM's block bookkeeping and the connector's reads of vLLM's pages, so that a
test can check that no block is freed or handed out while a save still reads it.

Recorded (each event with ``seq``, its place in the log, and ``t``, wall-clock time):

* ``alloc`` / ``free``: the block ids the scheduler's BlockPool hands out (``get_new_blocks``) or
  takes back with no holder left (``free_blocks``: ref count 0).
* ``submit``: a save queued (``Transfers.save``, on the model-runner thread right after the
  forward pass): its request, blocks and first 16 tokens (``head``). The pages of those blocks
  are snapshotted there: what the engine computed for them.
* ``read``: the copier's copy of a save out of the pages (``WorkerSide.copy_out``), recorded when
  it is over, with ``start`` (the seq when it began) and whether every block it read equals its
  snapshot. Each copy waits ``BLOCKWATCH_COPY_DELAY_S`` (env) first: saves read late, after their
  requests finished.
* ``finished``: ``request_finished`` (and ``_all_groups``) and what it returned (delay the frees);
  ``sent``: the requests ``update_connector_output`` reports finished sending;
  ``preempted``: ``handle_preemptions`` with some.
* ``store``: a store to kvdock (network thread), recorded when it is over, with its ``start`` time,
  the bytes written and the error it raised. Its start touches ``BLOCKWATCH_STORE_MARK`` (env, a
  path) when set: a test can act while a store is in flight.

Op ``blockwatch`` -> ``{"events": [...], "free_blocks": n, "num_blocks": N}`` (the scheduler's pool).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

DELAY_ENV = "BLOCKWATCH_COPY_DELAY_S"
MARK_ENV = "BLOCKWATCH_STORE_MARK"


class Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.snapshots: dict[tuple[str, int], torch.Tensor] = {}  # (request, block) -> its pages at submit
        self.local = threading.local()  # the copier's current job

    def add(self, kind: str, **fields: Any) -> int:
        with self.lock:
            seq = len(self.events) + 1
            self.events.append({"seq": seq, "kind": kind, "t": time.time(), **fields})
            return seq


def install() -> dict[str, Any]:
    """Patch vLLM's and the connector's classes (before vLLM starts); the ``blockwatch`` op."""
    from vllm.v1.core.block_pool import BlockPool

    from kvdock.integrations.vllm import KvdockConnector
    from kvdock.integrations.vllm.transfers import Transfers
    from kvdock.integrations.vllm.worker import WorkerSide

    log = Log()
    delay = float(os.environ.get(DELAY_ENV, "0"))
    mark = os.environ.get(MARK_ENV)

    get_new_blocks, free_blocks = BlockPool.get_new_blocks, BlockPool.free_blocks

    def watched_get_new_blocks(self: Any, num_blocks: int) -> Any:
        blocks = get_new_blocks(self, num_blocks)
        log.add("alloc", blocks=[b.block_id for b in blocks])
        return blocks

    def watched_free_blocks(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(self, blocks)
        log.add("free", blocks=[b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null])

    BlockPool.get_new_blocks, BlockPool.free_blocks = watched_get_new_blocks, watched_free_blocks

    save, copy = Transfers.save, Transfers._copy

    def watched_save(self: Any, spec: Any) -> bool:
        side = self.w
        bs, geometry = side.block_size, side.codec.geometry
        pages = torch.empty(geometry.chunk_shape(len(spec.block_ids) * bs), dtype=getattr(torch, geometry.dtype))
        side.codec.gather(torch.tensor(spec.block_ids, dtype=torch.long), pages)
        with log.lock:
            for j, b in enumerate(spec.block_ids):
                log.snapshots[(spec.req_id, b)] = pages[:, :, j * bs : (j + 1) * bs].clone()
        log.add("submit", req=spec.req_id, blocks=list(spec.block_ids), head=list(spec.tokens[:16]))
        return bool(save(self, spec))

    def watched_copy(self: Any, job: Any) -> None:
        log.local.job = job
        try:
            copy(self, job)
        finally:
            log.local.job = None

    Transfers.save, Transfers._copy = watched_save, watched_copy

    copy_out, store = WorkerSide.copy_out, WorkerSide.store

    def watched_copy_out(self: Any, block_ids: list[int], mark_: Any) -> torch.Tensor:
        job = getattr(log.local, "job", None)
        rid = job.spec.req_id if job is not None else "?"
        start = log.add("read_start", req=rid, blocks=list(block_ids))
        time.sleep(delay)
        staged = copy_out(self, block_ids, mark_)
        bs = self.block_size
        with log.lock:
            want = [log.snapshots.get((rid, b)) for b in block_ids]
        equal = [w is not None and torch.equal(staged[:, :, j * bs : (j + 1) * bs], w) for j, w in enumerate(want)]
        log.add("read", start=start, req=rid, blocks=list(block_ids), equal=equal)
        return staged

    def watched_store(self: Any, spec: Any, staged: torch.Tensor) -> int:
        start = time.time()
        if mark:
            Path(mark).touch()
        written, error = 0, None
        try:
            written = int(store(self, spec, staged))
            return written
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            log.add("store", start=start, req=spec.req_id, written=written, error=error)

    WorkerSide.copy_out, WorkerSide.store = watched_copy_out, watched_store

    finished, finished_all, output, preemptions = (
        KvdockConnector.request_finished,
        KvdockConnector.request_finished_all_groups,
        KvdockConnector.update_connector_output,
        KvdockConnector.handle_preemptions,
    )

    def watched_finished(self: Any, request: Any, block_ids: Any) -> Any:
        delay_free, params = finished(self, request, block_ids)
        log.add("finished", req=request.request_id, delay=bool(delay_free))
        return delay_free, params

    def watched_finished_all(self: Any, request: Any, block_ids: Any) -> Any:
        delay_free, params = finished_all(self, request, block_ids)
        log.add("finished", req=request.request_id, delay=bool(delay_free))
        return delay_free, params

    def watched_output(self: Any, out: Any) -> None:
        output(self, out)
        if out.finished_sending:
            log.add("sent", reqs=sorted(out.finished_sending))

    def watched_preemptions(self: Any, meta: Any) -> None:
        if meta.preempted:
            log.add("preempted", reqs=sorted(meta.preempted))
        preemptions(self, meta)

    KvdockConnector.request_finished = watched_finished
    KvdockConnector.request_finished_all_groups = watched_finished_all
    KvdockConnector.update_connector_output = watched_output
    KvdockConnector.handle_preemptions = watched_preemptions

    def report(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        with log.lock:
            events = list(log.events)
        return {"events": events, "free_blocks": pool.get_num_free_blocks(), "num_blocks": pool.num_gpu_blocks}

    return {"blockwatch": report}

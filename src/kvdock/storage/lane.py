"""TierLane: one lower tier, its two threads, and its queue of write-downs and deletions.

Runs on the server's event loop; the tier's I/O runs on the lane's writer thread (writes and
deletes, one at a time, in the order they were queued) and reader thread (loads, counts, probes).

Why one queue with one job in flight:

* writes and deletes of a key reach the tier in commit order, so a newer version is never
  replaced by an older one, and a deletion queued for an overwrite lands after every write of an
  older version (what makes an acknowledged overwrite final, see the manager). A deletion does so
  without waiting for unrelated write-downs (:meth:`TierLane.delete`): it cancels the queued
  write-downs of its keys (all of older versions: queued before it; it would delete them anyway)
  and goes ahead of the other queued write-downs, behind the job in flight (one at a time: a
  write of its keys in flight lands first) and the deletions and clears queued before it;
* the job in flight may be a *batch* of consecutive queued write-downs, which the writer runs in
  order without a round trip through the event loop between two of them (as many as take about
  50 ms at the tier's recent write time, :class:`~kvdock.storage.writeback.BatchSizer`); a deletion
  stops a batch after the write in progress, and its unrun writes go back (those of the
  deletion's keys cancelled, the others right behind it: ``_requeue``);
* a queued write-down holds nothing: only the objects of the batch in flight are held
  (:meth:`L1Store.hold`, not a session's pin), each released once its own write is done. A slow
  disk therefore never fills L1 with pinned objects. An object with a write-down queued is
  *dirty* (:meth:`L1Store.mark_dirty`) until it is done, skipped or failed: L1 evicts clean
  objects first, and a store waits a bounded time for write-downs before a dirty object goes
  (:mod:`kvdock.storage.writeback`); a queued write of an object that left L1 meanwhile (evicted
  past that bound, replaced, deleted) is skipped (counted in ``writes_skipped``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvdock.errors import NoRoom, WriteFenced, WriteLate
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage._lanejobs import SharedHeader as SharedHeader  # (re-exported: the manager makes them)
from kvdock.storage._lanejobs import _Batch, _Call, _Write
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.stream import Fence
from kvdock.storage.tier import Head, StorageTier
from kvdock.storage.writeback import BatchSizer

log = logging.getLogger(__name__)
T = TypeVar("T")


class TierLane:
    """Event-loop side of one tier (not thread-safe: call from the loop only)."""

    def __init__(self, tier: StorageTier, l1: L1Store) -> None:
        self.tier = tier
        self.counters = tier.counters  # type: ignore[attr-defined]
        self._l1 = l1
        self._writer = ThreadPoolExecutor(1, f"kvdock-{tier.name}-w")
        self._reader = ThreadPoolExecutor(1, f"kvdock-{tier.name}-r")
        self._queue: deque[_Write | _Call] = deque()
        self._busy: _Batch | _Call | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # a shared tier's fence for each write-down, given its epoch (kvdock.storage.coherence),
        self.fence: Callable[[int], Fence] | None = None
        self.refused: Callable[[L1Object], None] | None = None  # and who drops what it refuses (.keeping)
        self.dropped_down = self.dropped_down_bytes = 0  # dropped: the tier was down (also in writes_skipped)
        self._noroom_logged = self._abandoned = False
        self._sizer = BatchSizer()
        self.writes_cancelled = 0  # queued write-downs an overwrite's deletion made moot (delete)

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def backlog_bytes(self) -> int:  # bytes of write-downs not done yet (backlog)
        return self.backlog()[1]

    def backlog(self) -> tuple[int, int]:
        """(chunks, bytes) of write-downs not done yet: the batch in flight and the live ones queued."""
        queued = [j.obj.nbytes for j in self._queue if isinstance(j, _Write) and j.obj.live]
        queued += [o.nbytes for o in self.writing]
        return len(queued), sum(queued)

    @property
    def writing(self) -> list[L1Object]:
        """The objects the writer holds (L1Store.hold) to copy now or next, in its batch."""
        return [j.obj for j in self._busy.jobs[self._busy.done :]] if isinstance(self._busy, _Batch) else []

    def abandon(self) -> tuple[int, int]:
        """Drop every queued job (a shutdown drain was aborted; the batch in flight stops after its
        write in progress, its unrun writes dropped and counted when it returns; deletions and clears
        answer their default); (chunks, bytes) of the queued live write-downs dropped (writes_skipped)."""
        self._abandoned = True
        if isinstance(self._busy, _Batch):
            self._busy.stop.set()  # its unrun writes are dropped too (_requeue)
        chunks = nbytes = 0
        while self._queue:
            job = self._queue.popleft()
            if isinstance(job, _Call):
                if not job.done.done():
                    job.done.set_result(job.default)
            else:
                self._l1.mark_clean(job.obj)
                if job.obj.live:
                    chunks += 1
                    nbytes += job.obj.nbytes
                    self.counters.writes_skipped += 1
        return chunks, nbytes

    @property
    def idle(self) -> bool:
        return self._busy is None and not self._queue

    def write(self, obj: L1Object, header: SharedHeader, view: memoryview) -> None:
        """Queue a write-down of a committed object (returns at once); it is dirty until done."""
        self._l1.mark_dirty(obj)
        self._queue.append(_Write(obj, header, view))
        self._pump()

    def delete(self, keys: list[ObjectKey]) -> asyncio.Future[int | None]:
        """Queue a durable deletion of ``keys`` (an overwrite's, :meth:`StorageTier.delete_keys`);
        the future gives the epoch the tier names for the new versions once done, None if the
        tier could not be reached (then the objects may still be there). Ahead of the queued
        write-downs, whose those of ``keys`` it cancels (see the module docstring): an overwrite
        waits for the write in flight and the deletions before it, never for the whole backlog."""
        done: asyncio.Future[int | None] = self._get_loop().create_future()
        doomed = set(keys)
        queue: deque[_Write | _Call] = deque()
        for job in self._queue:
            if isinstance(job, _Write) and job.obj.key in doomed:
                self._l1.mark_clean(job.obj)  # an older version: the deletion removes it anyway
                self.writes_cancelled += 1
            else:
                queue.append(job)
        # behind the deletions and clears queued before it, ahead of the write-downs after them
        at = max((i + 1 for i, job in enumerate(queue) if isinstance(job, _Call)), default=0)
        fn = functools.partial(self.tier.delete_keys, keys)
        queue.insert(at, _Call("delete", fn, done, None, len(keys), frozenset(keys)))
        self._queue = queue
        if isinstance(self._busy, _Batch):
            self._busy.stop.set()  # the batch ends after the write in progress (_batch_done)
        self._pump()
        return done

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _pump(self) -> None:
        while self._busy is None and self._queue:
            job = self._queue[0]
            if isinstance(job, _Call):
                self._queue.popleft()
                if not self.tier.up():
                    job.done.set_result(job.default)
                    continue
                self._start(job, job.fn)
                continue
            batch = _Batch([])
            size = self._batch_size()
            while self._queue and isinstance(self._queue[0], _Write) and len(batch.jobs) < size:
                w = self._queue.popleft()
                assert isinstance(w, _Write)
                if not w.obj.live:  # replaced or evicted before its turn
                    self._l1.mark_clean(w.obj)
                    self.counters.writes_skipped += 1
                elif not self.tier.up():  # nowhere to write: dropped, and counted apart too
                    self._l1.mark_clean(w.obj)
                    self.counters.writes_skipped += 1
                    self.dropped_down += 1
                    self.dropped_down_bytes += w.obj.nbytes
                else:
                    self._l1.hold(w.obj)
                    batch.jobs.append(w)
            if batch.jobs:
                self._start(batch, self._write_batch, batch, self._get_loop())

    def _batch_size(self) -> int:  # (writeback.BatchSizer: at the tier's recent write time)
        return self._sizer.size(self.counters.writes, self.counters.write_seconds)

    def _write_batch(self, batch: _Batch, loop: asyncio.AbstractEventLoop) -> int:
        """[writer thread] Run the batch's writes in order, each reported to the loop as done (a
        staging tier's once the batch is settled: StorageTier.settle); stop early when a deletion
        came (``stop``) or the tier failed; how many ran."""
        ran: list[tuple[_Write, tuple[int, float] | None, Exception | None]] = []
        count = 0
        for i, job in enumerate(batch.jobs):
            if i and batch.stop.is_set():
                break
            count = i + 1
            err: Exception | None = None
            try:
                result = self._write_job(job)
            except Exception as e:  # reported to the loop (_wrote), as a write's own outcome
                result, err = None, e
            if self.tier.stages:
                ran.append((job, result, err))
            else:
                loop.call_soon_threadsafe(self._wrote, batch, job, result, err)
            if err is not None and not isinstance(err, (NoRoom, WriteFenced)):
                break  # the tier failed: the rest wait for the loop (dropped while it is down)
        if ran:
            self._settle(batch, ran, loop)
        return count

    def _settle(
        self,
        batch: _Batch,
        ran: list[tuple[_Write, tuple[int, float] | None, Exception | None]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """[writer thread] Settle a staging tier's batch (``ran``: its writes so far) and report each."""
        try:
            unsettled: dict[ObjectKey, Exception] = self.tier.settle()
        except Exception as e:  # the tier failed: no staged write of the batch is known to land
            unsettled = {job.obj.key: e for job, _, failure in ran if failure is None}
        for job, result, failure in ran:
            failed = failure if failure is not None else unsettled.get(job.obj.key)
            loop.call_soon_threadsafe(self._wrote, batch, job, result if failed is None else None, failed)

    def _write_job(self, job: _Write) -> tuple[int, float]:
        t0 = time.perf_counter()
        # the fence is read before the liveness check: an invalidation drops the object first,
        # then advances the position (kvdock.storage.coherence)
        fence = self.fence(job.obj.epoch) if self.fence is not None else None
        if fence is not None and not job.obj.live:
            raise WriteFenced("the object was invalidated before its write-down")
        size = self.tier.write_from(job.obj.key, job.header.get(), job.view, fence)
        return size, time.perf_counter() - t0

    def _start(self, job: _Batch | _Call, fn: Callable[..., Any], *args: Any) -> None:
        self._busy = job
        loop = self._get_loop()
        fut = self._writer.submit(fn, *args)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._finished, job, f))

    def _wrote(self, batch: _Batch, job: _Write, result: tuple[int, float] | None, err: BaseException | None) -> None:
        """One write of ``batch`` is over (called in order, before ``_finished`` of the batch)."""
        assert batch.jobs[batch.done] is job
        batch.done += 1
        self._l1.mark_clean(job.obj)
        self._l1.release(job.obj)
        if err is None:
            assert result is not None
            size, seconds = result
            self.counters.writes += 1
            self.counters.bytes_written += size
            self.counters.write_seconds += seconds
        elif isinstance(err, (NoRoom, WriteFenced)):
            self.counters.writes_skipped += 1
            if isinstance(err, WriteFenced) and not isinstance(err, WriteLate) and self.refused is not None:
                self.refused(job.obj)  # (not served here either)
            if isinstance(err, NoRoom) and not self._noroom_logged:  # (counted every time)
                self._noroom_logged = True
                log.warning("%s: a write-down found no room (%s); such objects stay in L1 only", self.name, err)
        else:
            self.counters.write_errors += 1
            self.tier.failed(err)
            log.error("%s: write-down of %s failed: %s", self.name, job.obj.key.chunk.hex()[:16], err)

    def _finished(self, job: _Batch | _Call, fut: Future[Any]) -> None:
        self._busy = None
        err = fut.exception()
        if isinstance(job, _Batch):
            if err is not None:  # (a bug: _write_batch reports every write's own error)
                log.error("%s: a batch of write-downs failed: %s", self.name, err)
            self._requeue(job.jobs[job.done :])
        else:
            if err is None and job.what == "delete":
                self.counters.deletes += job.count
            if err is not None:
                self.tier.failed(err)
                log.error("%s: %s failed: %s", self.name, job.what, err)
            if not job.done.done():
                job.done.set_result(job.default if err is not None else fut.result())
        self._pump()

    def _requeue(self, jobs: list[_Write]) -> None:
        """The writes a batch did not run (a deletion stopped it) go back: those of a queued deletion's
        keys are cancelled (as :meth:`delete` does), the others go right behind the leading deletions."""
        for job in jobs:
            self._l1.release(job.obj)
        if self._abandoned:  # a drain was aborted meanwhile: dropped and counted, as abandon does
            self._queue.extendleft(reversed(jobs))
            self.abandon()
            return
        doomed = {k for q in self._queue if isinstance(q, _Call) for k in q.keys}  # (all queued after them)
        lead = (i for i, q in enumerate(self._queue) if not (isinstance(q, _Call) and q.what == "delete"))
        at = next(lead, len(self._queue))
        for i, job in enumerate(j for j in jobs if j.obj.key not in doomed):
            self._queue.insert(at + i, job)
        for job in (j for j in jobs if j.obj.key in doomed):
            self._l1.mark_clean(job.obj)
            self.writes_cancelled += 1

    async def on_reader(self, fn: Callable[..., T], *args: Any, default: T, when_down: bool = False) -> T:
        """Run ``fn(*args)`` on the reader thread; an error marks the tier down and gives ``default``.
        A call whose turn comes once the tier is down gives ``default`` at once (unless
        ``when_down``: a probe), so reads queued behind the one that timed out do not each wait
        out a timeout of their own."""

        def run() -> T:
            if not when_down and not self.tier.up():
                return default
            try:
                return fn(*args)
            except Exception as e:  # the tier's client failed: degrade, never fail the request
                self.tier.failed(e)  # here, so that the calls queued behind see it down at once
                return default

        return await self._get_loop().run_in_executor(self._reader, run)

    async def read(
        self, key: ObjectKey, view: memoryview, geometry: KVGeometry, chunk_size: int, parent: int
    ) -> Head | None:
        """Copy ``key``'s version that follows version ``parent`` from the tier into ``view`` (an
        L1 reservation); its head, None on a miss (absent, or another chain's version)."""
        t0 = time.perf_counter()
        found = await self.on_reader(self.tier.read_into, key, view, geometry, chunk_size, default=None)
        if found is not None and found.parent != parent:
            return None
        if found is not None:
            self.counters.hits += 1
            self.counters.bytes_read += len(view)
            self.counters.read_seconds += time.perf_counter() - t0
        return found

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job is done; False if ``timeout_s`` passed first (nothing is
        dropped then). The server's shutdown drains through :func:`kvdock.storage.drain.drain_lanes`."""
        deadline = time.monotonic() + timeout_s
        while not self.idle:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def clear(self) -> int:
        """Remove what the tier can clear, after the writes queued before."""
        done: asyncio.Future[int] = self._get_loop().create_future()
        self._queue.append(_Call("clear", self.tier.clear, done, 0))
        self._pump()
        return await done

    def close(self) -> None:
        """Stop the threads (after the job in flight) and close the tier. Jobs still queued are
        dropped: drain first to finish them (or :meth:`abandon` them, counted)."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.tier.close()

    def check_integrity(self) -> None:
        held: dict[int, int] = {}
        for obj in self.writing:
            held[id(obj)] = held.get(id(obj), 0) + 1
        for obj in self.writing:
            assert obj.holds >= held[id(obj)], "the writer copies an object it does not hold"
        self.tier.check_integrity()


def check_dirty(l1: L1Store, lanes: list[TierLane]) -> None:
    """Assert: each READY object is dirty exactly as many times as it has write-downs queued or in
    flight, over every lane (clean before dirty: storage.evictable)."""
    want: dict[int, int] = {}
    for lane in lanes:
        busy = lane._busy.jobs[lane._busy.done :] if isinstance(lane._busy, _Batch) else []
        for job in (*busy, *lane._queue):
            if isinstance(job, _Write):
                want[id(job.obj)] = want.get(id(job.obj), 0) + 1
    for obj in l1._ready.values():
        n = want.get(id(obj), 0)
        assert obj.dirty == n, f"an object is dirty {obj.dirty} times, with {n} write-downs queued"

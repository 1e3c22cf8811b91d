"""The lower tiers under L1: asynchronous write-down (L1 → L2 disk, L1 → L3 Redis), lookups that
count across tiers, and prefetch that promotes objects from L2/L3 into L1 slots.

Runs on the server's event loop; the bulk I/O runs in worker threads that read from or write into
slot memory directly. Slots are protected while a worker uses them: a written-down object is
pinned (a background pin), a slot being filled is reserved and only committed or freed after the
worker is done, even if the session that asked for it ended meanwhile.

Each tier has one writer thread, so writes of one key land in order (an overwrite's new version
is never replaced by the older one), and one reader thread, so prefetch never waits behind a
queue of writes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvdock.keys import ObjectKey
from kvdock.storage import disk as diskmod
from kvdock.storage import objfile
from kvdock.storage.disk import DiskEntry, DiskStore
from kvdock.storage.manager import Session, StorageManager
from kvdock.storage.memory import L1Object
from kvdock.storage.redis import ERRORS as REDIS_ERRORS
from kvdock.storage.redis import RedisStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectLayout:
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass
class TierCounters:
    """Plain counters per tier, exported by the server's /metrics and /status."""

    hits: int = 0  # objects promoted into L1 from this tier
    bytes_read: int = 0
    read_seconds: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0
    writes_skipped: int = 0  # tier down, object too big, or write-down backlog full
    corrupted: int = 0  # torn or failing its checksum: deleted, never returned


class _SharedHeader:
    """An object's header block, computed once (it checksums the whole payload) by whichever
    tier's writer thread needs it first."""

    def __init__(self, key: ObjectKey, lay: ObjectLayout, view: memoryview) -> None:
        self._args = (key, lay.dtype, lay.shape, view)
        self._lock = threading.Lock()
        self._block: bytes | None = None

    def get(self) -> bytes:
        with self._lock:
            if self._block is None:
                self._block = objfile.encode_header(*self._args)
            return self._block


@dataclass(eq=False)
class PrefetchJob:
    session: Session
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    task: asyncio.Task[None] | None = None


class Tiers:
    def __init__(
        self,
        manager: StorageManager,
        layout_of: Callable[[str], ObjectLayout | None],
        disk: DiskStore | None = None,
        redis: RedisStore | None = None,
        max_backlog_bytes: int | None = None,
    ) -> None:
        self.manager = manager
        self.layout_of = layout_of
        self.disk = disk
        self.redis = redis
        self.counters = {"l2": TierCounters(), "l3": TierCounters()}
        if disk is not None:  # torn files the start-up scan deleted count as corrupted
            self.counters["l2"].corrupted = disk.last_scan.torn
        # bytes waiting for write-down to one tier; past this, new objects skip that tier
        self.max_backlog_bytes = max_backlog_bytes or manager.l1.allocator.capacity
        self.backlog = {"l2": 0, "l3": 0}  # per tier
        self._generation: dict[str, int] = {}
        self._latest: dict[str, dict[ObjectKey, int]] = {"l2": {}, "l3": {}}  # newest queued write per key
        self._pools = {
            name: (ThreadPoolExecutor(1, f"kvdock-{name}-w"), ThreadPoolExecutor(1, f"kvdock-{name}-r"))
            for name, tier in (("l2", disk), ("l3", redis))
            if tier is not None
        }
        self._loads: dict[ObjectKey, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        manager.on_commit = self.write_down
        manager.on_session_end = self._session_ended

    @property
    def backlog_bytes(self) -> int:
        return sum(self.backlog.values())

    @property
    def enabled(self) -> bool:
        return bool(self._pools)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # --- write-down --------------------------------------------------------------------------

    def write_down(self, objs: list[L1Object]) -> None:
        """Queue copies of newly committed objects to every lower tier (returns at once)."""
        if not self._pools:
            return
        loop = self._ensure_loop()
        for obj in objs:
            lay = self.layout_of(obj.key.model)
            assert lay is not None and lay.nbytes == obj.nbytes
            header = _SharedHeader(obj.key, lay, self.manager.l1.view(obj))
            for name in self._pools:
                self._write_one(loop, name, obj, lay, header)

    def _write_one(
        self, loop: asyncio.AbstractEventLoop, name: str, obj: L1Object, lay: ObjectLayout, header: _SharedHeader
    ) -> None:
        counters = self.counters[name]
        evicted: list[DiskEntry] | None = []
        promised = 0
        if name == "l2":
            assert self.disk is not None
            # The older version's entry goes now, written or skipped: its file is replaced by this
            # write's rename (or deleted), and no other write may evict (unlink) that path meanwhile.
            stale = self.disk.remove(obj.key)
            promised = objfile.header_block_size(obj.key, lay.dtype, lay.shape, lay.nbytes) + obj.nbytes
            if self.backlog[name] + obj.nbytes <= self.max_backlog_bytes:
                evicted = self.disk.make_room(promised)
            else:
                evicted = None
            if evicted is None:
                counters.writes_skipped += 1
                if obj.key in self._latest[name]:  # a queued older write must not re-index its file
                    self._latest[name][obj.key] = -1
                if stale is not None:  # never serve the older version after this overwrite
                    self._pools[name][0].submit(stale.path.unlink, missing_ok=True)
                return
        elif self.backlog[name] + obj.nbytes > self.max_backlog_bytes or not self._redis_up():
            counters.writes_skipped += 1
            return
        path = self.disk.path_for(obj.key) if self.disk is not None and name == "l2" else None
        generation = self._generation[name] = self._generation.get(name, 0) + 1
        self._latest[name][obj.key] = generation
        self.manager.pin_background(obj)
        self.backlog[name] += obj.nbytes
        view = self.manager.l1.view(obj)

        def work() -> tuple[int, float]:
            t0 = time.perf_counter()
            block = header.get()
            if path is not None:
                for e in evicted or []:
                    e.path.unlink(missing_ok=True)
                size = diskmod.write_object(path, block, view)
            else:
                assert self.redis is not None
                self.redis.put(obj.key, block, view)
                size = len(block) + len(view)
            return size, time.perf_counter() - t0

        def finished(fut: Future[tuple[int, float]]) -> None:
            self.manager.unpin_background(obj)
            self.backlog[name] -= obj.nbytes
            newest = self._latest[name].get(obj.key) == generation
            if newest:
                del self._latest[name][obj.key]
            err = fut.exception()
            if err is None:
                size, seconds = fut.result()
                counters.writes += 1
                counters.bytes_written += size
                counters.write_seconds += seconds
                if path is not None:
                    assert self.disk is not None
                    if newest:
                        self.disk.add(DiskEntry(obj.key, path, size), promised)
                    else:  # a newer version of the key is queued and will own the path
                        self.disk.release(promised)
                return
            counters.write_errors += 1
            if path is not None:
                assert self.disk is not None
                self.disk.release(promised)
                log.error("L2 write of %s failed: %s", path, err)
            elif self.redis is not None and isinstance(err, REDIS_ERRORS):
                self.redis.failed(err)

        fut = self._pools[name][0].submit(work)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(finished, f))

    def _redis_up(self) -> bool:
        return self.redis is not None and self.redis.available()

    # --- lookup ------------------------------------------------------------------------------

    async def count(self, keys: list[ObjectKey], start: int) -> int:
        """How many leading ``keys`` are cached in any tier, given the first ``start`` are in L1."""
        n = start
        while n < len(keys):
            if self.manager.l1.get(keys[n]) is not None or (self.disk is not None and self.disk.contains(keys[n])):
                n += 1
                continue
            if not self._redis_up():
                break
            assert self.redis is not None
            found = await self._run_redis(functools.partial(self.redis.count_present, keys[n:]))
            if not found:
                break
            n += found
        return n

    async def _run_redis(self, fn: Callable[[], Any]) -> Any:
        assert self.redis is not None
        try:
            return await self._ensure_loop().run_in_executor(self._pools["l3"][1], fn)
        except REDIS_ERRORS as e:
            self.redis.failed(e)
            return 0

    # --- prefetch ----------------------------------------------------------------------------

    def start_prefetch(self, session: Session, keys: list[ObjectKey]) -> PrefetchJob:
        """Load ``keys[len(session.pinned):]`` into L1 in order, pinning each for the session,
        until the first miss. The job's ``done`` event is set when it stops."""
        job = PrefetchJob(session)
        session.job = job
        session.busy = True  # its lease waits for the job
        job.task = asyncio.get_running_loop().create_task(self._prefetch(job, keys))
        return job

    async def _prefetch(self, job: PrefetchJob, keys: list[ObjectKey]) -> None:
        try:
            for key in keys[len(job.session.pinned) :]:
                if job.cancelled:
                    break
                obj = await self._load(key)
                if obj is None or not self.manager.add_pin(job.session, obj):
                    break
        except Exception:
            log.exception("prefetch failed")
        finally:
            job.session.busy = False
            self.manager.renew(job.session)
            job.done.set()

    def _session_ended(self, session: Session) -> None:
        if isinstance(session.job, PrefetchJob):
            session.job.cancelled = True

    async def _load(self, key: ObjectKey) -> L1Object | None:
        """The READY L1 object for ``key``, promoted from L2/L3 if needed; None on a miss."""
        while True:
            obj = self.manager.l1.get(key)
            if obj is not None:
                return obj
            pending = self._loads.get(key)
            if pending is None:
                break
            await asyncio.shield(pending)  # someone else is loading it: wait, then look again
            if self.manager.l1.get(key) is None:
                return None
        lay = self.layout_of(key.model)
        entry = self.disk.get(key) if self.disk is not None else None
        if lay is None or (entry is None and not self._redis_up()):
            return None
        done = self._ensure_loop().create_future()
        self._loads[key] = done
        try:
            slot = self.manager.reserve_load(key, lay.nbytes)
            if slot is None:
                return None
            ok = False
            try:
                ok = await self._fill(slot, entry, lay)
            except Exception:
                log.exception("loading %s into L1 failed", key.chunk.hex()[:16])
            finally:
                loaded = self.manager.finish_load(slot, ok)  # always: the slot must not leak
            return loaded
        finally:
            del self._loads[key]
            done.set_result(None)

    async def _fill(self, slot: L1Object, entry: DiskEntry | None, lay: ObjectLayout) -> bool:
        view = self.manager.l1.view(slot)
        loop = self._ensure_loop()
        if entry is not None:
            c = self.counters["l2"]
            t0 = time.perf_counter()
            try:
                header = await loop.run_in_executor(self._pools["l2"][1], diskmod.read_object, entry.path, view)
                objfile.check(header, slot.key, lay.dtype, lay.shape, lay.nbytes)
            except (OSError, objfile.CorruptObject) as e:
                self._drop_corrupt_file(entry, e)
            else:
                c.hits += 1
                c.bytes_read += slot.nbytes
                c.read_seconds += time.perf_counter() - t0
                return True
        if not self._redis_up():
            return False
        assert self.redis is not None
        c = self.counters["l3"]
        t0 = time.perf_counter()
        try:
            found = await loop.run_in_executor(
                self._pools["l3"][1], self.redis.get_into, slot.key, view, lay.dtype, lay.shape
            )
        except objfile.CorruptObject as e:
            c.corrupted += 1
            log.warning("L3: corrupted value for %s (%s); ignored", slot.key.chunk.hex()[:16], e)
            return False
        except REDIS_ERRORS as e:
            self.redis.failed(e)
            return False
        if found:
            c.hits += 1
            c.bytes_read += slot.nbytes
            c.read_seconds += time.perf_counter() - t0
        return bool(found)

    def _drop_corrupt_file(self, entry: DiskEntry, err: BaseException) -> None:
        assert self.disk is not None
        if self.disk.get(entry.key) is entry:
            self.disk.remove(entry.key)
        if isinstance(err, objfile.CorruptObject):
            self.counters["l2"].corrupted += 1
            log.warning("L2: %s is corrupted (%s); deleted", entry.path, err)
        try:
            entry.path.unlink(missing_ok=True)
        except OSError as e:
            log.error("L2: cannot delete %s: %s", entry.path, e)

    # --- operations --------------------------------------------------------------------------

    async def probe(self) -> None:
        """Reconnect a down Redis when its backoff has passed (call periodically)."""
        if self.redis is not None and self.redis.probe_due():
            await self._ensure_loop().run_in_executor(self._pools["l3"][1], self.redis.probe)

    def clear_disk(self) -> int:
        if self.disk is None:
            return 0
        entries = self.disk.clear()
        for e in entries:
            e.path.unlink(missing_ok=True)
        return len(entries)

    def close(self) -> None:
        """Finish queued writes, then stop the threads."""
        for writer, reader in self._pools.values():
            writer.shutdown(wait=True)
            reader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        if self.redis is not None:
            self.redis.close()

    def check_integrity(self) -> None:
        self.manager.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        assert min(self.backlog.values()) >= 0

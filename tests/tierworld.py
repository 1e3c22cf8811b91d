"""A test harness for the storage manager and its lanes, in-process: a real L1Store over bytearray
memory, a StorageManager, a DiskTier in a temporary directory and, when asked, a RedisTier."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.shm.pool import FlatMemory
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage import objfile
from kvdock.storage.coherence import Coherence
from kvdock.storage.disk import DiskTier
from kvdock.storage.lane import TierLane
from kvdock.storage.manager import StorageManager
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.redis import RedisTier
from kvdock.storage.sessions import Session
from kvdock.storage.stream import PollResult
from kvdock.storage.tier import Head

SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4  # float32 KV_2LTD chunk: 3840 bytes, one 4 KiB slot
GEO, CHUNK = KVGeometry(3, 2, 5, "float32"), 16  # model "tiny": chunks of SHAPE
FILE = ALIGN + NB  # one object file on disk


def K(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("tiny", 0, salt, bytes([i]) * 32)


def payload(key: ObjectKey, version: int = 0) -> bytes:
    i = key.chunk[0]
    return bytes((j * 11 + i * 29 + version * 71 + 3) % 256 for j in range(NB))


def geometry_of(model: str) -> KVGeometry | None:
    return GEO if model == "tiny" else None


def head(obj: L1Object) -> Head:
    """An L1 object's place in its version chain, as a tier reports it."""
    return Head(obj.version, obj.parent)


class _LegacyHeader(msgspec.Struct, array_like=True):
    """The object header as written before version chains: no version, no parent."""

    model: str
    rank: int
    salt: str
    chunk: bytes
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: bytes


def legacy_header(key: ObjectKey, dtype: str, shape: list[int], data: bytes) -> bytes:
    """The padded header block of an object written before version chains (8 fields)."""
    body = msgspec.msgpack.encode(
        _LegacyHeader(key.model, key.rank, key.salt, key.chunk, dtype, shape, len(data), objfile.checksum(data))
    )
    raw = struct.pack("<8sI", objfile.MAGIC, len(body)) + body
    return raw + b"\0" * (-len(raw) % ALIGN)


class World:
    """L1 (``slots`` slots of real memory) + manager + L2 in tmp_path + optional L3. ``preloaded``:
    how many objects the start-up scan of L2 must find (files a previous run left there)."""

    def __init__(
        self,
        tmp_path: Path,
        slots: int = 8,
        disk_files: int = 32,
        redis_url: str | None = None,
        disk: bool = True,
        preloaded: int = 0,
        coherent: bool = False,
    ) -> None:
        self.mem = bytearray(slots * ALIGN)
        self.l1 = L1Store(SlotAllocator(0, slots * ALIGN), memory=FlatMemory(memoryview(self.mem)))
        self.disk = DiskTier(tmp_path / "l2", capacity=disk_files * FILE) if disk else None
        assert self.disk is None or self.disk.scan().loaded == preloaded
        self.redis = RedisTier(redis_url, timeout=2.0) if redis_url else None
        self.lanes = {t.name: TierLane(t, self.l1) for t in (self.disk, self.redis) if t is not None}
        # the fleet's invalidations (a shared L3), on a clock of the test's own
        self.now = 0.0
        self.coherence: Coherence | None = None
        if self.redis is not None and coherent:
            redis = self.redis
            self.coherence = Coherence(lambda: redis._redis, bound_s=0.1, clock=lambda: self.now)
            redis.coherence = self.coherence
            self.lanes["l3"].fence = self.coherence.fence
        self.mgr = StorageManager(
            self.l1, 60.0, list(self.lanes.values()), geometry_of, CHUNK, coherence=self.coherence
        )
        self._sid = 0

    def check(self) -> None:
        self.mgr.check_integrity()

    def store(
        self, keys: list[ObjectKey], version: int = 0, overwrite: bool = False, deduped: int = 0
    ) -> list[L1Object]:
        """Store the prefix ``keys`` through the manager: prepare, fill, commit. Its first
        ``deduped`` chunks must be found stored already (the prefix it extends), every other chunk
        is written. Returns the written objects. Must run in the event loop."""
        assert not overwrite, "an overwrite waits for its deletions: use store_async"
        self._sid += 1
        sid = f"store-{self._sid}"
        plan = self.mgr.prepare_store("c", sid, keys, NB, overwrite)
        assert (plan.deduped, plan.in_flight, plan.pool_full) == (deduped, 0, 0), plan
        assert [i for i, _ in plan.slots] == list(range(deduped, len(keys))), plan
        for i, obj in plan.slots:
            self.l1.view(obj)[:] = payload(keys[i], version)
        self.check()
        if not plan.slots:
            return []
        assert self.mgr.commit_store("c", sid, [i for i, _ in plan.slots]) == len(plan.slots)
        self.check()
        return [obj for _, obj in plan.slots]

    async def store_async(self, keys: list[ObjectKey], version: int = 0, overwrite: bool = False) -> int:
        """Like :meth:`store`, waiting for an overwrite's deletions as the server does; returns how
        many chunks were committed (raises RequestError if the overwrite is refused)."""
        self._sid += 1
        sid = f"store-{self._sid}"
        plan = self.mgr.prepare_store("c", sid, keys, NB, overwrite)
        for i, obj in plan.slots:
            self.l1.view(obj)[:] = payload(keys[i], version)
        if not plan.slots:
            return 0
        ok = await self.mgr.wait_deletes("c", sid)
        n = self.mgr.commit_store("c", sid, [i for i, _ in plan.slots], ok)
        self.check()
        return n

    async def sync(self) -> PollResult:
        """Poll the fleet's invalidations once and apply them (as the server's follower does);
        the server then vouches until ``now`` + the bound."""
        assert self.coherence is not None
        result = await asyncio.get_running_loop().run_in_executor(None, self.coherence.poll)
        pending = self.mgr.apply(result)
        self.coherence.vouch(result)
        await asyncio.gather(*pending)
        self.check()
        return result

    async def drain(self) -> None:
        """Wait until every queued write-down finished."""
        for lane in self.lanes.values():
            assert await lane.drain(10.0), f"{lane.name}: write-down did not finish"
        self.check()

    def evict_l1(self, keys: list[ObjectKey]) -> None:
        for k in keys:
            assert self.l1.remove(k)
        self.check()

    async def prefetch(self, sid: str, keys: list[ObjectKey]) -> Session:
        session = self.mgr.open_retrieve("c", sid, keys)
        job = self.mgr.start_prefetch(session)
        self.check()
        if job is not None:
            await asyncio.wait_for(job.done.wait(), 10)
        self.check()
        return session

    def l1_bytes(self, key: ObjectKey) -> bytes:
        obj = self.l1.get(key)
        assert obj is not None, f"{key.chunk[0]} is not in L1"
        return bytes(self.l1.view(obj))

    def block(self, tier: str = "l2", which: int = 0) -> threading.Event:
        """Occupy a tier's writer (0) or reader (1) thread until the returned event is set."""
        gate = threading.Event()
        lane = self.lanes[tier]
        (lane._writer if which == 0 else lane._reader).submit(gate.wait, 10)
        return gate


def run(tmp_path: Path, body: Callable[[World], Awaitable[None]], check: bool = True, **kw: object) -> None:
    """Run ``body(world)`` in an event loop; then (with ``check``) drain the write-downs and check
    integrity; always stop the tiers' threads."""

    async def main() -> None:
        w = World(tmp_path, **kw)  # type: ignore[arg-type]
        try:
            await body(w)
            if check:
                await w.drain()
                w.check()
        finally:
            w.mgr.close()

    asyncio.run(main())


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never became true")

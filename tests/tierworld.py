"""A test harness for kvdock.storage.tiers, in-process: a real L1Store over bytearray memory, a
StorageManager, a DiskStore in a temporary directory and, when asked, a RedisStore."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvdock.keys import ObjectKey
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.disk import DiskStore
from kvdock.storage.manager import Session, StorageManager
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.redis import RedisStore
from kvdock.storage.tiers import ObjectLayout, Tiers

SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4  # float32 KV_2LTD chunk: 3840 bytes, one 4 KiB slot
LAYOUT = ObjectLayout(dtype="float32", shape=SHAPE, nbytes=NB)
FILE = ALIGN + NB  # one object file on disk


def K(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("tiny", 0, salt, bytes([i]) * 32)


def payload(key: ObjectKey, version: int = 0) -> bytes:
    i = key.chunk[0]
    return bytes((j * 11 + i * 29 + version * 71 + 3) % 256 for j in range(NB))


def layout_of(model: str) -> ObjectLayout | None:
    return LAYOUT if model == "tiny" else None


class World:
    """L1 (``slots`` slots of real memory) + manager + L2 in tmp_path + optional L3."""

    def __init__(
        self,
        tmp_path: Path,
        slots: int = 8,
        disk_files: int = 32,
        redis_url: str | None = None,
        max_backlog_bytes: int | None = None,
    ) -> None:
        self.mem = bytearray(slots * ALIGN)
        self.l1 = L1Store(SlotAllocator(0, slots * ALIGN), memory=memoryview(self.mem))
        self.mgr = StorageManager(self.l1, session_ttl=60.0)
        self.disk = DiskStore(tmp_path / "l2", capacity=disk_files * FILE)
        assert self.disk.scan().loaded == 0
        self.redis = RedisStore(redis_url, timeout=2.0) if redis_url else None
        self.tiers = Tiers(self.mgr, layout_of, self.disk, self.redis, max_backlog_bytes=max_backlog_bytes)
        self._sid = 0

    def check(self) -> None:
        self.tiers.check_integrity()

    def store(self, keys: list[ObjectKey], version: int = 0, overwrite: bool = False) -> list[L1Object]:
        """Store ``keys`` (all new, or overwritten) through the manager: prepare, fill, commit.
        Must run in the event loop."""
        self._sid += 1
        sid = f"store-{self._sid}"
        plan = self.mgr.prepare_store("c", sid, keys, NB, overwrite)
        assert plan.pool_full == 0 and len(plan.slots) == len(keys), plan
        for i, obj in plan.slots:
            self.l1.view(obj)[:] = payload(keys[i], version)
        self.check()
        assert self.mgr.commit_store("c", sid, [i for i, _ in plan.slots]) == len(plan.slots)
        self.check()
        return [obj for _, obj in plan.slots]

    async def drain(self) -> None:
        """Wait until every queued write-down finished."""
        for _ in range(2000):
            if self.tiers.backlog_bytes == 0 and self.mgr.background_pins == 0:
                self.check()
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"write-down did not finish: backlog {self.tiers.backlog_bytes}")

    def evict_l1(self, keys: list[ObjectKey]) -> None:
        for k in keys:
            assert self.l1.remove(k)
        self.check()

    async def prefetch(self, sid: str, keys: list[ObjectKey]) -> Session:
        session = self.mgr.open_retrieve("c", sid, keys)
        job = self.tiers.start_prefetch(session, keys)
        self.check()
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
        self.tiers._pools[tier][which].submit(gate.wait, 10)
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
            w.tiers.close()

    asyncio.run(main())


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never became true")

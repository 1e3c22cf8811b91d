"""A chunk stored in several shards (TP ranks: one key each) is one version across a fleet (R-KEEP
2 and 5): an overwrite of it deletes every shard's older version under ONE invalidation (one E1,
one E2: StorageManager.prepare_stores, as server.storing prepares a request), commits every shard
or none (storage.commits), and a holder that must drop one shard drops them all (storage.keeping).
Real Redis; the storage harness (tierworld) driven step by step as the server drives it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from helpers import RedisProc
from kvdock.keys import ObjectKey
from kvdock.storage import objfile
from kvdock.storage.redis import floor_key
from kvdock.storage.stream import pos_text
from tierworld import NB, World, payload


def hosts(tmp_path: Path, redis_server: RedisProc, n: int) -> list[World]:
    return [World(tmp_path / f"h{i}", redis_url=redis_server.url, disk=False, coherent=True) for i in range(n)]


def l3_version(w: World, key: ObjectKey) -> int | None:
    assert w.redis is not None
    value = w.redis._redis.get(w.redis._key(key))
    return None if value is None else objfile.decode_header(value)[0].version


def prepare(w: World, sid: str, keys: list[ObjectKey], version: int) -> None:
    """An overwrite of one chunk in len(keys) shards (shard i: session sid, sid/1, ...), filled."""
    sids = [sid] + [f"{sid}/{i}" for i in range(1, len(keys))]
    plans = w.mgr.prepare_stores("c", [(s, [k], None) for s, k in zip(sids, keys, strict=True)], NB, True, None, True)
    for plan, key in zip(plans, keys, strict=True):
        assert [i for i, _ in plan.slots] == [0]
        for _, obj in plan.slots:
            w.l1.view(obj)[:] = payload(key, version)


def test_a_sharded_overwrite_is_one_invalidation_and_the_later_one_wins_every_shard(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """A's overwrite of a 2-shard chunk publishes its E1, then C's whole overwrite of the chunk
    runs (E1, E2), then A's E2. One entry names both shards' keys and both shards' sessions get
    the same E2, so A's later E2 wins for every shard: A commits both, C neither, and a reader on
    a third server gets A's bytes for both shards (with an entry per shard, A's lane pausing
    between its shards let each server win one shard: R-KEEP 2)."""
    keys = [ObjectKey("tiny", r, "", bytes([21]) * 32) for r in (0, 1)]

    async def main() -> None:
        a, c, d = hosts(tmp_path, redis_server, 3)
        loop = asyncio.get_running_loop()
        assert a.coherence is not None
        published: list[list[ObjectKey]] = []
        after_e1, go_on = threading.Event(), threading.Event()
        publish = a.coherence.publish

        def paused_publish(ks: list[ObjectKey], run: object = None) -> int:
            pos = publish(ks, run)  # type: ignore[arg-type]
            published.append(list(ks))
            if len(published) == 1:  # A's E1 is in the stream: C's overwrite comes now
                after_e1.set()
                go_on.wait(10)
            return pos

        a.coherence.publish = paused_publish  # type: ignore[method-assign]
        try:
            for w in (a, c, d):
                await w.sync()
            prepare(a, "a", keys, 1)
            assert await loop.run_in_executor(None, after_e1.wait, 10)
            prepare(c, "c", keys, 2)
            assert await c.mgr.wait_deletes("c", "c") and await c.mgr.wait_deletes("c", "c/1")
            go_on.set()
            assert await a.mgr.wait_deletes("c", "a") and await a.mgr.wait_deletes("c", "a/1")
            assert sorted(published[0]) == sorted(keys) and len(published) == 2, published
            e2s = {max(f.result() or 0 for f in a.mgr.sessions.get("c", s).deletes) for s in ("a", "a/1")}
            assert len(e2s) == 1, f"A's shards have different E2s: {[pos_text(e) for e in e2s]}"
            await a.sync()
            await c.sync()
            assert c.mgr.commit_stores("c", [("c", [0]), ("c/1", [0])]) == 0
            assert a.mgr.commit_stores("c", [("a", [0]), ("a/1", [0])]) == 2
            await a.drain()
            await c.drain()
            assert [a.l1_bytes(k) for k in keys] == [payload(k, 1) for k in keys]
            assert all(c.l1.get(k) is None for k in keys)
            assert [l3_version(a, k) for k in keys] == [a.l1.get(k).version for k in keys]  # type: ignore[union-attr]
            await d.sync()
            for i, key in enumerate(keys):
                session = await d.prefetch(f"d{i}", [key])
                assert [bytes(d.l1.view(o)) for o in session.pinned] == [payload(key, 1)]
                d.mgr.end_session("c", f"d{i}")
        finally:
            go_on.set()
            for w in (a, c, d):
                w.mgr.close()

    asyncio.run(main())


def test_an_overwrite_one_shard_of_which_is_superseded_commits_no_shard(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """An invalidation of shard 0's key alone by another server (its E2 after A's) reaches A
    before A's commit: shard 0 must not commit, so shard 1 does not either (one shard of A's
    version beside another writer's shard 0 is a chunk of two versions)."""
    keys = [ObjectKey("tiny", r, "", bytes([22]) * 32) for r in (0, 1)]

    async def main() -> None:
        a, c = hosts(tmp_path, redis_server, 2)
        try:
            await a.sync()
            await c.sync()
            prepare(a, "a", keys, 1)
            assert await a.mgr.wait_deletes("c", "a") and await a.mgr.wait_deletes("c", "a/1")
            assert await c.store_async([keys[0]], version=2, overwrite=True) == 1  # (shard 0's key only)
            await a.sync()
            assert a.mgr.commit_stores("c", [("a", [0]), ("a/1", [0])]) == 0
            assert all(a.l1.get(k) is None and a.l1.reservation(k) is None for k in keys)
            a.check()
        finally:
            a.mgr.close()
            c.mgr.close()

    asyncio.run(main())


def test_a_holder_that_must_drop_one_shard_of_an_overwrite_drops_every_shard(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """A holds its overwrite of a 2-shard chunk; shard 0's floor is raised by another overwrite
    (KEEP answers -1 for it, 1 for shard 1): A drops both shards, not shard 0 alone (a plain
    store could then fill shard 0 with other bytes beside A's shard 1: R-KEEP 5)."""
    keys = [ObjectKey("tiny", r, "", bytes([23]) * 32) for r in (0, 1)]

    async def main() -> None:
        (a,) = hosts(tmp_path, redis_server, 1)
        loop = asyncio.get_running_loop()
        assert a.redis is not None and a.mgr.holdings is not None and a.coherence is not None
        try:
            await a.sync()
            prepare(a, "a", keys, 1)
            assert await a.mgr.wait_deletes("c", "a") and await a.mgr.wait_deletes("c", "a/1")
            assert a.mgr.commit_stores("c", [("a", [0]), ("a/1", [0])]) == 2
            await a.drain()
            assert len(a.mgr.holdings) == 2
            raw = a.redis._redis
            fk = floor_key(a.redis._key(keys[0]))
            raw.set(fk, pos_text((int(raw.get(fk).split(b"-")[0]) + 1) << 64), px=60_000)  # raised
            await a.mgr.holdings.round(lambda fn, *args: loop.run_in_executor(None, fn, *args))
            assert [a.l1.get(k) for k in keys] == [None, None], "a shard of the overwrite is still served"
            assert len(a.mgr.holdings) == 0 and a.coherence.counters.keep_dropped == 2
        finally:
            a.mgr.close()

    asyncio.run(main())


def test_a_slow_l2_never_holds_up_loads_of_an_overwritten_key_from_l3(tmp_path: Path, redis_server: RedisProc) -> None:
    """C overwrites X (written down to L3). A, whose L2 never held X and whose L2 lane is busy (a
    slow disk), applies C's invalidations: their L2 deletion of X waits behind the busy lane, yet a
    load of X on A reads C's version from L3 at once (L3 is current; only L2 waits for it). Its L2
    is still not read for X meanwhile: a stale copy there is never served."""
    x, y = ObjectKey("tiny", 0, "", bytes([24]) * 32), ObjectKey("tiny", 0, "", bytes([25]) * 32)

    async def main() -> None:
        a = World(tmp_path / "a", redis_url=redis_server.url, disk=True, coherent=True)
        (c,) = hosts(tmp_path, redis_server, 1)
        loop = asyncio.get_running_loop()
        assert a.coherence is not None and a.disk is not None
        gate = None
        try:
            await a.sync()
            await c.sync()
            a.store([y], version=0)  # A's own Y: in L1, L2 and L3
            await a.drain()
            a.evict_l1([y])
            assert await c.store_async([x], version=2, overwrite=True) == 1
            assert await c.store_async([y], version=2, overwrite=True) == 1
            await c.drain()
            gate = a.block("l2")  # A's L2 is slow: its deletions wait
            result = await loop.run_in_executor(None, a.coherence.poll)
            pending = a.mgr.apply(result)
            a.coherence.vouch(result)
            assert pending and a.disk.knows(y) is not None  # (Y's L2 deletion not done yet)
            for sid, key in (("rx", x), ("ry", y)):
                session = await asyncio.wait_for(a.prefetch(sid, [key]), 5)
                assert [bytes(a.l1.view(o)) for o in session.pinned] == [payload(key, 2)], "not C's version from L3"
                a.mgr.end_session("c", sid)
            gate.set()
            await asyncio.gather(*pending)
            assert a.disk.knows(y) is None
        finally:
            if gate is not None:
                gate.set()
            a.mgr.close()
            c.mgr.close()

    asyncio.run(main())

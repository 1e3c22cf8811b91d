"""An L3 that evicts ONE shard of an overwrite's version (its floor and its value: allkeys-lru /
volatile-lru) while servers hold the chunk: a plain store elsewhere then writes that shard with
its own bytes and dedups the other shard (still the overwrite's), and L3 holds a chunk whose
shards are of two versions: an engine loading every shard gets mixed KV. After the holders' next
KEEP round (committer and loaders), no server and no L3 state may yield shard 0 and shard 1 of
different versions for one chunk (a miss is fine: storage.keeping). Real Redis; the storage
harness (tierworld) driven step by step as the server drives it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import tierworld
from helpers import RedisProc
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile
from kvdock.storage.redis import floor_key
from tierworld import NB, World, payload


def l3_version(w: World, key: ObjectKey) -> int | None:
    assert w.redis is not None
    value = w.redis._redis.get(w.redis._key(key))
    return None if value is None else objfile.decode_header(value)[0].version


@pytest.mark.parametrize("committer_holds", [True, False], ids=["committer-holds", "loader-only"])
def test_an_l3_that_evicts_one_shard_of_a_held_overwrite_never_leaves_a_chunk_of_two_versions(
    tmp_path: Path, redis_server: RedisProc, monkeypatch: pytest.MonkeyPatch, committer_holds: bool
) -> None:
    """A overwrites a 2-shard chunk (version 1: held, written down); D loads shard 1 (a loader
    holding that shard alone). L3 evicts shard 0's floor and value. B's plain store of the chunk
    (version 3) writes shard 0 and dedups shard 1 (A's version in L3). After A's and D's next
    rounds: no reader, no server's L1 and no L3 state pairs B's shard 0 with A's shard 1. Also
    with A holding nothing any more (its L1 evicted the chunk): D, the loader of shard 1 alone,
    must see that shard 0 is no longer the overwrite's."""
    # "tiny" in two tensor-parallel shards (each shard's chunk the harness' shape)
    monkeypatch.setattr(tierworld, "GEO", KVGeometry(3, 2, 5, "float32", world_size=2))
    r0, r1 = (
        ObjectKey("tiny", 0, "", bytes([31 + committer_holds]) * 32),
        ObjectKey("tiny", 1, "", bytes([31 + committer_holds]) * 32),
    )
    keys = [r0, r1]

    async def main() -> None:
        a, b, d, e = (World(tmp_path / f"h{i}", redis_url=redis_server.url, disk=False, coherent=True) for i in "abde")
        loop = asyncio.get_running_loop()
        assert a.redis is not None and a.mgr.holdings is not None and d.mgr.holdings is not None
        assert b.coherence is not None
        try:
            for w in (a, b, d, e):
                await w.sync()
            # A's overwrite of both shards: one request, one invalidation, committed all-or-none
            plans = a.mgr.prepare_stores("c", [("a", [r0], None), ("a/1", [r1], None)], NB, True, None, True)
            for plan, key in zip(plans, keys, strict=True):
                for _, obj in plan.slots:
                    a.l1.view(obj)[:] = payload(key, 1)
            assert await a.mgr.wait_deletes("c", "a") and await a.mgr.wait_deletes("c", "a/1")
            assert a.mgr.commit_stores("c", [("a", [0]), ("a/1", [0])]) == 2
            await a.drain()
            assert len(a.mgr.holdings) == 2
            await d.sync()
            session = await d.prefetch("d1", [r1])  # D loads shard 1 alone: it holds it
            assert [bytes(d.l1.view(o)) for o in session.pinned] == [payload(r1, 1)]
            d.mgr.end_session("c", "d1")
            assert len(d.mgr.holdings) == 1
            a_versions = [a.l1.get(k).version for k in keys]  # type: ignore[union-attr]
            if not committer_holds:
                a.evict_l1(keys)
            # L3 evicts shard 0's floor and value (an LRU policy: both cold there)
            raw = a.redis._redis
            assert raw.delete(a.redis._key(r0), floor_key(a.redis._key(r0))) == 2
            # B's plain store of the chunk (its own bytes): shard 0 absent, shard 1 present
            await b.sync()
            b.coherence.recent.clear()  # RECENT_MS is over
            heads = await b.mgr.unindexed_heads(keys)
            # the store path (server.storing) asks with the model's shards: shard 0 waits while
            # shard 1's floor lives (its holders keep it), so B stores no shard beside A's
            absent = [k for k in keys if k not in heads]
            assert r0 in absent and await b.mgr.chains.pending_overwrites(absent, 2) == set(absent)
            # below, a store that does not look at the other shards (a server of an earlier
            # version; or every other floor evicted too): the holders' rounds must still undo it
            pending = await b.mgr.chains.pending_overwrites(absent)
            shards = [("p", [r0], heads), ("p/1", [r1], heads)]
            plans = b.mgr.prepare_stores("c", shards, NB, False, None, True, pending=pending)
            commits = []
            for (sid, _, _), plan, key in zip(shards, plans, keys, strict=True):
                for _, obj in plan.slots:
                    b.l1.view(obj)[:] = payload(key, 3)
                commits.append((sid, [i for i, _ in plan.slots]))
            b.mgr.commit_stores("c", commits)
            await b.drain()
            on_b = b.l1.get(r0)
            assert on_b is not None and b.l1.get(r1) is None
            assert [l3_version(a, k) for k in keys] == [on_b.version, a_versions[1]]  # (the hole: two versions)
            # the holders' next rounds (the committer's and the loader's)
            for w in (a, d):
                assert w.mgr.holdings is not None
                await w.mgr.holdings.round(lambda fn, *args: loop.run_in_executor(None, fn, *args))
                await w.drain()
            for w in (a, b, d, e):
                await w.sync()
            # every server's L1 and a reader on each: shard 0 and shard 1 of one writer (or a miss)
            mixes = (["B", "A"], ["A", "B"])

            def who(key: ObjectKey, data: bytes | None) -> str | None:
                return None if data is None else {payload(key, 1): "A", payload(key, 3): "B"}.get(data, "?")

            for name, w in (("A", a), ("B", b), ("D", d), ("E", e)):
                held = [who(k, w.l1_bytes(k) if w.l1.get(k) is not None else None) for k in keys]
                assert held not in mixes, f"{name}'s L1 holds B's and A's shards of one chunk"
                got = []
                for i, key in enumerate(keys):
                    session = await w.prefetch(f"r{i}", [key])
                    got.append(who(key, bytes(w.l1.view(session.pinned[0])) if session.pinned else None))
                    w.mgr.end_session("c", f"r{i}")
                assert got not in mixes, f"a reader on {name} assembles shards of two versions"
            fresh = World(tmp_path / "fresh", redis_url=redis_server.url, disk=False, coherent=True)
            try:
                await fresh.sync()
                got = []
                for i, key in enumerate(keys):
                    session = await fresh.prefetch(f"f{i}", [key])
                    got.append(who(key, bytes(fresh.l1.view(session.pinned[0])) if session.pinned else None))
                    fresh.mgr.end_session("c", f"f{i}")
                assert got not in mixes, "L3 serves shard 0 and shard 1 of two versions"
            finally:
                fresh.mgr.close()
        finally:
            for w in (a, b, d, e):
                w.mgr.close()

    asyncio.run(main())

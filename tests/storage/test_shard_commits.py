"""A sharded store's commit (issue 28 review R3): StorageManager.commit_stores commits and writes
down one request's shards chunk-major (chunk 0 of every shard, then chunk 1, ...), and a dirty
eviction takes every shard's unwritten object of a chunk together, so neither write-downs nor
dirty evictions (newest first) keep one shard's part of a chunk while another's goes."""

from __future__ import annotations

from pathlib import Path

from kvdock.keys import ObjectKey
from tierworld import NB, World, payload, run


def S(rank: int, i: int) -> ObjectKey:
    return ObjectKey("tiny", rank, "", bytes([i]) * 32)


def _store_shards(w: World, sid: str, chunks: int) -> None:
    work = []
    for rank in (0, 1):
        keys = [S(rank, i) for i in range(chunks)]
        plan = w.mgr.prepare_store("c", f"{sid}/{rank}", keys, NB)
        for i, obj in plan.slots:
            w.l1.view(obj)[:] = payload(keys[i])
        work.append((f"{sid}/{rank}", [i for i, _ in plan.slots]))
    assert w.mgr.commit_stores("c", work) == 2 * chunks


def test_shards_are_committed_chunk_major_and_dirty_evictions_take_a_chunks_shards_together(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        gate = w.block()  # the lane's writer is busy: every object stays dirty
        try:
            _store_shards(w, "s", 3)
            objs = {(r, i): w.l1.get(S(r, i)) for r in (0, 1) for i in range(3)}
            order = sorted(objs, key=lambda k: objs[k].seq)  # type: ignore[union-attr]
            assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]  # chunk-major
            assert all(o is not None and o.dirty and o.unit == objs[(0, o.key.chunk[0])].unit for o in objs.values())
            assert len({o.unit for o in objs.values() if o is not None}) == 3
            with w.l1.dirty_eviction():
                assert w.l1.reserve(S(0, 9), NB) is not None  # one slot: chunk 2 goes, both shards
            assert w.l1.counters.evicted_dirty == 2
            assert [(r, i) for r in (0, 1) for i in range(3) if w.l1.get(S(r, i)) is not None] == [
                (0, 0), (0, 1), (1, 0), (1, 1)
            ]  # fmt: skip
            w.l1.abort(w.l1._reserved[S(0, 9)])
            w.check()
        finally:
            gate.set()

    run(tmp_path, body, slots=6)

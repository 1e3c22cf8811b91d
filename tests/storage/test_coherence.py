"""The fleet's invalidations (storage.coherence) between in-process hosts sharing one real Redis:
fenced write-downs, invalidated L1 copies, the vouching bound on an injected clock, gaps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from pathlib import Path

import pytest
import redis as redis_py

from helpers import RedisProc
from kvdock.errors import WriteFenced
from kvdock.keys import ObjectKey
from kvdock.storage import objfile
from kvdock.storage.coherence import COMMIT_MARGIN_MS, DELETE_SCRIPT, RECENT_MS, STREAM_KEY, Coherence
from kvdock.storage.following import SavedPosition, follow, load_position, save_position
from kvdock.storage.stream import Fence, PollResult, decode_keys, encode_keys, pos_int, pos_text
from tierworld import CHUNK, GEO, SHAPE, World, payload, until
from tierworld import NB as CHUNK_NB
from tierworld import K as WK

A, B = WK(1), WK(2)


def hosts(tmp_path: Path, redis_server: RedisProc, n: int = 2, disk: bool = False) -> list[World]:
    return [World(tmp_path / f"h{i}", redis_url=redis_server.url, disk=disk, coherent=True) for i in range(n)]


def close(*worlds: World) -> None:
    for w in worlds:
        w.mgr.close()


def test_positions_and_entries_round_trip() -> None:
    assert pos_int("1796331648926-3") == (1796331648926 << 64) | 3
    assert pos_int("5-1048577") < pos_int("6-0")  # a sequence past 2**20 stays in its millisecond (review)
    assert pos_text(pos_int("5-1048577")) == "5-1048577"
    assert pos_text(pos_int("1796331648926-3")) == "1796331648926-3"
    assert pos_int("0-0") == 0 and pos_int(b"5-1") > pos_int(b"4-999")
    keys = [ObjectKey("m", 0, "s", bytes([i]) * 32) for i in range(3)] + [ObjectKey("m", 1, "", b"\7" * 32)]
    assert decode_keys(encode_keys(keys)) == keys
    assert decode_keys(b"\xc1garbage") == []


def test_position_is_kept_beside_l2(tmp_path: Path) -> None:
    assert load_position(tmp_path) is None
    save_position(tmp_path, SavedPosition(123 << 20, 7, b"ab12"))
    assert load_position(tmp_path) == SavedPosition(123 << 20, 7, b"ab12")
    (tmp_path / "coherence.pos").write_text("torn")
    assert load_position(tmp_path) is None


def test_shared_l3_never_brings_back_the_version_an_overwrite_replaced(tmp_path: Path, redis_server: RedisProc) -> None:
    """Was a strict xfail: host 1's write-down of the old version, queued before host 2's
    overwrite, landed in L3 after the overwrite deleted it. Now the overwrite's floor fences it."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            gate = host1.block("l3")  # host 1's Redis writer is slow
            host1.store([A], version=0)  # acknowledged on host 1; its write-down is queued
            assert await host2.store_async([A], version=1, overwrite=True) == 1  # acknowledged on host 2
            await host2.drain()
            gate.set()
            await host1.drain()
            assert host1.lanes["l3"].counters.fenced == 1 and host1.lanes["l3"].counters.writes == 0
            host2.evict_l1([A])
            session = await host2.prefetch("r", [A])
            got = [bytes(host2.l1.view(o)) for o in session.pinned]
            host2.mgr.end_session("c", "r")
            assert got == [payload(A, 1)], "host 2 serves the version its acknowledged overwrite replaced"
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_another_hosts_l1_copy_goes_at_its_next_poll_and_nothing_is_served_past_the_bound(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            host1.store([A, B], version=0)
            await host1.drain()  # (written down first: one settled after the overwrite drops it at once)
            assert host1.mgr.lookup_l1([A, B]) == 2
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            assert host1.mgr.lookup_l1([A, B]) == 2  # within the bound: host 1 has not polled yet
            host1.now = 0.1  # the bound has passed since host 1's last poll was sent
            assert host1.mgr.lookup_l1([A, B]) == 0 and not host1.mgr.vouched()
            result = await host1.sync()
            assert [len(e.keys) for e in result.entries] == [1, 1] and not result.lost
            assert host1.mgr.vouched() and host1.l1.get(A) is None
            assert host1.l1.get(B) is not None  # B's parent is gone: the chain stops before it
            assert host1.mgr.lookup_l1([A, B]) == 0
            assert host1.coherence is not None and host1.coherence.counters.dropped == 1
            await host2.sync()  # its own entries: its new version stays
            assert host2.l1_bytes(A) == payload(A, 1)
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_a_plain_store_committed_before_the_host_knew_of_an_overwrite_is_superseded(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            host1.store([A], version=0)  # concurrent: host 1 has not seen the overwrite yet
            await host1.sync()
            assert host1.l1.get(A) is None  # ordered before the overwrite, as L3's fence orders it
            # R-FLEET: host 2's overwrite may not be in L3 yet: a plain store here is in flight
            plan = host1.mgr.prepare_store("c", "soon", [A], CHUNK_NB)
            assert (plan.slots, plan.in_flight) == ([], 1) and host1.coherence is not None
            assert host1.coherence.recently_overwritten(A) and not host1.coherence.recently_overwritten(B)
            host1.now += RECENT_MS / 1000
            assert not host1.coherence.recently_overwritten(A)
            host1.store([A], version=2)  # after: committed (this harness reads no L3 heads: no dedup)
            await host1.sync()
            await host1.drain()
            # but L3 holds host 2's overwrite under its live floor (host 2 holds it: storage.keeping):
            # the plain write-down is refused and host 1 drops its copy (R-KEEP 1), one truth
            assert host1.l1.get(A) is None and host1.lanes["l3"].counters.fenced == 2  # (v0's, then v2's)
            session = await host1.prefetch("r", [A])
            assert [bytes(host1.l1.view(o)) for o in session.pinned] == [payload(A, 1)]
            host1.mgr.end_session("c", "r")
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_entries_lost_past_a_hosts_position_drop_everything(tmp_path: Path, redis_server: RedisProc) -> None:
    async def main() -> None:
        (host1,) = hosts(tmp_path, redis_server, n=1, disk=True)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            await host1.sync()
            host1.store([A], version=0)
            await host1.drain()
            assert host1.disk is not None and host1.disk.knows(A) is not None
            for _ in range(3):  # entries this host never reads: trimmed away
                raw.xadd(STREAM_KEY, {b"k": encode_keys([B])})
            raw.xtrim(STREAM_KEY, maxlen=1, approximate=False)
            result = await host1.sync()
            assert result.lost and host1.l1.get(A) is None and host1.disk.knows(A) is None
            assert host1.coherence is not None and host1.coherence.counters.full_drops == 1
            raw.xadd(STREAM_KEY, {b"k": encode_keys([B])})
            again = await host1.sync()
            assert not again.lost and len(again.entries) == 1
        finally:
            close(host1)
            raw.close()

    asyncio.run(main())


def test_a_write_issued_while_the_position_is_old_is_refused(tmp_path: Path, redis_server: RedisProc) -> None:
    """The fence's time is L3's clock at the host's last complete poll, not the moment the write
    leaves: a host whose poller stalled (its position stale for longer than ISSUE_LIMIT_MS, so
    that a floor may have expired) cannot write down (review: a stalled poller's writes passed)."""

    async def main() -> None:
        (host1,) = hosts(tmp_path, redis_server, n=1)
        try:
            await host1.sync()
            coherence = host1.coherence
            assert isinstance(coherence, Coherence) and coherence._vouched_ms is not None
            coherence._vouched_ms -= 20_000  # the last complete poll was 20 s ago, by L3's clock
            host1.store([A], version=0)
            await host1.drain()
            assert host1.lanes["l3"].counters.fenced == 1
            await host1.sync()
            host1.store([B], version=0)
            await host1.drain()
            assert host1.lanes["l3"].counters.writes == 1
        finally:
            close(host1)

    asyncio.run(main())


def test_a_stream_recreated_by_an_l3_restart_is_a_gap(tmp_path: Path, redis_server: RedisProc) -> None:
    """Review: host 1 misses an overwrite; L3 restarts empty; another overwrite since; host 1's
    next poll saw a young stream with nothing to tell it apart: its incarnation does."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            assert await host2.store_async([B], version=1, overwrite=True) == 1  # some history
            await host1.sync()
            await host2.sync()
            host1.store([A], version=0)
            assert await host2.store_async([A], version=1, overwrite=True) == 1  # host 1 is paused
            raw.flushall()  # L3 restarted empty: the stream is gone
            assert await host2.store_async([B], version=2, overwrite=True) == 1  # a young stream
            result = await host1.sync()
            assert result.lost and host1.l1.get(A) is None
        finally:
            close(host1, host2)
            raw.close()

    asyncio.run(main())


def test_after_a_gap_l2_is_not_read_before_its_clear_is_done(tmp_path: Path, redis_server: RedisProc) -> None:
    """Review: the gap's L2 clear waits behind the L2 writer; a retrieve meanwhile loaded the
    replaced version from L2 (and kept it in L1 with a post-gap epoch). L2 is not read until the
    clear is done."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        host1.mgr.close()
        host1 = World(tmp_path / "h1-disk", redis_url=redis_server.url, disk=True, coherent=True)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            await host1.sync()
            await host2.sync()
            host1.store([A], version=0)
            await host1.drain()
            host1.evict_l1([A])
            assert host1.disk is not None and host1.disk.knows(A) is not None
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            for _ in range(3):
                raw.xadd(STREAM_KEY, {b"k": encode_keys([B])})
            raw.xtrim(STREAM_KEY, maxlen=1, approximate=False)  # host 1's position: trimmed away
            gate = host1.block("l2")  # host 1's L2 writer is busy (a backlog of write-downs)
            assert host1.coherence is not None
            result = await asyncio.get_running_loop().run_in_executor(None, host1.coherence.poll)
            pending = host1.mgr.apply(result)
            host1.coherence.vouch(result)
            assert result.lost and host1.mgr.vouched()
            session = await host1.prefetch("r", [A])
            got = [bytes(host1.l1.view(o)) for o in session.pinned]
            host1.mgr.end_session("c", "r")
            gate.set()
            await asyncio.gather(*pending)
            assert payload(A, 0) not in got, "host 1 served the replaced version from L2 after the gap"
            assert host1.l1.get(A) is None or host1.l1_bytes(A) != payload(A, 0)
            assert host1.disk.knows(A) is None
        finally:
            close(host1, host2)
            raw.close()

    asyncio.run(main())


def test_a_gap_while_a_superseded_load_is_in_flight_is_applied(tmp_path: Path, redis_server: RedisProc) -> None:
    """Review: a load superseded by an entry (its slot detached) was detached again by a gap,
    which raised inside the follower and ended it for good."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            await host1.sync()
            await host2.sync()
            host2.store([A], version=0)
            await host2.drain()
            gate = host1.block("l3", which=1)  # host 1's L3 reader is slow
            session = host1.mgr.open_retrieve("c", "r", [A])
            job = host1.mgr.start_prefetch(session)
            await until(lambda: host1.l1.reservation(A) is not None)  # the load is in flight
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            await host1.sync()  # supersedes the load: its slot is detached
            for _ in range(3):
                raw.xadd(STREAM_KEY, {b"k": encode_keys([B])})
            raw.xtrim(STREAM_KEY, maxlen=1, approximate=False)
            assert (await host1.sync()).lost
            gate.set()
            assert job is not None
            await asyncio.wait_for(job.done.wait(), 10)
            assert session.pinned == []  # the superseded load is thrown away
            host1.mgr.end_session("c", "r")
        finally:
            close(host1, host2)
            raw.close()

    asyncio.run(main())


def test_concurrent_overwrites_leave_l3_with_the_one_every_l1_keeps(tmp_path: Path, redis_server: RedisProc) -> None:
    """Review: two overwrites of one key on two hosts; the host whose second entry came first
    drops its version when it applies the other's, so L3 must refuse that version's write-down
    too: the floors are raised to each overwrite's second entry."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            assert host1.redis is not None and host1.coherence is not None
            first = host1.redis.delete_keys([A])  # host 1's overwrite: E1a, E2a
            second = host2.redis.delete_keys([A]) if host2.redis is not None else 0  # then host 2's: E1b, E2b
            assert 0 < first < second
            await host1.sync()
            header = objfile.encode_header(A, "float32", SHAPE, memoryview(payload(A, 1)), 1, 0, GEO.digest(CHUNK))
            issued, incarnation = host1.coherence.fence(first)[1:]
            with pytest.raises(WriteFenced):  # host 1's version, issued before it applied E2b
                host1.redis.write_from(A, header, memoryview(payload(A, 1)), Fence(first, issued, incarnation))
            fence = Fence(second, issued, incarnation)
            assert host1.redis.write_from(A, header, memoryview(payload(A, 2)), fence) > 0
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_a_store_prepared_before_an_invalidation_is_not_committed_after_it(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """Review: a plain store reserved before its host applied an overwrite of the key elsewhere,
    committed after, survived with a fresh epoch; it is ordered before the overwrite instead."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            plan = host1.mgr.prepare_store("c", "s", [A, B], 3840)
            for i, obj in plan.slots:
                host1.l1.view(obj)[:] = payload([A, B][i], 0)
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            await host1.sync()
            assert host1.mgr.commit_store("c", "s", [0, 1]) == 1  # B only
            assert host1.l1.get(A) is None and host1.l1_bytes(B) == payload(B, 0)
            host1.check()
        finally:
            close(host1, host2)

    asyncio.run(main())


@pytest.mark.parametrize("bad", [b"", b"\x93\xa1m"])
def test_an_entry_that_is_not_an_invalidation_is_ignored(bad: bytes) -> None:
    assert decode_keys(bad) == []


def test_an_overwrites_reservations_are_never_superseded(tmp_path: Path, redis_server: RedisProc) -> None:
    """Regression (the soak): a poll that applied the overwrite's own entry before ``publish`` had
    marked it as this server's (the replica WAIT in between) superseded the overwrite's own
    reservations, and its commit stored nothing. An overwrite's reservations are the new version
    whatever of its own entries come meanwhile; of two overwrites, the later second entry wins
    everywhere (here host 1's: host 2's came first)."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            gate = host1.block("l3")  # host 1's deletions wait: its entries come after host 2's
            plan = host1.mgr.prepare_store("c", "s", [A, B], 3840, overwrite=True)
            for i, obj in plan.slots:
                host1.l1.view(obj)[:] = payload([A, B][i], 3)
            assert await host2.store_async([A], version=1, overwrite=True) == 1  # entries host 1 sees first
            gate.set()
            assert await host1.mgr.wait_deletes("c", "s")
            assert host1.coherence is not None
            host1.coherence.own.clear()  # as if its own entries were not marked yet
            await host1.sync()
            assert host1.mgr.commit_store("c", "s", [0, 1]) == 2
            assert host1.l1_bytes(A) == payload(A, 3)
            await host2.sync()
            assert host2.l1.get(A) is None  # its version, replaced by host 1's later one
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_a_floor_that_is_not_a_position_refuses_writes_and_overwrites_replace_it(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """Review: junk where a floor is kept made every script on the key fail, marked L3 down and
    refused every overwrite of it for good."""

    async def main() -> None:
        (host1,) = hosts(tmp_path, redis_server, n=1)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            await host1.sync()
            assert host1.redis is not None and host1.coherence is not None
            final = host1.redis._key(A)
            raw.set(final + b":f", b"junk")
            header = objfile.encode_header(A, "float32", SHAPE, memoryview(payload(A, 1)), 1, 0, GEO.digest(CHUNK))
            fence = host1.coherence.fence(host1.coherence.position)
            with pytest.raises(WriteFenced):
                host1.redis.write_from(A, header, memoryview(payload(A, 1)), fence)
            assert host1.redis.up()
            epoch = host1.redis.delete_keys([A])
            assert epoch > 0 and pos_int(raw.get(final + b":f")) == epoch
            assert host1.redis.write_from(A, header, memoryview(payload(A, 1)), fence._replace(position=epoch)) > 0
        finally:
            close(host1)
            raw.close()

    asyncio.run(main())


def test_a_host_that_does_not_vouch_reads_the_shared_tier_only(tmp_path: Path, redis_server: RedisProc) -> None:
    """Past the bound without a poll, L1 and L2 are not read, but L3 (current: fenced, overwrites
    deleted before their acknowledgement) still is."""

    async def main() -> None:
        world = World(tmp_path / "h", redis_url=redis_server.url, disk=True, coherent=True)
        try:
            await world.sync()
            world.store([A, B], version=0)
            await world.drain()
            world.now = 1.0  # no poll for longer than the bound
            assert world.mgr.lookup_l1([A, B]) == 0
            assert await world.mgr.count([A, B], world.mgr.l1_hit([A, B])) == 2  # from L3's heads
            l3_hits = world.lanes["l3"].counters.hits
            session = await world.prefetch("r", [A, B])
            assert [bytes(world.l1.view(o)) for o in session.pinned] == [payload(A, 0), payload(B, 0)]
            world.mgr.end_session("c", "r")
            assert world.lanes["l3"].counters.hits == l3_hits + 2 and world.lanes["l2"].counters.hits == 0
        finally:
            close(world)

    asyncio.run(main())


def test_the_first_poll_after_an_outage_calls_recovered_once(redis_server: RedisProc) -> None:
    """CI flake: a server idle through an L3 restart kept its tier down for its probe's backoff
    (seconds) after its polls got through again; the poll's success now lets the probe come at once."""

    async def main() -> None:
        raw = redis_py.Redis.from_url(redis_server.url, socket_timeout=1)
        coherence = Coherence(lambda: raw, bound_s=0.05)
        failures: list[BaseException] = []
        recoveries: list[int] = []

        def apply(result: PollResult) -> list[Awaitable[object]]:
            coherence.applied(result)
            return []

        task = asyncio.create_task(
            follow(coherence, apply, failures.append, lambda _u: None, recovered=lambda: recoveries.append(1))
        )
        try:
            await until(lambda: coherence.started and coherence.vouched())
            assert recoveries == [] and failures == []
            redis_server.stop()
            await until(lambda: coherence.failing)
            await until(lambda: coherence.counters.poll_errors >= 3)
            assert len(failures) == 1 and isinstance(failures[0], redis_py.ConnectionError) and recoveries == []
            redis_server.start()
            await until(lambda: not coherence.failing)
            await until(lambda: coherence.counters.polls >= 3)
            assert recoveries == [1] and len(failures) == 1  # once per outage
        finally:
            task.cancel()
            raw.close()

    asyncio.run(main())


def _l3_bytes(host: World, key: ObjectKey) -> bytes | None:
    assert host.redis is not None
    out = memoryview(bytearray(CHUNK_NB))
    return bytes(out) if host.redis.read_into(key, out, GEO, CHUNK) is not None else None


def test_an_overwrites_second_step_deletes_what_an_earlier_one_wrote_meanwhile(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """R-LANE follow-up: host 2's overwrite ran entirely between host 1's two steps (E1a < E1b <
    E2b < E2a), and host 2 wrote its version to L3 past its floor E2b. Host 1's E2a is the later:
    its version is what every server keeps. Its second step only raised the floor, so L3 served
    host 2's version after host 1 acknowledged, until host 1's own write-down landed (for ever if
    that one failed). The second step deletes too."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        assert host1.redis is not None
        entered, go = threading.Event(), threading.Event()
        real_floor = host1.redis._floor
        calls: list[int] = []

        def floor(final: bytes, position: int) -> None:
            real_floor(final, position)
            calls.append(position)
            if len(calls) == 1:  # between host 1's E1 step and its E2
                entered.set()
                go.wait(20)

        host1.redis._floor = floor  # type: ignore[method-assign]
        try:
            await host1.sync()
            await host2.sync()
            plan = host1.mgr.prepare_store("c", "o", [A], CHUNK_NB, overwrite=True)
            host1.l1.view(plan.slots[0][1])[:] = payload(A, 3)
            deletes = asyncio.create_task(host1.mgr.wait_deletes("c", "o"))
            await until(entered.is_set)
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            await host2.drain()
            assert _l3_bytes(host2, A) == payload(A, 1)  # written past its own floor E2b
            go.set()
            assert await deletes
            assert len(calls) == 2 and calls[1] > calls[0]
            assert _l3_bytes(host1, A) is None  # host 1's E2a came later: host 2's version is gone
            assert host1.mgr.commit_store("c", "o", [0]) == 1
            await host1.drain()
            await host2.sync()
            assert host2.l1.get(A) is None  # E2a > its epoch E2b
            assert _l3_bytes(host1, A) == payload(A, 3) and host1.l1_bytes(A) == payload(A, 3)
        finally:
            go.set()
            close(host1, host2)

    asyncio.run(main())


def test_a_late_step_of_an_earlier_overwrite_never_deletes_a_later_ones_value(redis_server: RedisProc) -> None:
    """The floor script deletes only when it raises the floor: a value written past a later floor
    (another overwrite's later entry) is that overwrite's version and stays."""
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        value, floor = b"kvdock:test:value", b"kvdock:test:floor"
        raw.set(value, b"v-later")
        raw.set(floor, pos_text(pos_int("200-0")))
        assert raw.eval(DELETE_SCRIPT, 2, value, floor, "100-0", 60_000) == 0  # earlier: nothing happens
        assert raw.get(value) == b"v-later" and raw.get(floor) == b"200-0"
        assert raw.eval(DELETE_SCRIPT, 2, value, floor, "300-0", 60_000) == 1  # later: raises and deletes
        assert raw.get(value) is None and raw.get(floor) == b"300-0"
        raw.set(floor, b"garbage")  # not a position: replaced, the value deleted
        raw.set(value, b"v")
        assert raw.eval(DELETE_SCRIPT, 2, value, floor, "50-0", 60_000) == 1 and raw.get(floor) == b"50-0"
    finally:
        raw.close()


def test_an_overwrite_that_comes_to_its_commit_too_late_is_not_committed(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """R-FLEET: other servers refuse plain stores of an overwritten key for RECENT_MS after its
    entries; an overwrite committed later than that (its server paused, a slow client copy)
    could find one kept elsewhere for good. It is not committed (a False store, the key a miss)."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            for sid, late in (("in-time", False), ("late", True)):
                plan = host1.mgr.prepare_store("c", sid, [A], CHUNK_NB, overwrite=True)
                host1.l1.view(plan.slots[0][1])[:] = payload(A, 5)
                assert await host1.mgr.wait_deletes("c", sid)
                assert host1.coherence is not None
                await host1.sync()  # (its clock estimate of L3: from its last poll on)
                host1.now += (RECENT_MS - COMMIT_MARGIN_MS) / 1000 + (0.5 if late else -1.0)
                assert host1.mgr.commit_store("c", sid, [0]) == (0 if late else 1)
                assert (host1.l1.get(A) is None) == late
            await host2.sync()
            assert host2.coherence is not None and host2.coherence.recently_overwritten(A)
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_a_server_that_starts_during_another_ones_overwrite_knows_its_keys_were_overwritten_lately(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """R-FLEET: a server started (or restarted on its L2, its kept position past the entries)
    while another's overwrite was not yet committed accepted a plain store of its keys. Its
    first poll (and one after a gap) reads the last RECENT_MS of the stream."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        try:
            await host1.sync()
            await host2.sync()
            assert await host2.store_async([A], version=1, overwrite=True) == 1
            await host1.sync()  # (applied by host 1 as usual: its position is past the entries)
            late = World(tmp_path / "late", redis_url=redis_server.url, coherent=True)
            resumed = World(tmp_path / "resumed", redis_url=redis_server.url, coherent=True)
            assert host1.coherence is not None and late.coherence is not None and resumed.coherence is not None
            resumed.coherence.position, resumed.coherence.consumed = host1.coherence.position, host1.coherence.consumed
            resumed.coherence.incarnation, resumed.coherence.resume = host1.coherence.incarnation, True
            try:
                for w in (late, resumed):
                    result = await w.sync()
                    assert result.entries == [] and [k for e in result.recent for k in e.keys] == [A, A]
                    assert w.coherence is not None and w.coherence.recently_overwritten(A)
                    plan = w.mgr.prepare_store("c", "plain", [A, B], CHUNK_NB)
                    assert (plan.slots, plan.in_flight) == ([], 2)
                    w.now += RECENT_MS / 1000
                    assert not w.coherence.recently_overwritten(A)
            finally:
                close(late, resumed)
        finally:
            close(host1, host2)

    asyncio.run(main())


def test_a_plain_store_waits_for_an_overwrite_elsewhere_that_is_not_in_l3_yet(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """R-FLEET's residual case: host 1's overwrite is committed but its write-down to L3 waits
    (a backlog) past RECENT_MS; host 2 no longer holds the key and no longer counts it as
    overwritten lately. Its plain store must not keep other bytes than the overwrite: the key's
    floor is live with no value in L3 (storage.redis.floored), so the store leaves it in flight."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server)
        assert host1.redis is not None
        go = threading.Event()
        real_write = host1.redis.write_from

        def slow_write(key: ObjectKey, *args: object, **kw: object) -> int:
            if key == A:
                go.wait(20)
            return real_write(key, *args, **kw)  # type: ignore[arg-type]

        host1.redis.write_from = slow_write  # type: ignore[method-assign]
        try:
            await host1.sync()
            await host2.sync()
            assert await host1.store_async([A], version=1, overwrite=True) == 1  # its L3 write waits
            await host2.sync()
            assert host2.coherence is not None
            host2.now += RECENT_MS / 1000
            assert not host2.coherence.recently_overwritten(A) and host2.l1.get(A) is None
            assert await host2.mgr.chains.pending_overwrites([A, B]) == {A}
            plan = host2.mgr.prepare_store("c", "plain", [A], CHUNK_NB, pending={A})
            assert (plan.slots, plan.in_flight) == ([], 1)
            go.set()
            await host1.drain()
            # written: a plain store's heads find it (it dedups; floored() is asked only of the keys
            # the heads did not find, and a live floor there means pending: R-KEEP 1)
            assert A in await host2.mgr.unindexed_heads([A])
            assert _l3_bytes(host2, A) == payload(A, 1)
        finally:
            go.set()
            close(host1, host2)

    asyncio.run(main())

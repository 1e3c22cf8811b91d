"""kvdock.storage.drain: the shutdown drain, in-process over a real L1Store, StorageManager, DiskTier
and a real redis-server. It finishes every queued write-down with no time limit, logs what is left
while it runs and, per tier, what was done and dropped; a second signal (``abort``) drops the rest,
counted; a tier that is down is never waited for, and what it could not take is dropped and counted.
(The real server's SIGTERM behaviour: tests/server/test_shutdown_drain.py.)"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path

import pytest

from helpers import RedisProc
from kvdock.storage.drain import drain_lanes
from tierworld import CHUNK, FILE, GEO, NB, K, World, payload, run

KEYS = [K(i) for i in range(1, 4)]


def test_drain_waits_for_every_write_down_however_long_and_logs_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        gate = w.block()  # the disk is "slow": nothing is written until the gate opens
        w.store(KEYS)
        with caplog.at_level(logging.INFO, "kvdock.storage.drain"):
            task = asyncio.create_task(drain_lanes(list(w.lanes.values()), asyncio.Event(), every_s=0.05))
            await asyncio.sleep(0.5)
            assert not task.done(), "the drain gave up on queued write-downs"
            gate.set()
            assert await asyncio.wait_for(task, 30) is True
        assert w.lanes["l2"].idle and len(w.disk) == 3
        for k in KEYS:
            out = memoryview(bytearray(NB))
            assert w.disk.read_into(k, out, GEO, CHUNK) is not None and bytes(out) == payload(k)
        text = caplog.text
        assert f"draining write-downs before exit (l2: 3 chunk(s), {3 * NB} bytes)" in text
        assert f"draining write-downs: l2: 3 chunk(s), {3 * NB} bytes left" in text  # progress while held
        done = rf"l2: 3 write-down\(s\) done \({3 * FILE} bytes written\) in [\d.]+ s of shutdown drain"
        assert re.search(done, text)
        assert "dropped" not in text and "skipped" not in text

    run(tmp_path, body)


def test_drain_aborted_drops_the_queued_write_downs_and_counts_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        gate = w.block()
        w.store(KEYS)  # K1 in flight (held behind the gate), K2 and K3 queued
        abort = asyncio.Event()
        with caplog.at_level(logging.INFO, "kvdock.storage.drain"):
            task = asyncio.create_task(w.mgr.drain(abort))
            await asyncio.sleep(0.1)
            abort.set()
            assert await asyncio.wait_for(task, 10) is False
        assert f"l2: drain aborted by a second signal: 2 write-down(s) ({2 * NB} bytes) dropped" in caplog.text
        assert lane.counters.writes_skipped == 2
        gate.set()  # the write in flight still finishes
        assert await lane.drain(10) and len(w.disk) == 1 and w.disk.knows(K(1)) is not None

    run(tmp_path, body)


def test_a_tier_that_goes_down_during_the_drain_is_not_waited_for_and_its_drops_are_counted(
    tmp_path: Path, redis_server: RedisProc, caplog: pytest.LogCaptureFixture
) -> None:
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # Redis hangs: the first write times out (2 s)
    try:

        async def body(w: World) -> None:
            assert w.redis is not None
            w.store(KEYS)
            with caplog.at_level(logging.INFO, "kvdock.storage.drain"):
                assert await asyncio.wait_for(w.mgr.drain(asyncio.Event()), 30) is True
            lane = w.lanes["l3"]
            assert lane.idle and not w.redis.up()
            assert (lane.counters.writes, lane.counters.write_errors, lane.dropped_down) == (0, 1, 2)
            text = caplog.text
            assert f"l3: 2 write-down(s) ({2 * NB} bytes) dropped: the tier is down" in text
            assert "l3: 1 write-down(s) failed" in text
            assert "l3: 0 write-down(s) done" in text

        run(tmp_path, body, disk=False, redis_url=redis_server.url)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


"""A clean shutdown (SIGTERM, SIGINT) never drops acknowledged chunks silently, with real processes: it
writes down the whole backlog however long that takes (a slow disk: KVDOCK_FAULT_L2_WRITE_DELAY_S),
logging progress; a second signal aborts, and the log says how many were dropped; a tier that is
down (Redis hung) is not waited for, and what it could not take is dropped and counted."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, RedisProc, ServerProc, make_kv, make_tokens, wait_for

SLOW_DISK = {"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.2"}  # each L2 write sleeps 0.2 s first


def _store(srv: ServerProc, chunks: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    kv, tokens = make_kv(chunks * CHUNK, seed=seed), make_tokens(chunks * CHUNK, start=seed * 100_000)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store_chunks(c, kv, tokens).stored_chunks == chunks  # acknowledged
    return kv, tokens


def test_sigterm_writes_down_a_backlog_of_over_30_s_before_exit(
    make_server: Callable[..., ServerProc], tmp_path
) -> None:
    """170 chunks acknowledged, 0.2 s per L2 write: SIGTERM waits the ~34 s (it once gave up after
    30 s and dropped what was left), and all 170 come back after a restart, byte for byte."""
    n, disk = 170, tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk), env=SLOW_DISK)
    kv, tokens = _store(srv, n, seed=1)
    assert srv.get("/status")["tiers"]["writeback_backlog_bytes"] > 0  # (what an operator watches)
    assert srv.stop(signal.SIGTERM, timeout=300) == 0
    again = make_server("--disk-dir", str(disk))
    assert f"{n} object(s) found" in again.log(), again.log()
    with kvd.connect(again.url, again.http_url, MODEL, timeout=10) as c:
        assert kvd.lookup(c, tokens) == n * CHUNK
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv)
    log = srv.log()
    assert "draining write-downs before exit (l2: " in log
    assert re.search(r"draining write-downs: l2: \d+ chunk\(s\), \d+ bytes left", log), log  # progress
    done = re.search(r"l2: (\d+) write-down\(s\) done \(\d+ bytes written\) in ([\d.]+) s of shutdown drain", log)
    assert done is not None and int(done[1]) > 0, log
    assert float(done[2]) > 30, log  # past where it once gave up
    assert "dropped" not in log and "skipped" not in log, log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_aborts_the_drain_and_the_log_says_how_many_were_dropped(
    make_server: Callable[..., ServerProc], tmp_path, sig: signal.Signals
) -> None:
    n, disk = 40, tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk), env=SLOW_DISK)
    kv, tokens = _store(srv, n, seed=2)
    srv.proc.send_signal(sig)
    wait_for(lambda: "draining write-downs before exit" in srv.log(), "the drain to start", timeout=30)
    srv.proc.send_signal(sig)
    assert srv.proc.wait(60) == 0
    log = srv.log()
    assert f"{sig.name} again: dropping the write-downs not done yet" in log
    aborted = re.search(r"l2: drain aborted by a second signal: (\d+) write-down\(s\) \((\d+) bytes\) dropped", log)
    assert aborted is not None, log
    dropped = int(aborted[1])
    assert 0 < dropped < n and int(aborted[2]) == dropped * kv[:, :, :CHUNK].numel() * kv.element_size()
    # every chunk not dropped was written (the one in flight finished): exactly that prefix is back
    again = make_server("--disk-dir", str(disk))
    with kvd.connect(again.url, again.http_url, MODEL, timeout=10) as c:
        kept = (n - dropped) * CHUNK
        assert kvd.lookup(c, tokens) == kept
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv[:, :, :kept])


def test_a_hung_redis_does_not_hold_up_the_shutdown_and_its_drops_are_counted(
    make_server: Callable[..., ServerProc], redis_server: RedisProc
) -> None:
    n = 20
    srv = make_server("--no-disk", "--redis-url", redis_server.url, "--redis-timeout-s", "1")
    # Redis answers reads (the store's dedup lookup) but holds every write: the first write-down
    # waits out the client's timeout (--redis-timeout-s: 1 s here), then the tier is down
    cli = ["redis-cli", "-p", str(redis_server.port)]
    assert subprocess.run([*cli, "CLIENT", "PAUSE", "120000", "WRITE"], capture_output=True, text=True).stdout == "OK\n"
    try:
        _store(srv, n, seed=3)
        t0 = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=60) == 0
        assert time.monotonic() - t0 < 30
    finally:
        subprocess.run([*cli, "CLIENT", "UNPAUSE"], capture_output=True, check=True)
    log = srv.log()
    failed = re.search(r"l3: (\d+) write-down\(s\) failed", log)
    down = re.search(r"l3: (\d+) write-down\(s\) \((\d+) bytes\) dropped: the tier is down", log)
    assert failed is not None and down is not None, log
    assert int(failed[1]) == 1 and int(down[1]) == n - 1, log

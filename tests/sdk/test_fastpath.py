"""kvdock.sdk._fastpath: lookups and retrieves answered from the pool directory, against real servers.

What must hold: the same answers and bytes as through the server, never a stale or mixed version
(overwrites, restarts, concurrent writers in other processes), misses final only where no lower
tier could add to them, and the server still counting the reads and keeping their chunks recently
used."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, GEOMETRY, MODEL, make_kv, make_tokens, start_server, wait_written
from kvdock.protocol import messages as m
from kvdock.sdk._handshake import watch_creator
from kvdock.shm import PoolSegment
from kvdock.transport.client import ControlClient


def requests(srv, op: str) -> float:
    return srv.metric(f'kvdock_requests_total{{op="{op}"}}', 0.0)


def served(srv) -> tuple[float, float]:
    """How many Lookup and PrepareRetrieve requests the server got."""
    return requests(srv, "Lookup"), requests(srv, "PrepareRetrieve")


def wait_metric(srv, name: str, want: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := srv.metric(name, 0.0)) != want:
        assert time.monotonic() < deadline, f"{name} = {got}, want {want}"
        time.sleep(0.02)


def test_a_full_hit_is_read_without_asking_the_server(server) -> None:
    tokens = make_tokens(4 * CHUNK)
    kv = make_kv(4 * CHUNK, seed=1)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
        before = served(server)
        assert kvd.lookup(c, tokens) == 4 * CHUNK
        assert kvd.lookup(c, [*tokens, 1, 2, 3]) == 4 * CHUNK  # a partial tail is not asked for
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, kv)
        out = torch.full((2, GEOMETRY["num_layers"], 5 * CHUNK, 16), 7.0, dtype=torch.bfloat16)
        view = kvd.retrieve(c, tokens, out=out)
        assert view is not None and view.data_ptr() == out.data_ptr() and torch.equal(view, kv)
        assert (out[:, :, 4 * CHUNK :] == 7).all()  # nothing past the hit written
        part = kvd.retrieve(c, tokens, layers=range(1, 3), start=2 * CHUNK)
        assert part is not None and torch.equal(part, kv[:, 1:3, 2 * CHUNK :])
        got_chunks: dict[int, torch.Tensor] = {}

        class Sink:
            def take(self, index: int, src: torch.Tensor) -> None:
                got_chunks[index] = src.clone()

        assert kvd.retrieve_into(c, tokens, Sink()) == 4 * CHUNK
        assert torch.equal(torch.cat([got_chunks[i] for i in range(4)], dim=2), kv)
        assert served(server) == before  # not one request
    # closing sent what was held back: the server counted every read as if it had served it
    wait_metric(server, 'kvdock_fast_reads_total{op="retrieve"}', 4.0)
    assert server.metric('kvdock_fast_reads_total{op="lookup"}') == 2.0
    assert server.metric("kvdock_retrieves_total") == 4.0
    assert server.metric("kvdock_lookups_total") == 2.0
    layer_bytes = kv[:, :1, :CHUNK].numel() * 2
    whole = 3 * 4 * layer_bytes  # three layers of four chunks
    assert server.metric("kvdock_retrieved_bytes_total") == 3 * whole + 2 * 2 * layer_bytes
    assert server.metric("kvdock_hit_tokens_total") == 6 * 4 * CHUNK


def test_a_miss_is_answered_locally_only_when_no_lower_tier_could_add_to_it(make_server, tmp_path: Path) -> None:
    kv = make_kv(2 * CHUNK, seed=2)
    tokens = make_tokens(4 * CHUNK, start=1000)
    no_tiers = make_server()
    with_l2 = make_server("--disk-dir", str(tmp_path / "l2"))
    for srv, local in ((no_tiers, True), (with_l2, False)):
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            assert kvd.store(c, kv, tokens[: 2 * CHUNK])
            lookups, retrieves = served(srv)
            assert kvd.lookup(c, tokens) == 2 * CHUNK
            got = kvd.retrieve(c, tokens)
            assert got is not None and torch.equal(got, kv)
            assert kvd.lookup(c, make_tokens(CHUNK, start=90_000)) == 0
            assert kvd.retrieve(c, make_tokens(CHUNK, start=90_000)) is None
            asked = (2, 2) if not local else (0, 0)
            assert served(srv) == (lookups + asked[0], retrieves + asked[1]), srv
    # what only L2 holds is found through the server
    with kvd.connect(with_l2.url, with_l2.http_url, MODEL, timeout=10) as c:
        wait_written(with_l2, "l2", 2)
        request = urllib.request.Request(with_l2.http_url + "/admin/clear?tier=l1", method="POST")
        urllib.request.urlopen(request, timeout=10).read()
        lookups, retrieves = served(with_l2)
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, kv)
        assert served(with_l2) == (lookups, retrieves + 1)


def test_salts_and_models_are_separate_in_the_directory(make_server) -> None:
    srv = make_server()
    kvd.register_model(srv.url, srv.http_url, "other", dtype="bfloat16", **GEOMETRY, timeout=10)
    tokens = make_tokens(2 * CHUNK, start=2000)
    kv = make_kv(2 * CHUNK, seed=3)
    with kvd.connect(srv.url, srv.http_url, MODEL) as c, kvd.connect(srv.url, srv.http_url, "other") as o:
        assert kvd.store(c, kv, tokens, cache_salt="tenant-a")
        assert kvd.lookup(c, tokens) == 0 and kvd.retrieve(c, tokens) is None
        assert kvd.lookup(c, tokens, cache_salt="tenant-b") == 0
        assert kvd.lookup(o, tokens, cache_salt="tenant-a") == 0 and kvd.retrieve(o, tokens, "tenant-a") is None
        got = kvd.retrieve(c, tokens, "tenant-a")
        assert got is not None and torch.equal(got, kv)
        assert served(srv) == (0, 0)


def test_an_overwrite_is_seen_by_every_client_once_it_returns(server) -> None:
    tokens = make_tokens(3 * CHUNK, start=3000)
    with (
        kvd.connect(server.url, server.http_url, MODEL) as reader,
        kvd.connect(server.url, server.http_url, MODEL) as w,
    ):
        for version in range(5):
            kv = make_kv(3 * CHUNK, seed=100 + version)
            assert kvd.store(w, kv, tokens, overwrite=True)
            got = kvd.retrieve(reader, tokens)
            assert got is not None and torch.equal(got, kv), version
        assert served(server)[1] == 0  # all of them from the directory
        assert kvd.check_server_integrity(reader) == []


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import torch, kvdock.sdk as kvd
    from helpers import make_tokens
    url, http, model, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    tokens = make_tokens(4 * 16, start=5000)
    with kvd.connect(url, http, model) as c:
        for v in range(1, n + 1):  # version v: every element of every chunk is v
            kvd.store(c, torch.full((2, 3, 4 * 16, 16), float(v), dtype=torch.bfloat16), tokens, overwrite=True)
    print("done", flush=True)
    """
)


def test_reads_racing_overwrites_in_another_process_never_mix_versions(server) -> None:
    tokens = make_tokens(4 * CHUNK, start=5000)
    script = WRITER.format(tests=str(Path(__file__).parent.parent))
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        kvd.store(c, torch.zeros(2, 3, 4 * CHUNK, 16, dtype=torch.bfloat16), tokens)
        p = zygote.Popen(
            [sys.executable, "-c", script, server.url, server.http_url, MODEL, "300"], stdout=subprocess.PIPE, text=True
        )
        seen: set[float] = set()
        reads = 0
        while p.poll() is None or reads < 50:
            got = kvd.retrieve(c, tokens)
            reads += 1
            if got is None:  # a miss is allowed (never wrong bytes)
                continue
            values = got.unique()
            assert len(values) == 1, f"a mix of versions {values.tolist()}"
            assert got.shape[2] % CHUNK == 0
            seen.add(float(values[0]))
        assert p.wait() == 0 and p.stdout is not None and p.stdout.read().strip() == "done"
        final = kvd.retrieve(c, tokens)
        assert final is not None and (final == 300).all()
        assert len(seen) > 3, seen  # the reads did overlap the writes
        assert kvd.check_server_integrity(c) == []


def test_a_chunk_read_from_the_directory_stays_recently_used(make_server) -> None:
    srv = make_server(l1_size="16KiB")  # four one-page slots
    chunks = [make_tokens(CHUNK, start=10_000 * (i + 1)) for i in range(5)]
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        for toks in chunks[:4]:
            assert kvd.store(c, make_kv(CHUNK), toks)
        assert kvd.retrieve(c, chunks[0]) is not None  # from the directory: the oldest is now the newest
        assert kvd.store(c, make_kv(CHUNK), chunks[4])  # evicts the least recently used: chunks[1]
        assert [kvd.lookup(c, t) // CHUNK for t in chunks] == [1, 0, 1, 1, 1]
        assert served(srv) == (0, 0)


def test_a_restarted_server_is_never_read_through_the_old_pool(make_server, tmp_path: Path) -> None:
    srv = make_server()
    tokens = make_tokens(2 * CHUNK, start=6000)
    old, new = make_kv(2 * CHUNK, seed=4), make_kv(2 * CHUNK, seed=5)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        assert torch.equal(kvd.retrieve(c, tokens), old)  # type: ignore[arg-type]
        assert c._transfer.directory() is not None
        srv.proc.kill()
        srv.proc.wait()
        assert c._transfer.directory() is None  # its server is gone: the directory means nothing
        again = start_server(tmp_path, chunk_size=CHUNK, port=srv.port, http_port=srv.http_port)
        try:
            kvd.register_model(again.url, again.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            with kvd.connect(again.url, again.http_url, MODEL) as w:
                assert kvd.store(w, new, tokens)
            got = kvd.retrieve(c, tokens)  # registers again, maps the new pool
            assert got is not None and torch.equal(got, new)
            assert c._transfer.directory() is not None
            assert torch.equal(kvd.retrieve(c, tokens), new)  # type: ignore[arg-type]
        finally:
            assert again.stop() == 0


def test_a_stopped_server_still_answers_from_its_directory(server) -> None:
    tokens = make_tokens(CHUNK, start=7000)
    kv = make_kv(CHUNK, seed=6)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, tokens)
        server.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(3):  # its state cannot change while it is stopped
                assert torch.equal(kvd.retrieve(c, tokens), kv)  # type: ignore[arg-type]
        finally:
            server.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("how", ["server flag", "environment", "context"])
def test_fast_reads_can_be_turned_off(make_server, monkeypatch, how: str) -> None:
    srv = make_server(*(["--no-fast-reads"] if how == "server flag" else []))
    if how == "environment":
        monkeypatch.setenv("KVDOCK_FAST_READS", "0")
    tokens = make_tokens(CHUNK, start=8000)
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        if how == "context":
            c.fast_reads = False
        assert kvd.store(c, make_kv(CHUNK), tokens)
        assert kvd.lookup(c, tokens) == CHUNK and kvd.retrieve(c, tokens) is not None
        assert served(srv) == (1, 1)
        assert (c._transfer.directory() is None) == (how == "server flag")


def test_a_bad_fast_reads_setting_is_refused_at_connect(server, monkeypatch) -> None:
    monkeypatch.setenv("KVDOCK_FAST_READS", "maybe")
    with pytest.raises(kvd.InvalidInputError, match="KVDOCK_FAST_READS"):
        kvd.connect(server.url, server.http_url, MODEL)


def test_inline_clients_have_no_directory(make_server) -> None:
    srv = make_server("--no-shm")
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        assert c.transport == "inline" and c._transfer.directory() is None
        assert kvd.lookup(c, make_tokens(CHUNK)) == 0
        assert served(srv)[0] == 1


def test_reads_alone_keep_the_client_registered(make_server) -> None:
    srv = make_server("--client-ttl", "1")
    tokens = make_tokens(CHUNK, start=9000)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        first = c.client_id
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:  # only directory reads for 2.5 client leases
            assert kvd.lookup(c, tokens) == CHUNK
            time.sleep(0.01)
        assert kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK, start=9100))
        assert c.client_id == first  # never forgotten: no registration again
    assert srv.metric("kvdock_expired_clients_total", 0.0) == 0.0


def test_held_reads_reach_the_server_before_the_next_request(server) -> None:
    tokens = make_tokens(CHUNK, start=9500)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        for _ in range(10):
            kvd.lookup(c, tokens)
        assert kvd.check_server_integrity(c) == []  # a request: what was held went first, on the same socket
        assert server.metric("kvdock_lookups_total") == 10.0
        assert requests(server, "FastReads") <= 10


COUNTERS = ("kvdock_lookups_total", "kvdock_retrieves_total", "kvdock_hit_tokens_total", "kvdock_miss_tokens_total")


@pytest.mark.parametrize(
    ("report", "counted"),
    [
        (m.FastReads("x", 0, 1, asked=1, hit=2), False),  # more hits than asked
        (m.FastReads("x", 0, 1, asked=2, hit=2, entries=[0], offsets=[4096], gens=[]), False),  # ragged
        (m.FastReads("x", -1, 0, asked=0, hit=0), False),
        (m.FastReads("x", 0, 1, asked=2**40, hit=0), False),  # more than any request may ask
        (m.FastReads("x", 10**12, 0, asked=10**12, hit=0), False),  # more reads than a report may count
        (m.FastReads("x", 0, 1, asked=1, hit=1, nbytes=1 << 40), False),  # more bytes than a chunk holds
        (m.FastReads("x", 0, 1, asked=9, hit=9, entries=[0] * 4097, offsets=[0] * 4097, gens=[0] * 4097), False),
        (m.FastReads("nobody", 0, 1, asked=1, hit=1, entries=[10**9], offsets=[12345], gens=[7]), False),  # unknown
    ],
)
def test_fast_reads_reports_are_never_answered_and_bad_ones_change_nothing(
    server, report: m.FastReads, counted: bool
) -> None:
    tokens = make_tokens(CHUNK, start=9700)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        before = server.get("/status")["l1"], [server.metric(name) for name in COUNTERS]
        client = ControlClient(server.url, 5.0)
        try:
            with pytest.raises(Exception, match="no reply"):
                client.call(report, timeout=0.5)  # never answered, not even with an error
            assert isinstance(client.call(m.Ping()).reply, m.Pong)
        finally:
            client.close()
        after = server.get("/status")["l1"], [server.metric(name) for name in COUNTERS]
        assert after[0] == before[0]
        assert (after[1] != before[1]) == counted
        errors = server.metric('kvdock_errors_total{code="bad_request"}', 0.0)
        errors += server.metric('kvdock_errors_total{code="unknown_client"}', 0.0)
        assert (errors == 0) == counted
        assert kvd.check_server_integrity(c) == []
        assert torch.equal(kvd.retrieve(c, tokens), make_kv(CHUNK))  # type: ignore[arg-type]


def test_a_client_flooding_reports_gets_only_its_touch_budget(server) -> None:
    """Adversarial test: reports are never answered, so no unread reply ever slows a client that
    floods them; past its budget of LRU touches the server skips them (and still counts reads)."""
    from kvdock.server.registry import TOUCH_BURST, TOUCH_RATE

    with kvd.connect(server.url, server.http_url, MODEL) as c:
        n, reports = 4096, 100
        flood = m.FastReads(c.client_id, 0, 0, asked=0, hit=0, entries=[0] * n, offsets=[0] * n, gens=[0] * n)
        started = time.monotonic()
        for _ in range(reports):
            c._conn.send_nowait(flood)
        assert kvd.check_server_integrity(c) == []  # a request: after every report, on the same socket
        took = time.monotonic() - started
        skipped = server.metric("kvdock_fast_reads_untouched_total")
        assert skipped >= n * reports - TOUCH_BURST - TOUCH_RATE * took
        assert skipped < n * reports


def test_only_the_process_that_made_the_pool_is_watched(server) -> None:
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert c._transfer.directory() is not None
        mine = PoolSegment.create(4096, 8)  # made by this process, not by the server
        try:
            assert watch_creator(c._conn, mine) is None
            theirs = PoolSegment.attach(server.get("/config")["l1"]["shm_name"])
            watch = watch_creator(c._conn, theirs)
            assert watch is not None and watch.pid == server.proc.pid and watch.alive()
            watch.close()
            assert not watch.alive()
            theirs.close()
        finally:
            mine.close()
            mine.unlink()


def test_a_killed_server_hangs_up_the_watch_at_once(make_server) -> None:
    srv = make_server()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        watch = c._conn.peer_watch()
        assert watch is not None and watch.alive()
        srv.proc.send_signal(signal.SIGSTOP)
        assert watch.alive()  # stopped is not gone
        srv.proc.kill()
        srv.proc.wait()
        assert not watch.alive()
        watch.close()


def test_a_read_redone_with_a_shorter_hit_leaves_no_bytes_in_out_past_it(server, monkeypatch) -> None:
    """Regression (adversarial test): a fast read whose slots moved during its copy is redone
    through the server; when that finds less, ``out`` past the returned view held the bytes the
    first copy wrote (another object's, under load)."""
    from kvdock.sdk._transfer import ShmTransfer

    tokens = make_tokens(2 * CHUNK, start=9900)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(2 * CHUNK, seed=8), tokens)
        real = ShmTransfer._count_moved
        calls = []

        def clear_first(self, offsets, gens):  # type: ignore[no-untyped-def]
            if not calls:  # the fast read's copy is done: everything goes before its check
                request = urllib.request.Request(server.http_url + "/admin/clear?tier=l1", method="POST")
                urllib.request.urlopen(request, timeout=10).read()
            calls.append(len(offsets))
            return real(self, offsets, gens)

        monkeypatch.setattr(ShmTransfer, "_count_moved", clear_first)
        out = torch.full((2, GEOMETRY["num_layers"], 3 * CHUNK, 16), 5.0, dtype=torch.bfloat16)
        assert kvd.retrieve(c, tokens, out=out) is None  # redone through the server: nothing left
        assert calls == [2]  # the fast read copied both chunks, then found them gone
        assert (out[:, :, : 2 * CHUNK] == 0).all()  # what it wrote is zeroed, not left
        assert (out[:, :, 2 * CHUNK :] == 5).all()  # never handed: untouched


UNCLOSED = textwrap.dedent(
    """
    import faulthandler, gc, sys, threading, time, weakref
    import torch, kvdock.sdk as kvd
    faulthandler.dump_traceback_later(30, exit=True)  # a hang fails the test with a stack dump
    url, http, model = sys.argv[1:4]
    refs = []
    for i in range(5):
        c = kvd.connect(url, http, model)
        toks = list(range(1000 * i, 1000 * i + 32))
        kvd.store(c, torch.zeros(2, 3, 32, 16, dtype=torch.bfloat16), toks)
        assert kvd.retrieve(c, toks) is not None  # a fast read: the reporter's thread runs
        refs.append(weakref.ref(c))
        del c  # dropped without close()
    gc.collect()
    deadline = time.monotonic() + 5
    # (the reporters end with their contexts; a prefault ends by itself, late under load)
    ours = ("kvdock-fast-reads", "kvdock-prefault")
    while any(t.name in ours for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(sum(r() is not None for r in refs), sorted({t.name for t in threading.enumerate()}))
    """
)


def test_a_context_dropped_without_close_is_freed_with_its_reporter(server) -> None:
    """Regression (both reviews): the reporter referred to its context, which then lived on as
    long as the reporter's thread did, and was freed only by a GC pass that hung in zmq."""
    p = zygote.run(
        [sys.executable, "-c", UNCLOSED, server.url, server.http_url, MODEL], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "0 ['MainThread']"


def test_fast_reads_come_back_after_the_server_drops_the_local_connection(server, monkeypatch) -> None:
    """Review: the watch of the server was made once, at registration: once the server dropped
    that local connection (here for a malformed frame) every read went to it for good."""
    from kvdock.sdk import _connection as connection

    monkeypatch.setattr(connection, "LOCAL_RETRY_S", 0.05)
    tokens = make_tokens(CHUNK, start=9800)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        assert c._transfer.directory() is not None
        c._conn._local._chan._sock.sendall(b"\xff" * 8)  # type: ignore[union-attr]  # not a message
        deadline = time.monotonic() + 10
        while not c._transfer.watch_lost:  # type: ignore[attr-defined]  # the server hangs up
            assert time.monotonic() < deadline, "the server kept the connection"
            time.sleep(0.01)
        while c._transfer.watch_lost:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the watch was never replaced"
            assert torch.equal(kvd.retrieve(c, tokens), make_kv(CHUNK))  # type: ignore[arg-type]  # via the server
            time.sleep(0.02)
        assert c._conn.channel == "local"
        before = served(server)
        for _ in range(5):
            assert torch.equal(kvd.retrieve(c, tokens), make_kv(CHUNK))  # type: ignore[arg-type]
        assert served(server) == before  # from the directory again


def test_a_tail_left_by_an_overwrite_of_a_shorter_prefix_is_a_final_miss_without_lower_tiers(server) -> None:
    """Review: after an overwrite of a prompt's first chunks, its old later chunks stay in L1 but
    no longer chain: a lookup of the whole prompt stops there, and with no lower tier that is
    final, answered from the directory instead of sending every such read to the server."""
    tokens = make_tokens(4 * CHUNK, start=9600)
    new = make_kv(2 * CHUNK, seed=12)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(4 * CHUNK, seed=11), tokens)
        assert kvd.store(c, new, tokens[: 2 * CHUNK], overwrite=True)
        before = served(server)
        assert kvd.lookup(c, tokens) == 2 * CHUNK
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, new)  # never the old tail after the new head
        assert served(server) == before
        c.fast_reads = False
        assert kvd.lookup(c, tokens) == 2 * CHUNK  # what the server answers too


def test_a_report_never_cuts_the_local_channel_nor_waits_for_a_server_that_does_not_read(server) -> None:
    """Second review: a report the socket took only in part was cut off, and the hang-up failed
    every other thread's request; and a read waited behind another thread's send for as long as
    the server did not read. Reports are now sent whole or not at all, without waiting."""
    tokens = make_tokens(CHUNK, start=9400)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=20) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        local = c._conn._local
        assert local is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            n = 512
            big = m.FastReads(c.client_id, 0, 0, 0, 0, [10**12] * n, [10**12] * n, [10**12] * n)
            for _ in range(200):  # ~3 MiB: more than the local socket holds (the rest goes over zmq)
                c._conn.send_report(big)
            assert local.usable  # what the local socket had no room for was not cut off there
            # another thread's request waits for room (the socket is full), holding the socket
            blocked_errors: list[BaseException] = []

            def ask() -> None:
                try:  # a request larger than what the socket holds
                    c.call(m.Lookup(c.client_id, np.arange(60_000 * CHUNK, dtype=np.uint32).tobytes()))
                except BaseException as e:
                    blocked_errors.append(e)

            blocked = threading.Thread(target=ask, daemon=True)
            blocked.start()
            time.sleep(0.3)
            started = time.monotonic()
            for _ in range(20):  # reads whose reports are due: none waits
                assert torch.equal(kvd.retrieve(c, tokens), make_kv(CHUNK))  # type: ignore[arg-type]
                c.reporter.flush()
            assert time.monotonic() - started < 1.0
        finally:
            server.proc.send_signal(signal.SIGCONT)
        blocked.join(20)
        assert not blocked.is_alive() and not blocked_errors, blocked_errors  # it went through
        assert local.usable and c._conn.channel == "local" and c._transfer.directory() is not None
        assert kvd.check_server_integrity(c) == []  # a request: what was held goes first
        assert not c.reporter.pending


def test_replaced_server_watches_are_closed(server, monkeypatch) -> None:
    """Second review: every re-watch kept the old watch's descriptor until the context closed."""
    from kvdock.sdk import _connection as connection

    monkeypatch.setattr(connection, "LOCAL_RETRY_S", 0.05)
    tokens = make_tokens(CHUNK, start=9300)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        fds = []
        for _ in range(6):
            c._conn._local._chan._sock.sendall(b"\xff" * 8)  # type: ignore[union-attr]  # the server drops us
            deadline = time.monotonic() + 10
            while not c._transfer.watch_lost:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline
                time.sleep(0.01)
            while c._transfer.watch_lost:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "the watch was never replaced"
                kvd.retrieve(c, tokens)
                time.sleep(0.01)
            fds.append(len(os.listdir("/proc/self/fd")))
        assert fds[-1] <= fds[1] + 1, fds  # not one more per drop


def test_a_reporter_holds_what_it_cannot_send_and_splits_what_it_sends(monkeypatch) -> None:
    """The reporter's own contract, with a stand-in for the socket (refusing on demand is what a
    real one does only when its server stops reading)."""
    from kvdock.sdk import _fastpath as fastpath
    from kvdock.shm.directory import Found

    monkeypatch.setattr(fastpath, "MAX_KEPT", 1500)
    accept = [False]
    sent: list[m.FastReads] = []

    def send(report: m.FastReads) -> bool:
        if accept[0]:
            sent.append(report)
        return accept[0]

    r = fastpath.Reporter(send, lambda: "me")
    try:

        def found(first: int, n: int) -> Found:
            ids = np.arange(first, first + n, dtype=np.int64)
            return Found(n, ids, ids * 4096, ids.astype(np.uint64), "all")

        r.add(3, 2)  # a lookup: 3 chunks asked, 2 found
        r.add(1000, 1000, found(0, 1000), 1000 * 64)
        assert not r.flush() and sent == [] and r.pending  # refused: held again
        r.add(1000, 1000, found(1000, 1000), 1000 * 64)
        assert not r.flush()  # refused again: held again, past MAX_KEPT chunks the oldest go
        accept[0] = True
        assert r.flush() and not r.pending
        assert [len(x.entries) for x in sent] == [512, 512, 476]  # PER_MESSAGE; the oldest 500 dropped
        assert sent[0].entries[:2] == [500, 501] and sent[-1].entries[-1] == 1999  # in order, newest kept
        assert [(x.lookups, x.retrieves, x.asked, x.hit, x.nbytes) for x in sent] == [
            (1, 2, 2003, 2002, 2000 * 64),  # every read counted, once
            (0, 0, 0, 0, 0),
            (0, 0, 0, 0, 0),
        ]
        assert all(x.client_id == "me" and x.offsets == [e * 4096 for e in x.entries] for x in sent)
    finally:
        r.close()


PAUSED = str(Path(__file__).parent.parent / "paused_client.py")


def _wait_stopped(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the child did not stop"
        time.sleep(0.01)


def test_a_fast_read_spanning_a_server_restart_never_returns_the_replaced_version(make_server, tmp_path: Path) -> None:
    """Issue 29 (6): a reader stopped right after the fast path's checks (server alive), the server
    killed and started again, the prefix overwritten through the new one and acknowledged, the
    reader resumed: its copy out of the old pool (still mapped: the old version, slot
    generations unchanged, as nobody runs that pool any more) must not be returned. The checks
    run again after the copy; the read then goes to the new server (the new version)."""
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    tokens = make_tokens(3 * CHUNK, start=12_000)
    old, new = make_kv(3 * CHUNK, seed=1), make_kv(3 * CHUNK, seed=2)  # (paused_client's make_tokens/make_kv)
    out = tmp_path / "got.pt"
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        wait_written(srv, "l2", 3)  # the new server finds the old version in L2: a real overwrite
    child = zygote.Popen(
        [sys.executable, PAUSED, srv.url, srv.http_url, MODEL, "read", "12000", str(3 * CHUNK), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"KVDOCK_FAST_READS": "1"},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line == "paused", (line, child.stderr.read() if child.poll() is not None else "")  # type: ignore[union-attr]
        _wait_stopped(child.pid)  # stopped before its copy from the pool directory's slots
        srv.proc.kill()
        srv.proc.wait()
        again = start_server(
            tmp_path, "--disk-dir", str(disk), chunk_size=CHUNK, port=srv.port, http_port=srv.http_port
        )
        try:
            with kvd.connect(again.url, again.http_url, MODEL, timeout=10) as w:
                assert torch.equal(kvd.retrieve(w, tokens), old)  # type: ignore[arg-type]  # from L2
                assert kvd.store_chunks(w, new, tokens, overwrite=True).stored_chunks == 3  # acknowledged
            child.send_signal(signal.SIGCONT)
            stdout, stderr = child.communicate(timeout=60)
            assert child.returncode == 0, stderr
            got = torch.load(out)
            assert got is not None and not torch.equal(got, old), "the reader returned the replaced version"
            assert torch.equal(got, new)  # (a miss would do too; the new server holds it)
            assert json.loads(stdout.splitlines()[-1]) == {"reads": 2}  # the copy from the old pool, dropped
        finally:
            assert again.stop() == 0, again.log()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_pool_past_its_valid_until_deadline_is_read_through_the_server(server) -> None:
    """Issue 29 (6): the segment header's ``valid_until_ns`` (CLOCK_MONOTONIC) is how long the
    server vouches for its pool directory; past it a fast read asks the server (a normal request,
    counted as one, with the right bytes), before it again reads from the directory."""
    tokens = make_tokens(2 * CHUNK, start=13_000)
    kv = make_kv(2 * CHUNK, seed=9)
    pool = PoolSegment.attach(server.get("/config")["l1"]["shm_name"])  # the server's pool, as it writes it
    try:
        assert pool.valid_until_ns() == 2**64 - 1  # a fresh pool: no deadline
        with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
            assert kvd.store(c, kv, tokens)
            before = served(server)
            assert kvd.lookup(c, tokens) == 2 * CHUNK and torch.equal(kvd.retrieve(c, tokens), kv)  # type: ignore[arg-type]
            assert served(server) == before  # from the directory
            pool.set_valid_until_ns(time.monotonic_ns() - 1)  # a deadline in the past
            assert kvd.lookup(c, tokens) == 2 * CHUNK
            assert torch.equal(kvd.retrieve(c, tokens), kv)  # type: ignore[arg-type]
            assert kvd.lookup_many(c, [tokens]) == [2 * CHUNK]
            assert torch.equal(kvd.retrieve_many(c, [tokens])[0], kv)  # type: ignore[arg-type]
            assert served(server) == (before[0] + 1, before[1] + 1)  # each asked the server
            assert (requests(server, "LookupMany"), requests(server, "PrepareRetrieveMany")) == (1, 1)
            pool.set_valid_until_ns(time.monotonic_ns() + 600 * 10**9)  # ten minutes on
            assert torch.equal(kvd.retrieve(c, tokens), kv)  # type: ignore[arg-type]
            assert served(server) == (before[0] + 1, before[1] + 1)  # from the directory again
    finally:
        pool.close()


def test_a_read_does_not_repair_the_server_watch(server, monkeypatch) -> None:
    """Issue 25: a fast read that found the watch of the server hung up made a new one (a read
    with a side effect on the connection). Now the watch follows the connection's local channel
    (kvdock.sdk._handshake.rewatch): while that is down, reads only look, and go to the server."""
    from kvdock.sdk import _connection

    monkeypatch.setattr(_connection, "LOCAL_RETRY_S", 600.0)  # the local channel stays down
    tokens = make_tokens(CHUNK, start=9900)
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens)
        looked = []
        real = _connection.Connection.peer_watch
        monkeypatch.setattr(_connection.Connection, "peer_watch", lambda self: looked.append(1) or real(self))
        c._conn._local._chan._sock.sendall(b"\xff" * 8)  # type: ignore[union-attr]  # the server drops us
        deadline = time.monotonic() + 10
        while not c._transfer.watch_lost:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the server kept the connection"
            time.sleep(0.01)
        for _ in range(5):
            assert torch.equal(kvd.retrieve(c, tokens), make_kv(CHUNK))  # type: ignore[arg-type]  # via the server
        assert looked == [] and c._transfer.watch_lost  # type: ignore[attr-defined]
        assert c._conn.channel == "zmq"

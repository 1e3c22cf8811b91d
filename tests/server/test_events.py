"""KV events with a real server: chunks stored and evicted are published on the PUB socket with
kvdock's chunk hashes, batched and in order; ``kvdock events`` prints them; off by default."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request

import numpy as np

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, free_port, make_kv, make_tokens
from kvdock.keys import ObjectKey, chunk_hashes, namespace
from kvdock.protocol.events import TOPIC, AllChunksCleared, ChunkRemoved, ChunkStored
from kvdock.server.events import ChunkEvents
from kvdock.server.metrics import Metrics
from kvdock.storage.memory import L1Object
from kvdock.transport.events import EventSubscriber


def hashes(tokens: list[int]) -> list[bytes]:
    return list(chunk_hashes(np.array(tokens, dtype="<u4"), CHUNK))


class Collected:
    """Every event published, in order, read until ``until(events)`` holds."""

    def __init__(self, url: str) -> None:
        self.sub = EventSubscriber(url)
        self.events: list[object] = []
        self.seqs: list[int] = []

    def read(self, until, timeout: float = 10.0) -> list[object]:  # type: ignore[no-untyped-def]
        import time

        deadline = time.monotonic() + timeout
        while not until(self.events):
            assert time.monotonic() < deadline, self.events
            got = self.sub.receive(0.2)
            if got is not None:
                self.seqs.append(got[0])
                self.events += got[1].events
        return self.events


def test_stored_and_evicted_chunks_are_published_in_order(make_server) -> None:
    port = free_port()
    srv = make_server("--kv-events-port", str(port), l1_size="1MiB")  # 256 slots of 4 KiB (3 KiB chunks)
    assert srv.get("/config")["kv_events_url"] == f"tcp://127.0.0.1:{port}"
    events = Collected(f"tcp://127.0.0.1:{port}")
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            probe = make_tokens(CHUNK, start=9_000_000)
            for _ in range(100):  # a SUB socket misses what is sent before it has joined
                kvd.store(c, make_kv(CHUNK), probe, overwrite=True)
                if events.sub.receive(0.1) is not None:
                    break
            else:
                raise AssertionError("no KV event came")
            while events.sub.receive(0.3) is not None:
                pass  # the warm-up's last events
            a = make_tokens(3 * CHUNK, start=10_000)
            kvd.store(c, make_kv(3 * CHUNK, seed=1), a)
            kvd.store(c, make_kv(CHUNK, seed=2), a[:CHUNK], cache_salt="s")
            seen = events.read(lambda e: sum(isinstance(x, ChunkStored) for x in e) >= 2)
            stored = [x for x in seen if isinstance(x, ChunkStored)]
            assert stored[0] == ChunkStored(hashes(a), MODEL, 0, namespace(MODEL, 0, ""), CHUNK)  # one for 3 chunks
            assert stored[1] == ChunkStored(hashes(a)[:1], MODEL, 0, namespace(MODEL, 0, "s"), CHUNK)
            assert "s" not in {x.namespace for x in stored}  # the salt itself is never published
            events.events.clear()
            big = make_tokens(256 * CHUNK, start=20_000)  # the whole pool: evicts everything else
            kvd.store(c, make_kv(256 * CHUNK, seed=3), big)
            seen = events.read(lambda e: any(isinstance(x, ChunkStored) and len(x.chunk_hashes) == 256 for x in e))
            removed = {h for x in seen if isinstance(x, ChunkRemoved) for h in x.chunk_hashes}
            assert set(hashes(a)) <= removed and hashes(a)[0] in removed
            assert all(x.medium == "l1" for x in seen)  # type: ignore[attr-defined]
            assert srv.metric("kvdock_evictions_total") >= 5
            assert events.seqs == sorted(events.seqs)
            events.events.clear()
            req = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
            urllib.request.urlopen(req, timeout=10).close()
            assert events.read(lambda e: bool(e)) == [AllChunksCleared("l1")]  # one event, not 256
    finally:
        events.sub.close()


def test_kvdock_events_prints_json_lines(make_server) -> None:
    port = free_port()
    srv = make_server("--kv-events-port", str(port))
    cli = subprocess.Popen(
        [sys.executable, "-m", "kvdock.cli.main", "events", "--url", f"tcp://127.0.0.1:{port}", "--count", "1",
         "--timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            toks = make_tokens(2 * CHUNK, start=30_000)
            kvd.store(c, make_kv(2 * CHUNK), toks)
            i = 0
            while cli.poll() is None and i < 300:  # until the CLI has joined and seen one
                kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK, start=40_000 + i * CHUNK))
                i += 1
                with contextlib.suppress(subprocess.TimeoutExpired):
                    cli.wait(0.1)
        out, err = cli.communicate(timeout=30)
    finally:
        cli.kill()
    assert cli.returncode == 0, err
    doc = json.loads(out.splitlines()[0])
    assert doc["type"] == "ChunkStored" and doc["model"] == MODEL and doc["server"] == srv.url
    assert all(len(h) == 64 for h in doc["chunk_hashes"]) and doc["chunk_size"] == CHUNK


def test_events_are_off_by_default(server) -> None:
    assert server.get("/config")["kv_events_url"] is None


def test_consecutive_chunks_share_an_event_and_a_full_backlog_drops_the_oldest(monkeypatch) -> None:
    from kvdock.server import events as ev

    monkeypatch.setattr(ev, "MAX_PENDING", 2)
    sent = []

    class Pub:
        def publish(self, batch, topic):  # type: ignore[no-untyped-def]
            assert topic == TOPIC  # (no tenants: one topic)
            sent.append(batch)

    journal = ChunkEvents(Metrics(), CHUNK, Pub())  # type: ignore[arg-type]

    def obj(salt: str, i: int) -> L1Object:
        return L1Object(ObjectKey(MODEL, 0, salt, bytes([i]) * 32), 0, 1)  # type: ignore[call-arg]

    journal.stored(obj("", 1))
    journal.stored(obj("", 2))
    journal.removed(obj("", 1), evicted=True)
    journal.stored(obj("x", 3))  # a third event: the oldest goes
    assert journal.flush("tcp://h:1") == 2
    (batch,) = sent
    assert batch.server == "tcp://h:1" and batch.dropped == 2  # the first event: 2 chunks stored
    assert batch.events == [
        ChunkRemoved([bytes([1]) * 32], MODEL, 0, namespace(MODEL, 0, "")),
        ChunkStored([bytes([3]) * 32], MODEL, 0, namespace(MODEL, 0, "x"), CHUNK),
    ]
    assert namespace(MODEL, 0, "x") != namespace(MODEL, 0, "") and len(namespace(MODEL, 0, "x")) == 32
    assert journal.flush("tcp://h:1") == 0


def test_kvdock_events_says_when_nothing_listens(capsys) -> None:
    from kvdock.cli.main import main

    assert main(["events", "--url", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1"]) == 2
    assert "nothing answers at tcp://127.0.0.1:" in capsys.readouterr().err

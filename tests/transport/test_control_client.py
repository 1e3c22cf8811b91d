"""ControlClient shared by threads: each call waits only for its own reply.

Most tests talk to a scripted ROUTER peer (a real zmq socket in a thread of the test) that
answers when and in the order the test says; the last one uses a real server whose reply to one
request is held for seconds while other threads' requests are answered.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens
from kvdock.protocol import decode_request, encode
from kvdock.protocol import messages as m
from kvdock.transport.client import ControlClient, ControlTimeout


@dataclass
class Request:
    identity: bytes
    seq: bytes
    msg: object


class ScriptedServer:
    """A ROUTER on a free loopback port. Requests arrive on ``requests``; ``reply`` answers one
    (from any thread: the socket itself is only used by the server's own thread)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.requests: queue.Queue[Request] = queue.Queue()
        self._outbox: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._sock.send_multipart(self._outbox.get_nowait())
                except queue.Empty:
                    break
            if self._sock.poll(5, zmq.POLLIN):
                identity, seq, header, *_ = self._sock.recv_multipart()
                self.requests.put(Request(identity, seq, decode_request(header)))
        self._sock.close(linger=0)
        self._ctx.term()

    def next_request(self, timeout: float = 5.0) -> Request:
        return self.requests.get(timeout=timeout)

    def reply(self, req: Request, msg: object, payload: tuple[bytes, ...] = ()) -> None:
        self._outbox.put([req.identity, req.seq, encode(msg), *payload])  # type: ignore[arg-type]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def peer() -> Iterator[ScriptedServer]:
    s = ScriptedServer()
    yield s
    s.close()


def lookup(n: int) -> m.Lookup:
    return m.Lookup(f"c{n}", b"")


def test_replies_in_any_order_reach_their_own_callers(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    got: dict[int, int] = {}

    def call(n: int) -> None:
        got[n] = client.call(lookup(n)).reply.hit_tokens

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    reqs = [peer.next_request() for _ in range(8)]  # all eight are in flight at once
    for req in reversed(reqs):
        peer.reply(req, m.LookupResult(int(req.msg.client_id[1:]) * 100))  # type: ignore[attr-defined]
    for t in threads:
        t.join(10)
    assert got == {n: n * 100 for n in range(8)}
    client.close()


def test_a_held_request_does_not_delay_the_others(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    done: dict[str, float] = {}

    def slow() -> None:
        assert client.call(lookup(-1)).reply.hit_tokens == -1
        done["slow"] = time.monotonic()

    held: list[Request] = []

    def serve() -> None:  # answers every request at once, except the slow one: after 2 s
        t_held = None
        while t_held is None or time.monotonic() < t_held + 2:
            try:
                req = peer.next_request(timeout=0.05)
            except queue.Empty:
                continue
            if req.msg.client_id == "c-1":  # type: ignore[attr-defined]
                held.append(req)
                t_held = time.monotonic()
            else:
                peer.reply(req, m.LookupResult(7))
        peer.reply(held[0], m.LookupResult(-1))

    server = threading.Thread(target=serve)
    server.start()
    a = threading.Thread(target=slow)
    a.start()
    while not held:
        time.sleep(0.01)
    t0 = time.monotonic()
    for i in range(20):
        assert client.call(lookup(i)).reply.hit_tokens == 7
    done["fast"] = time.monotonic()
    a.join(10)
    server.join(10)
    assert done["fast"] - t0 < 1.0 and done["fast"] < done["slow"], done
    client.close()


def test_a_late_reply_to_an_abandoned_call_is_dropped(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    with pytest.raises(ControlTimeout, match=r"no reply from tcp://127\.0\.0\.1:\d+ within 0\.2s"):
        client.call(lookup(1), timeout=0.2)
    late = peer.next_request()
    peer.reply(late, m.LookupResult(111))  # nobody waits for it any more
    time.sleep(0.1)

    def answer() -> None:
        peer.reply(peer.next_request(), m.LookupResult(222))

    t = threading.Thread(target=answer)
    t.start()
    assert client.call(lookup(2)).reply.hit_tokens == 222
    t.join()
    assert client._slots == {}  # no slot left behind by either call
    client.close()


def test_timeouts_are_per_call(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    result: list[int] = []
    patient = threading.Thread(target=lambda: result.append(client.call(lookup(1), timeout=5).reply.hit_tokens))
    patient.start()
    first = peer.next_request()
    t0 = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"within 0\.3s"):
        client.call(lookup(2), timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2
    peer.reply(first, m.LookupResult(5))  # the patient caller still gets its reply
    patient.join(5)
    assert result == [5]
    client.close()


def test_payload_frames_come_zero_copy_and_stay_alive(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    big = bytes(range(256)) * 4096  # 1 MiB

    def answer() -> None:
        peer.reply(peer.next_request(), m.RetrievePrepared([]), (big, b"x"))

    t = threading.Thread(target=answer)
    t.start()
    resp = client.call(m.PrepareRetrieve("c1", "s", b""))  # (the request RetrievePrepared answers)
    t.join()
    client.close()  # the frames belong to the response, not to the socket
    # views of zmq's own frames, not copies
    assert all(isinstance(f, memoryview) and isinstance(f.obj, zmq.Frame) for f in resp.frames)
    bufs = resp.frames
    assert [len(b) for b in bufs] == [len(big), 1] and bufs[0] == big and bytes(bufs[1]) == b"x"


def test_close_wakes_every_waiting_caller(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=30)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.call(lookup(1))
        except ControlTimeout as e:
            errors.append(e)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(3):
        peer.next_request()
    t0 = time.monotonic()
    client.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 3 and len(errors) == 3
    assert all("closed while waiting" in str(e) for e in errors), errors
    assert client.closed
    with pytest.raises(ControlTimeout, match="is closed"):
        client.call(lookup(2))
    client.send_nowait(lookup(3))  # harmless
    client.close()  # harmless twice


def test_a_url_zmq_cannot_use_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"cannot connect to '127\.0\.0\.1:5555'"):
        ControlClient("127.0.0.1:5555", timeout=1)


def test_threads_hammering_one_client_each_get_their_own_replies(peer: ScriptedServer) -> None:
    client = ControlClient(peer.url, timeout=10)
    stop = threading.Event()

    def echo() -> None:  # answers in bursts, out of order
        while not stop.is_set():
            batch = []
            while True:
                try:
                    batch.append(peer.next_request(timeout=0.002))
                except queue.Empty:
                    break
            for req in reversed(batch):
                peer.reply(req, m.LookupResult(int(req.msg.client_id[1:])))  # type: ignore[attr-defined]

    server = threading.Thread(target=echo)
    server.start()
    wrong: list[tuple[int, int]] = []

    def work(base: int) -> None:
        for i in range(200):
            n = base + i
            got = client.call(lookup(n)).reply.hit_tokens
            if got != n:
                wrong.append((n, got))

    workers = [threading.Thread(target=work, args=(k * 1000,)) for k in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    stop.set()
    server.join(5)
    client.close()
    assert not wrong and not any(w.is_alive() for w in workers)


# --------------------------------------------------------------------------------------------------
# A real server: a retrieve whose chunks only L3 holds waits on the server for the load; with
# Redis stopped (SIGSTOP) the load cannot finish, so the server holds that reply for wait_s.


def _wait_for(cond, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_retrieve_waiting_on_the_server_does_not_stall_other_threads(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url)
    slow_tokens, fast_tokens = make_tokens(2 * CHUNK, start=1000), make_tokens(CHUNK, start=5000)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        assert kvd.store(ctx, make_kv(2 * CHUNK, seed=1), slow_tokens)
        _wait_for(lambda: srv.get("/status")["tiers"]["l3"]["writes"] >= 2, "written down to L3")
        req = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
        urllib.request.urlopen(req, timeout=10).close()  # only L3 holds them now
        assert kvd.store(ctx, make_kv(CHUNK, seed=2), fast_tokens)  # in L1: lookups answer at once
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            done: dict[str, float] = {}
            raw = normalize_tokens(slow_tokens).tobytes()

            def slow() -> None:
                reply = ctx.call(m.PrepareRetrieve(ctx.client_id, "held", raw, wait_s=3.0)).reply
                assert reply.slots == []  # nothing could be loaded
                done["slow"] = time.monotonic()

            t0 = time.monotonic()
            a = threading.Thread(target=slow)
            a.start()
            _wait_for(lambda: srv.get("/status")["sessions"] >= 1, "the server holds the retrieve")
            for _ in range(20):
                assert kvd.lookup(ctx, fast_tokens) == CHUNK
            done["fast"] = time.monotonic()
            a.join(15)
            assert not a.is_alive()
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
    assert done["slow"] - t0 > 2.5, "the server did not hold the retrieve"
    assert done["fast"] < done["slow"] and done["fast"] - t0 < 2.0, done

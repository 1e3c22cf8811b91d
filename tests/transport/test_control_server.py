"""The ROUTER endpoint: every request is received exactly once and in order, also while a send
consumes ZMQ_FD's edge, and a flood waits in zmq's queue instead of piling up in the server's."""

from __future__ import annotations

import asyncio
import threading

import zmq

from kvdock.testing import free_port
from kvdock.transport import server as srvmod
from kvdock.transport.server import ControlServer


def _serve(url: str, count: int, seen: list[bytes], peak: list[int], ready: threading.Event) -> None:
    async def main() -> None:
        control = ControlServer(url)
        ready.set()
        try:
            for _ in range(count):
                msg = await control.recv()
                peak[0] = max(peak[0], len(control._queue))
                seen.append(msg.seq)
                await control.send(msg.identity, msg.seq, bytes(msg.header or b""))
        finally:
            control.close()

    asyncio.run(main())


def test_a_flood_is_answered_in_order_and_queued_in_zmq_not_in_the_server() -> None:
    url, count = f"tcp://127.0.0.1:{free_port()}", 3 * srvmod.MAX_QUEUED
    seen: list[bytes] = []
    peak = [0]
    ready = threading.Event()
    t = threading.Thread(target=_serve, args=(url, count, seen, peak, ready), daemon=True)
    t.start()
    assert ready.wait(10)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(url)
    try:
        for i in range(count):  # sent before any reply is read
            dealer.send_multipart([i.to_bytes(8, "little"), b"h%d" % i])
        got = []
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        while len(got) < count:
            assert poller.poll(20_000), f"stranded after {len(got)} replies"
            seq, header = dealer.recv_multipart()
            got.append((int.from_bytes(seq, "little"), header))
        assert got == [(i, b"h%d" % i) for i in range(count)]
        assert [int.from_bytes(s, "little") for s in seen] == list(range(count))
        assert peak[0] <= srvmod.MAX_QUEUED
    finally:
        dealer.close(linger=0)
        ctx.term()
        t.join(10)

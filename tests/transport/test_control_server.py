"""The ROUTER endpoint: every request is handled exactly once and in order, also while a send
made outside the reader consumes ZMQ_FD's edge, and a flood is taken at most MAX_BATCH messages
per turn of the event loop (the rest wait in zmq's queue)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from kvdock.testing import free_port
from kvdock.transport import server as srvmod
from kvdock.transport.server import ControlServer, Incoming


class _Counting(ControlServer):
    """Counts the messages handled in each call of the zmq reader."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.turns: list[int] = []

    def _on_zmq(self) -> None:
        self.turns.append(0)
        super()._on_zmq()


def _serve(url: str, count: int, later: bool, seen: list[bytes], turns: list[int], ready: threading.Event) -> None:
    async def main() -> None:
        control = _Counting(url)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def handle(msg: Incoming) -> None:
            control.turns[-1] += 1
            seen.append(msg.seq)
            reply = bytes(msg.header or b"")
            if later:  # sent outside the reader: the send may take the edge of what arrives
                loop.call_soon(control.send, msg, reply)
            else:
                control.send(msg, reply)
            if len(seen) == count:
                loop.call_soon(done.set)

        control.start(handle)
        ready.set()
        try:
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.sleep(0.2)  # the last replies leave
        finally:
            turns.extend(control.turns)
            control.close()

    asyncio.run(main())


@pytest.mark.parametrize("later", [False, True], ids=["reply-in-reader", "reply-later"])
def test_a_flood_is_answered_in_order_and_taken_in_batches(later: bool) -> None:
    url, count = f"tcp://127.0.0.1:{free_port()}", 3 * srvmod.MAX_BATCH + 7
    seen: list[bytes] = []
    turns: list[int] = []
    ready = threading.Event()
    t = threading.Thread(target=_serve, args=(url, count, later, seen, turns, ready), daemon=True)
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
    finally:
        dealer.close(linger=0)
        ctx.term()
        t.join(10)
    assert sum(turns) == count
    assert max(turns) == srvmod.MAX_BATCH  # the flood was taken in several turns of the loop


def test_an_incoming_names_its_channel_so_a_chosen_identity_cannot_pose_as_a_local_connection() -> None:
    zmq_msg = Incoming(b"\x00\x00\x00\x00\x01", b"s", None, [])
    local_msg = Incoming(b"", b"s", None, [], local=1)
    assert zmq_msg.peer == (0, b"\x00\x00\x00\x00\x01") and local_msg.peer == (1, b"")
    assert zmq_msg.peer != local_msg.peer

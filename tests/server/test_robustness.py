"""Malformed input gets an error reply; the server keeps serving everyone and loses nothing."""

from __future__ import annotations

import os
import socket

import msgspec
import pytest
import torch
import zmq

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens
from kvdock.protocol import decode_reply, encode
from kvdock.protocol import messages as m


@pytest.fixture
def dealer(server):
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.url)
    yield sock
    sock.close()
    zctx.term()


def _ask(sock, *frames: bytes) -> list[bytes]:
    sock.send_multipart(list(frames))
    return sock.recv_multipart()


def test_garbage_frames_get_error_replies(server, ctx, dealer) -> None:
    kv = make_kv(2 * CHUNK, seed=1)
    tokens = make_tokens(2 * CHUNK)
    assert kvd.store(ctx, kv, tokens)
    cases = [
        (b"\x01" * 8, b"\xff\xfe garbage"),
        (b"\x02" * 8, msgspec.msgpack.encode({"type": "NoSuchOp"})),
        (b"\x03" * 8, msgspec.msgpack.encode({"type": "Lookup", "client_id": 5})),
        (b"\x04" * 8, msgspec.msgpack.encode([1, 2, 3])),
        (b"\x05" * 8, os.urandom(4096)),
    ]
    for seq, header in cases:
        frames = _ask(dealer, seq, header)
        assert frames[0] == seq
        reply = decode_reply(frames[1])
        assert isinstance(reply, m.Error) and reply.code == "malformed", reply
    # a single frame (no header at all)
    frames = _ask(dealer, b"lonely")
    assert isinstance(decode_reply(frames[1]), m.Error)
    # well-formed but out of place
    reply = decode_reply(_ask(dealer, b"x", encode(m.Lookup("who?", b"\0\0\0\0")))[1])
    assert reply == m.Error("unknown_client", "client 'who?' is not registered (call RegisterClient first)")
    reply = decode_reply(_ask(dealer, b"x", encode(m.Lookup(ctx.client_id, b"\0\0\0")))[1])
    assert (
        isinstance(reply, m.Error) and reply.code == "bad_request" and "not a whole number of uint32" in reply.message
    )
    reply = decode_reply(_ask(dealer, b"x", encode(m.CommitStore(ctx.client_id, "never-opened", [0])))[1])
    assert isinstance(reply, m.Error) and reply.code == "session"
    reply = decode_reply(_ask(dealer, b"x", encode(m.RegisterClient(99, "i", MODEL)))[1])
    assert reply == m.Error("protocol_version", f"client speaks protocol 99, server speaks {m.PROTOCOL_VERSION}")
    metrics = server.text("/metrics")
    assert 'kvdock_errors_total{code="malformed"} 6.0' in metrics, metrics
    # raw bytes that are not even ZMTP (libzmq may read them as ZMTP 1.0 frames: more malformed requests)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(os.urandom(10_000))
    # everyone is still served, data intact
    assert torch.equal(kvd.retrieve(ctx, tokens), kv)
    assert kvd.check_server_integrity(ctx) == []


def test_inline_commit_with_wrong_frames_stores_nothing(make_server) -> None:
    srv = make_server("--no-shm")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert c.transport == "inline"
        tokens = normalize_tokens(make_tokens(2 * CHUNK)).tobytes()
        prep = c.call(m.PrepareStore(c.client_id, "s", tokens)).reply
        assert [s.index for s in prep.slots] == [0, 1]
        with pytest.raises(kvd.InvalidInputError, match=r"^expected 2 frames of 3072 bytes, got 2 of sizes \[10\]$"):
            c.call(m.CommitStore(c.client_id, "s", [0, 1]), [memoryview(b"x" * 10)] * 2)
        assert kvd.lookup(c, make_tokens(2 * CHUNK)) == 0
        assert srv.get("/status")["l1"]["used_bytes"] == 0  # the reservations were released
        kv = make_kv(2 * CHUNK, seed=2)
        assert kvd.store(c, kv, make_tokens(2 * CHUNK))
        assert torch.equal(kvd.retrieve(c, make_tokens(2 * CHUNK)), kv)
        assert kvd.check_server_integrity(c) == []


def test_shm_client_cannot_claim_shm_without_proof(server) -> None:
    c = kvd.connect(server.url, server.http_url, MODEL, timeout=5)
    try:
        assert c.transport == "shm"
        reply = c.call(m.RegisterClient(m.PROTOCOL_VERSION, "x", MODEL, 0, "0" * 64)).reply
        assert reply.transport == "inline"
    finally:
        c.close()


def _nested_ping(depth: int) -> bytes:
    """A request map whose first field holds ``depth`` nested arrays, followed by its tag."""
    enc = msgspec.msgpack.encode
    return b"\x82" + enc("junk") + b"\x91" * depth + b"\xc0" + enc("type") + enc("Ping")


def test_a_deeply_nested_request_gets_an_error_reply(server, ctx, dealer) -> None:
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.send_multipart([b"deep", _nested_ping(5000)])
    try:
        frames: list[bytes] | None = dealer.recv_multipart()
    except zmq.Again:
        frames = None
    assert kvd.lookup(ctx, make_tokens(CHUNK)) == 0  # everyone else is still served
    assert kvd.check_server_integrity(ctx) == []
    assert frames is not None, "no reply at all to a malformed request"
    assert frames[0] == b"deep"
    reply = decode_reply(frames[1])
    assert isinstance(reply, m.Error) and reply.code == "malformed", reply


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_a_frame_larger_than_any_request_is_not_buffered(make_server) -> None:
    srv = make_server(l1_size="16MiB")  # no request needs a frame much over the pool's size
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.url)
    try:
        before = _peak_rss(srv.proc.pid)
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.send_multipart([b"big", bytes(512 * 2**20)], copy=False)
        # a reply (the frame was buffered and decoded), or the server hanging up (dropped unread),
        # or nothing for 10 s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(events, zmq.POLLIN)
        poller.poll(10_000)
        sock.disable_monitor()
        events.close()
        grew = _peak_rss(srv.proc.pid) - before
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:  # still serving
            assert kvd.check_server_integrity(c) == []
        assert grew < 256 * 2**20, f"the server buffered a {grew / 2**20:.0f} MiB junk frame"
    finally:
        sock.close()
        zctx.term()

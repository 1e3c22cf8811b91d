"""The read path with real processes: inline replies are private copies, so a client that stops
reading its socket holds no pool memory, and its unread bytes are visible and capped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens

STALLED = textwrap.dedent(
    """
    import os, signal, sys, time
    import zmq
    from kvdock.protocol import decode_reply, encode
    from kvdock.protocol import messages as m
    url, model, n, raw = sys.argv[1], sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.stdin.read())
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)  # its I/O thread stops taking replies off the socket at once
    sock.connect(url)
    sock.send_multipart([b"r", encode(m.RegisterClient(m.PROTOCOL_VERSION, "stalled", model))])
    reg = decode_reply(sock.recv_multipart()[1])
    for i in range(n):
        sock.send_multipart([b"%d" % i, encode(m.PrepareRetrieve(reg.client_id, f"s{i}", raw))])
    time.sleep(0.5)  # let zmq's I/O thread send the requests
    print(reg.transport, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # and never read a reply
    """
)


def test_a_client_that_never_reads_pins_nothing(make_server) -> None:
    srv = make_server(l1_size="8MiB")  # 2048 slots of 4 KiB
    tokens = make_tokens(1024 * CHUNK)  # half the pool: 3 MiB per reply
    kv = make_kv(1024 * CHUNK, seed=1)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
        child = zygote.Popen(
            [sys.executable, "-c", STALLED, srv.url, MODEL, "30"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(normalize_tokens(tokens).tobytes().hex())
            child.stdin.close()
            assert child.stdout.readline().strip() == "inline"
            deadline = time.monotonic() + 20
            while (status := srv.get("/status"))["l1"]["unsent_reply_bytes"] < 40 * 2**20 or status["sessions"]:
                assert time.monotonic() < deadline, status["l1"]
                time.sleep(0.05)
            # nothing of the pool is held for it: a store needing all of it evicts and succeeds
            other = make_kv(2048 * CHUNK, seed=2)
            assert kvd.store_chunks(c, other, make_tokens(2048 * CHUNK, start=10**6)).stored_chunks == 2048
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 20
        while srv.get("/status")["l1"]["unsent_reply_bytes"]:  # dropped with the peer
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert kvd.check_server_integrity(c) == []


def test_inline_retrieve_is_a_private_copy(make_server) -> None:
    srv = make_server("--no-shm")
    tokens = make_tokens(4 * CHUNK)
    old, new = make_kv(4 * CHUNK, seed=1), make_kv(4 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c.transport == "inline"
        assert kvd.store(c, old, tokens)
        got = kvd.retrieve(c, tokens)
        assert kvd.store(c, new, tokens, overwrite=True)  # the old slots are freed and reused
        assert kvd.store(c, make_kv(4 * CHUNK, seed=3), make_tokens(4 * CHUNK, start=9000))
        assert torch.equal(got, old)  # what was returned does not change under the caller
        assert torch.equal(kvd.retrieve(c, tokens), new)
        assert srv.get("/status")["sessions"] == 0  # inline reads hold no session after the reply
        assert kvd.check_server_integrity(c) == []


BIG = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 256}  # one chunk of 16 tokens: 1 MiB


def test_pipelined_retrieves_of_a_client_that_never_reads_stay_under_the_unsent_cap(make_server) -> None:
    srv = make_server(l1_size="192MiB", register=None)
    kvd.register_model(srv.url, srv.http_url, "big", dtype="bfloat16", **BIG, timeout=10)
    tokens = make_tokens(128 * CHUNK)  # 128 MiB per reply
    reply = 128 * 2**20
    with kvd.connect(srv.url, srv.http_url, "big", timeout=30) as c:
        d = BIG["num_kv_heads"] * BIG["head_dim"]
        assert kvd.store(c, torch.ones(2, BIG["num_layers"], len(tokens), d, dtype=torch.bfloat16), tokens)
        child = zygote.Popen(
            [sys.executable, "-c", STALLED, srv.url, "big", "14"],  # 14 retrieves, sent at once
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        peak = 0
        try:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(normalize_tokens(tokens).tobytes().hex())
            child.stdin.close()
            assert child.stdout.readline().strip() == "inline"
            # watched until the server has answered all 14 (a reply or BUSY each: then nothing more
            # can be queued for the child), at most 8 s
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline and peak <= 2**30 + reply:
                peak = max(peak, srv.get("/status")["l1"]["unsent_reply_bytes"])
                if _answered(srv, "PrepareRetrieve") >= 14:
                    peak = max(peak, srv.get("/status")["l1"]["unsent_reply_bytes"])
                    break
                time.sleep(0.1)
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 20
        while srv.get("/status")["l1"]["unsent_reply_bytes"]:  # dropped with the peer
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert kvd.check_server_integrity(c) == []
    assert peak <= 2**30 + reply, f"{peak / 2**30:.2f} GiB of replies held for one client that reads nothing"


def _answered(srv, request: str) -> int:  # type: ignore[no-untyped-def]
    """Requests of type ``request`` the server has answered (inline clients), from /metrics."""
    return int(
        srv.metric(
            f'kvdock_request_duration_seconds_count{{operation="retrieve",request="{request}",transport="inline"}}', 0
        )
    )


BATCH_READER = textwrap.dedent(
    """
    import sys
    import torch
    import kvdock.sdk as kvd
    from helpers import MODEL, make_kv, make_tokens
    url, http, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with kvd.connect(url, http, MODEL, timeout=60) as ctx:
        print("calling", flush=True)
        a, c = kvd.retrieve_many(ctx, [make_tokens(n), make_tokens(16, start=5_000_000)])
        print(torch.equal(a, make_kv(n, seed=1)), torch.equal(c, make_kv(16, seed=3)), flush=True)
    """
)


def test_a_batch_reply_buffer_is_not_reused_while_a_paused_client_has_not_read_it(make_server) -> None:
    """A batch's inline reply is one pooled buffer, given back only once zmq has written all of it:
    a retrieve of another client asking for a buffer of the same size while the first client is
    paused gets a new one (it once reused the buffer still queued for the paused client)."""
    import os
    import signal

    n = 4096 * CHUNK  # 12 MiB: more than the sockets buffer, so the send waits for the paused reader
    srv = make_server("--no-shm", l1_size="96MiB", env={"KVDOCK_FAULT_COPY_DELAY_S": "0.5"})
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as ctx:
        kvd.store(ctx, make_kv(n, seed=1), make_tokens(n))
        kvd.store(ctx, make_kv(16, seed=3), make_tokens(16, start=5_000_000))
        # as large as the batch's first prompt, and as the whole batch reply
        others = [make_tokens(n, start=1_000_000), make_tokens(n + 16, start=2_000_000)]
        for other in others:
            kvd.store(ctx, make_kv(len(other), seed=2), other)
        before, batch = srv.metric("kvdock_retrieved_bytes_total"), (n + 16) * ctx.geometry.chunk_nbytes(CHUNK) // CHUNK
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, os.environ.get("PYTHONPATH", "")])}
        child = zygote.Popen(
            [sys.executable, "-c", BATCH_READER, srv.url, srv.http_url, str(n)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "calling"
            time.sleep(0.2)  # the request is out; the server copies for 0.5 s
            os.kill(child.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while srv.metric("kvdock_retrieved_bytes_total") < before + batch and time.monotonic() < deadline:
                time.sleep(0.05)  # until the server has copied the batch's bytes...
            time.sleep(0.3)  # ... and handed them to zmq, which cannot write them all to the paused client
            for other in others:
                got = kvd.retrieve(ctx, other)
                assert got is not None and torch.equal(got, make_kv(len(other), seed=2))
        finally:
            os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=60)
        assert out.split() == ["True", "True"], out


def test_an_inline_batch_cannot_amplify_the_pool_into_a_huge_reply(make_server) -> None:
    """Prompts of a batch that share chunks get a copy each: 1100 copies of one 1 MiB chunk would
    be a 1.1 GiB reply from 1 MiB of pool. The server refuses it before allocating anything."""
    from kvdock.protocol import messages as m
    from kvdock.transport.client import ControlClient

    srv = make_server("--no-shm", register=None)
    kvd.register_model(srv.url, srv.http_url, "big", dtype="bfloat16", **BIG, timeout=10)
    tokens = make_tokens(CHUNK)
    raw = normalize_tokens(tokens).tobytes()
    with kvd.connect(srv.url, srv.http_url, "big", timeout=30) as c:
        d = BIG["num_kv_heads"] * BIG["head_dim"]
        kv = torch.ones(2, BIG["num_layers"], CHUNK, d, dtype=torch.bfloat16)
        assert kvd.store(c, kv, tokens)
        client = ControlClient(srv.url, timeout=30)
        try:
            n = 1100
            msg = m.PrepareRetrieveMany(c.client_id, [f"s{i}" for i in range(n)], [raw] * n, [""] * n)
            err = client.call(msg).reply
        finally:
            client.close()
        assert isinstance(err, m.Error) and err.code == "limit"
        assert "inline reply would be 1153433600 bytes, over the limit of 1073741824 per client" in err.message
        status = srv.get("/status")
        assert status["sessions"] == 0 and status["l1"]["unsent_reply_bytes"] == 0
        many = kvd.retrieve_many(c, [tokens] * 300)  # the SDK keeps its batches well under the cap
        assert all(g is not None and torch.equal(g, kv) for g in many)
        assert srv.metric('kvdock_requests_total{op="PrepareRetrieveMany"}') == 1 + 2  # 300 MiB: 2 batches
        assert kvd.check_server_integrity(c) == []

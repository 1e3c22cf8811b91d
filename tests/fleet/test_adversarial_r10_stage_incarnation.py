"""A-STAGE (round 10) #2: a server whose poller is late reads L3 alone under the incarnation it
last knew, after the stream was lost and a new incarnation started.

A lost stream (evicted with its incarnation key, deleted) starts a new incarnation
(storage/_coherence_lua.py's incarnation(); L3 keys name it: RedisTier._key), so an overwrite
made after that deletes and writes the chunk under the new incarnation's keys only. A server
whose poller is late (an overloaded host: docs/scale-out.md) stops vouching and, after ten
bounds, answers reads from L3 alone (server/dispatch.py: "the shared tier (L3) is always
current"), but under the incarnation it last knew: it read the old incarnation's value, which
no overwrite deletes any more. Was a strict xfail; now such a read checks L3's incarnation after
it (RedisTier._superseded) and is a miss when it changed."""

from __future__ import annotations

import threading
from typing import Any

import redis as redis_py
import torch
from tests.helpers import CHUNK, MODEL, backlog, l3_coherence, make_kv, make_tokens, vouching, wait_for

import kvdock.sdk as kvd

STREAM = b"kvdock:v2:{invalidations}"
INCARNATION = STREAM + b":incarnation"


def test_a_server_with_a_late_poller_never_serves_from_l3_what_an_overwrite_under_a_new_incarnation_replaced(
    make_server, redis_server
) -> None:
    """A stores v1 (written down under incarnation I1). D's poller stops (an overloaded host:
    its poll hangs); D stops vouching. Redis loses the stream and its incarnation key (allkeys-lru,
    emulated by DEL; v1's value stays); the next poll of another server starts I2. C overwrites
    the chunk with v2 (acknowledged). D's retrieve, more than the bound later, waits ten bounds
    for a poll, then reads L3 alone: it must miss or serve v2, never v1."""
    url = redis_server.url
    a, c, d = (vouching(make_server, url) for _ in range(3))
    tokens = make_tokens(2 * CHUNK, start=107_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=115), make_kv(2 * CHUNK, seed=116)
    raw = redis_py.Redis.from_url(url)
    coherence = d.state.manager.coherence
    real_poll, go = coherence.poll, threading.Event()

    def late_poll() -> Any:
        go.wait(60)
        return real_poll()

    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cc = kvd.connect(c.url, c.http_url, MODEL, timeout=10)
    cd = kvd.connect(d.url, d.http_url, MODEL, timeout=10)
    try:
        assert kvd.store(ca, v1, tokens)
        wait_for(lambda: backlog(a) == 0, "A's write-down of v1")
        old = raw.get(INCARNATION)
        coherence.poll = late_poll
        wait_for(lambda: not l3_coherence(d)["vouched"], "D to stop vouching")
        raw.delete(STREAM, INCARNATION)  # (evicted: the objects' values stay)
        wait_for(lambda: raw.get(INCARNATION) not in (None, old), "a new incarnation")
        wait_for(lambda: c.state.manager.coherence.incarnation == raw.get(INCARNATION), "C to follow it")
        assert kvd.store(cc, v2, tokens, overwrite=True)  # acknowledged: v1 is replaced
        wait_for(lambda: backlog(c) == 0, "C's write-down of v2")
        got = kvd.retrieve(cd, tokens)  # (D waits ten bounds for a poll, then reads L3 alone)
        if got is not None:
            n = got.shape[2]
            assert not torch.equal(got, v1[:, :, :n]), (
                f"D serves {n // CHUNK} chunk(s) of v1, which C's overwrite replaced"
            )
            assert torch.equal(got, v2[:, :, :n]), "D serves bytes of no store"
    finally:
        go.set()
        coherence.poll = real_poll
        raw.close()
        for ctx in (ca, cc, cd):
            kvd.close(ctx)

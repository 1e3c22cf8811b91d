"""LRU eviction in a real server's small pool: pinned objects stay, least recently used go first."""

from __future__ import annotations

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m


def _tok(name: str) -> list[int]:
    # one chunk per name, distinct first token so every chunk is its own prefix
    return make_tokens(CHUNK, start=1000 * (ord(name) - ord("A") + 1))


def _pin(c: kvd.KVCacheContext, name: str) -> None:
    reply = c.call(m.PrepareRetrieve(c.client_id, f"pin-{name}", normalize_tokens(_tok(name)).tobytes())).reply
    assert len(reply.slots) == 1


def _unpin(c: kvd.KVCacheContext, name: str) -> None:
    c.call(m.CommitRetrieve(c.client_id, f"pin-{name}"))


def test_lru_order_and_pins(make_server) -> None:
    srv = make_server(l1_size="16KiB")  # exactly four 4 KiB slots
    kvs = {n: make_kv(CHUNK, seed=i) for i, n in enumerate("ABCDEFGH")}
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        for n in "ABCD":
            assert kvd.store(c, kvs[n], _tok(n))
        assert torch.equal(kvd.retrieve(c, _tok("A")), kvs["A"])  # A becomes most recently used
        _pin(c, "B")  # LRU now: C, D, A (B pinned)
        for new, evicted in (("E", "C"), ("F", "D"), ("G", "A")):
            assert kvd.store(c, kvs[new], _tok(new))
            assert kvd.lookup(c, _tok(evicted)) == 0, f"{new} should have evicted {evicted}"
            assert kvd.check_server_integrity(c) == []
        present = {n: kvd.lookup(c, _tok(n)) == CHUNK for n in "ABCDEFG"}
        assert present == {"A": False, "B": True, "C": False, "D": False, "E": True, "F": True, "G": True}
        assert torch.equal(kvd.retrieve(c, _tok("B")), kvs["B"])  # pinned object intact
        for n in "EFG":
            _pin(c, n)
        with pytest.raises(kvd.PoolFullError):
            kvd.store(c, kvs["H"], _tok("H"))
        for n in "BEFG":
            _unpin(c, n)
        assert kvd.store(c, kvs["H"], _tok("H"))
        assert kvd.check_server_integrity(c) == []
    status = srv.get("/status")
    assert status["l1"]["evictions"] == 4 and status["l1"]["objects"] == 4 and status["sessions"] == 0
    metrics = srv.text("/metrics")
    assert "kvdock_evictions_total 4.0" in metrics

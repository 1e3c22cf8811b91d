"""tests/fleet/test_fleet_superseded.py's plain store superseded mid-copy, over the inline
transport (a server started with --no-shm) and for a whole-model client of a model stored in
two shards (tensor parallel): the counts are exact (chunks x shards), nothing is kept, and the
overwrite's bytes are what both servers return. Real servers sharing one real Redis."""

from __future__ import annotations

import pytest
import torch
from tests.fleet.test_fleet_coherence import _retrieve, _status, fleet
from tests.fleet.test_fleet_superseded import _in_thread, chunks_of, gated
from tests.helpers import CHUNK, MODEL, make_tokens, wait_for

import kvdock.sdk as kvd
from kvdock.sdk import _transfer

TP = "tp"


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_superseded_store_is_counted_exactly(
    make_server, redis_server, monkeypatch, transport, shards, overwrite
) -> None:
    """B's store (a plain one, or an overwrite) is paused mid-copy while A's overwrite of the same
    tokens is acknowledged and B applies its entries: B keeps none of it, in any shard."""
    a, b = fleet(make_server, redis_server, 2, *(("--no-shm",) if transport == "inline" else ()))
    model = MODEL if shards == 1 else TP
    for s in (a, b) if shards == 2 else ():
        kvd.register_model(s.url, s.http_url, TP, num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                           world_size=2, rank=1, timeout=10)  # fmt: skip
    ca = kvd.connect(a.url, a.http_url, model, timeout=10)
    cb = kvd.connect(b.url, b.http_url, model, timeout=10)
    assert cb.transport == transport and cb.shards == shards
    g = torch.Generator().manual_seed(3)
    shape = (2, cb.geometry.num_layers, 2 * CHUNK, cb.geometry.num_kv_heads * cb.geometry.head_dim)
    tokens = make_tokens(2 * CHUNK, start=9_300_000 + 1000 * shards + 100 * overwrite + (transport == "inline"))
    try:
        mine = torch.randn(shape, generator=g).to(torch.bfloat16)
        theirs = torch.randn(shape, generator=g).to(torch.bfloat16)
        published, applied = _status(b)["published"], _status(b)["entries_applied"]
        with gated(monkeypatch, _transfer.InlineTransfer if transport == "inline" else _transfer.ShmTransfer) as gate:
            out = _in_thread(gate, lambda: kvd.store_chunks(cb, mine, tokens, overwrite=overwrite))
            if overwrite:  # (B's E1 and E2 first: A's overwrite is the later one)
                wait_for(lambda: _status(b)["published"] >= published + 2, "B's entries")
            assert kvd.store(ca, theirs, tokens, overwrite=True)
            mine_too = 2 if overwrite else 0  # (B applies its own E1 and E2 too)
            wait_for(lambda: _status(b)["entries_applied"] >= applied + mine_too + 2, "B to apply A's entries")
            gate.go.set()
            assert gate.thread is not None
            gate.thread.join(30)
        assert out == {"result": kvd.StoreResult(0, 0, 0, 0, 0, 2 * shards)}
        got = _retrieve(cb, tokens)
        assert got is None or torch.equal(got, theirs[:, :, : got.shape[2]]), chunks_of(got, mine=mine, theirs=theirs)
        assert torch.equal(_retrieve(ca, tokens), theirs)
        assert kvd.check_server_integrity(cb) == [] and kvd.check_server_integrity(ca) == []
    finally:
        kvd.close(ca)
        kvd.close(cb)

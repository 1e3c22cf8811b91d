"""A store committed in parts (issue 26) on one server of a fleet sharing an L3 (a real
redis-server) while another server overwrites the same tokens between its parts (adversarial,
A-PARTS). A part's chunks are committed (not reserved) while the rest is copied, so an overwrite
of them is not held off as contended: it goes through, and what every server serves afterwards
must be the overwrite's version (or a miss), never a chain of the two versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tests.helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for

import kvdock.sdk as kvd
from kvdock.sdk import _storeparts as storeparts

N = 8


class Held:
    """Copies chunks of ``kv``; at chunk ``at`` waits for ``go`` (``reached`` set on arrival)."""

    def __init__(self, kv: torch.Tensor, at: int) -> None:
        self.kv, self.at = kv, at
        self.reached, self.go = threading.Event(), threading.Event()

    def put(self, index: int, dst: torch.Tensor) -> None:
        if index == self.at:
            self.reached.set()
            assert self.go.wait(30), "never let go"
        dst.copy_(self.kv[:, :, index * CHUNK : (index + 1) * CHUNK])


def _versions(got: torch.Tensor | None, v1: torch.Tensor, v2: torch.Tensor) -> list[int]:
    """Per chunk of ``got``: 1 or 2 (which version it is), 0 for other bytes."""
    out = []
    for i in range(0 if got is None else got.shape[2] // CHUNK):
        part = got[:, :, i * CHUNK : (i + 1) * CHUNK].view(torch.int16)  # type: ignore[index]
        span = slice(i * CHUNK, (i + 1) * CHUNK)
        out.append(
            1
            if torch.equal(part, v1[:, :, span].view(torch.int16))
            else 2
            if torch.equal(part, v2[:, :, span].view(torch.int16))
            else 0
        )
    return out


@pytest.mark.parametrize("k", [2, 4], ids=["overwrite-of-one-part", "overwrite-of-both-parts"])
def test_an_overwrite_of_committed_parts_mid_store_is_what_the_fleet_serves(
    make_server, redis_server, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """A stores v1 of 8 chunks through server 0 in parts of 2, held after two parts (chunks 0-3
    committed, 4-7 reserved); B overwrites the first ``k`` chunks with v2 through server 1 (it
    goes through: those chunks are committed, not in flight); A then finishes. Every server
    serves v2's first ``k`` chunks or a prefix of them, never a v1 chunk after them."""
    monkeypatch.setattr(storeparts, "PART_BYTES", 1)
    servers = [make_server("--redis-url", redis_server.url, "--no-disk") for _ in range(3)]
    tokens = make_tokens(N * CHUNK, 9_100_000 + k * 1000)
    v1, v2 = make_kv(N * CHUNK, seed=61), make_kv(N * CHUNK, seed=62)
    ctxs = [kvd.connect(s.url, s.http_url, MODEL, timeout=10) for s in servers]
    try:
        src = Held(v1, 4)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(kvd.store_from(ctxs[0], src, tokens)))
        t.start()
        assert src.reached.wait(10)
        wait_for(lambda: kvd.lookup(ctxs[0], tokens) == 4 * CHUNK, "A's two parts")
        r = kvd.store_chunks(ctxs[1], v2[:, :, : k * CHUNK], tokens[: k * CHUNK], overwrite=True)
        assert r.stored_chunks == k, r
        acked = time.monotonic()
        src.go.set()
        t.join(30)
        assert len(out) == 1 and isinstance(out[0], kvd.StoreResult), out
        for s in servers:
            wait_for(lambda s=s: s.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "write-downs")
            wait_for(lambda s=s: s.get("/status")["tiers"]["l3"]["coherence"]["vouched"], "vouching")
        wait_for(lambda: time.monotonic() - acked > 1.0, "past the coherence bound")
        for i, c in enumerate(ctxs):
            got = _versions(kvd.retrieve(c, tokens), v1, v2)
            assert got == [2] * len(got) and len(got) <= k, f"server {i} serves chunks of versions {got}"
            assert kvd.check_server_integrity(c) == []
    finally:
        for c in ctxs:
            c.close()

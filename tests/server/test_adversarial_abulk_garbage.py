"""Adversarial A-BULK (item 5): garbage CommitStore on a multi-chunk session (repeated, out of
range, foreign and partial chunk lists) against the bulk L1Store.commit; every refusal leaves
nothing half-committed, what a partial commit did commit holds exactly its own bytes, integrity
stays clean and the server keeps serving another client."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m

N = 8  # chunks of the session


def _frames(kv: torch.Tensor, chunks: list[int]) -> list[memoryview]:
    """One frame per listed chunk: that chunk's KV bytes, in the SDK's slot layout (2, L, C, D)."""
    out = []
    for c in chunks:
        part = kv[:, :, c * CHUNK : (c + 1) * CHUNK].contiguous()
        out.append(memoryview(part.view(torch.uint8).numpy().tobytes()))
    return out


@pytest.mark.parametrize("overwrite", [False, True])
def test_garbage_commit_lists_on_a_multi_chunk_session(make_server, overwrite: bool) -> None:
    srv = make_server("--no-shm")
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as other,
    ):
        assert c.transport == "inline"
        tokens = make_tokens(N * CHUNK, start=5000)
        raw = normalize_tokens(tokens).tobytes()
        base = make_kv(N * CHUNK, seed=11)
        if overwrite:  # an older version underneath: a refused overwrite must leave it whole
            assert kvd.store(c, base, tokens)
        kv = make_kv(N * CHUNK, seed=12)
        bad_lists = [
            [0, 0, 1],  # repeated
            [0, 1, 1, 2, 3, 4, 5, 6],
            [N],  # out of range
            [-1, 0],
            [2**63 - 1],
            [0, 1, 2**40],
        ]
        checked = 0
        for i, chunks in enumerate(bad_lists):
            sid = f"s{i}"
            prep = c.call(m.PrepareStore(c.client_id, sid, raw, overwrite=overwrite)).reply
            assert [s.index for s in prep.slots] == list(range(N))
            with pytest.raises(kvd.KVCacheSDKError):
                c.call(m.CommitStore(c.client_id, sid, chunks), _frames(kv, [x if 0 <= x < N else 0 for x in chunks]))
            # nothing of the new version is visible; the old one (if any) is whole or a miss
            got = kvd.retrieve(other, tokens)
            if got is not None:
                assert torch.equal(got, base[:, :, : got.shape[2]]), f"after garbage {chunks}: not the old bytes"
            checked += 1
            _end(c, sid)
        # a foreign session: another client's session id is not ours
        prep = other.call(m.PrepareStore(other.client_id, "foreign", raw, overwrite=overwrite)).reply
        with pytest.raises(kvd.KVCacheSDKError):
            c.call(m.CommitStore(c.client_id, "foreign", [0, 1]), _frames(kv, [0, 1]))
        with pytest.raises(kvd.KVCacheSDKError):  # and the owner commits with wrong frames
            other.call(m.CommitStore(other.client_id, "foreign", [0, 1]), _frames(kv, [0]))
        # a partial list of a fresh session: only those chunks, each with its own bytes
        sid = "partial"
        prep = c.call(m.PrepareStore(c.client_id, sid, raw, overwrite=overwrite)).reply
        reserved = [s.index for s in prep.slots]
        pick = [x for x in reserved if x % 3 != 1][::-1]  # out of order, with holes
        c.call(m.CommitStore(c.client_id, sid, pick), _frames(kv, pick))
        got = kvd.retrieve(other, tokens)
        n = 0 if got is None else got.shape[2] // CHUNK
        for j in range(n):
            span = slice(j * CHUNK, (j + 1) * CHUNK)
            want = kv if (j in pick) else base
            assert torch.equal(got[:, :, span], want[:, :, span]), f"chunk {j} of a partial commit {pick}: wrong bytes"
        # the server is whole and serves everyone
        assert kvd.check_server_integrity(c) == []
        report = c.call(m.CheckIntegrity()).reply
        assert report.ok and report.problems == [], report
        kv2 = make_kv(3 * CHUNK, seed=13)
        t2 = make_tokens(3 * CHUNK, start=90000)
        assert kvd.store(other, kv2, t2)
        assert torch.equal(kvd.retrieve(c, t2), kv2)
        assert checked == len(bad_lists)
        print(f"partial {pick}: served {n} chunks")


def _end(c: kvd.KVCacheContext, sid: str) -> None:
    """End the session if the refusal left it open (its reservations freed)."""
    with contextlib.suppress(kvd.KVCacheSDKError):
        c.call(m.EndSession(c.client_id, sid))

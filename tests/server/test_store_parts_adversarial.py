"""Adversarial tests of a store committed in parts (CommitStore ``more``, sdk._storeparts,
server.storing._commit_part; issue 26), through real servers, real shared memory and, where a
process boundary matters, a client process that is killed between parts. Two of them pinned
bugs (strict xfails until a7b6bd5): a lease that ran out between parts made the store say
"nothing was stored" although its parts were; a part's committed chunks were evictable until the
last CommitStore (another store punched a hole under the later parts).

Every store here splits (``PART_BYTES`` = 1 in this process and in the client process): 8 chunks
copy in parts of 2, and the SDK commits the first three parts (``more``) before its last
CommitStore."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, AnyServer, make_kv, make_tokens, wait_for
from kvdock.errors import BadRequestError
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import messages as m
from kvdock.sdk import _storeparts as storeparts
from kvdock.sdk.chunks import TensorChunks

N = 8  # chunks a store

# A client process: stores N chunks (tokens from argv[3], KV of seed argv[4]) through the SDK,
# parts forced; its source prints {"at": i} and blocks at chunk argv[5] (its part's first).
CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[6])
import kvdock.sdk as kvd
from kvdock.sdk import _storeparts
from helpers import CHUNK, MODEL, make_kv, make_tokens
_storeparts.PART_BYTES = 1
url, http, start, seed, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
kv = make_kv(8 * CHUNK, seed=seed)

class Src:
    def put(self, i, dst):
        if i == hold:
            print(json.dumps({"at": i}), flush=True)
            time.sleep(3600)
        dst.copy_(kv[:, :, i * CHUNK : (i + 1) * CHUNK])

with kvd.connect(url, http, MODEL, timeout=10) as ctx:
    kvd.store_from(ctx, Src(), make_tokens(8 * CHUNK, start))
"""


@pytest.fixture(autouse=True)
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storeparts, "PART_BYTES", 1)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Held:
    """A source that copies chunks of ``kv`` and, at chunk ``at``, waits until ``go`` is set
    (``reached`` is set on arrival): the store is held between its parts."""

    def __init__(self, kv: torch.Tensor, at: int) -> None:
        self.kv, self.at = kv, at
        self.reached, self.go = threading.Event(), threading.Event()

    def put(self, index: int, dst: torch.Tensor) -> None:
        if index == self.at:
            self.reached.set()
            assert self.go.wait(30), "never let go"
        dst.copy_(self.kv[:, :, index * CHUNK : (index + 1) * CHUNK])


def test_a_client_killed_between_parts_leaves_its_committed_parts_whole(
    make_server: Callable[..., AnyServer],
) -> None:
    """SIGKILL in the third part's copy (chunks 0-3 committed by two parts): exactly those 4
    chunks are visible, bytes exact; the session's other slots are quarantined and then freed
    (the writer is gone); the rest stores later."""
    srv = make_server("--session-ttl", "0.5")
    tokens, kv = make_tokens(N * CHUNK, 1000), make_kv(N * CHUNK, seed=11)
    tests = str(Path(__file__).resolve().parent.parent)
    args = [srv.url, srv.http_url, "1000", "11", "5", tests]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"at": 5}  # type: ignore[union-attr]
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
            wait_for(lambda: kvd.lookup(ctx, tokens) == 4 * CHUNK, "the two parts")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 4 * CHUNK])
            wait_for(lambda: srv.get("/status")["sessions"] == 0, "the lease to run out")
            wait_for(lambda: srv.get("/status")["l1"]["quarantined_bytes"] == 0, "the dead writer's slots")
            assert kvd.lookup(ctx, tokens) == 4 * CHUNK
            assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 4 * CHUNK])
            assert kvd.check_server_integrity(ctx) == []
            r = kvd.store_chunks(ctx, kv, tokens)
            assert (r.stored_chunks, r.deduped_chunks) == (N - 4, 4)
            assert same(kvd.retrieve(ctx, tokens), kv)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_lease_that_runs_out_between_parts_does_not_say_nothing_was_stored(
    make_server: Callable[..., AnyServer],
) -> None:
    srv = make_server("--session-ttl", "0.3")
    tokens, kv = make_tokens(N * CHUNK, 2000), make_kv(N * CHUNK, seed=12)
    src = Held(kv, 4)  # (chunks 0-3 committed by two parts when it holds)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(_store(ctx, src, tokens)))
        t.start()
        assert src.reached.wait(10)
        wait_for(lambda: srv.get("/status")["sessions"] == 0, "the store's lease to run out")
        src.go.set()
        t.join(30)
        assert kvd.lookup(ctx, tokens) == 4 * CHUNK  # (holds: the parts are there, whole)
        assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 4 * CHUNK])
        assert kvd.check_server_integrity(ctx) == []
        (got,) = out
        if isinstance(got, BaseException):  # an error may say the lease ran out, but not that nothing was stored
            assert "nothing was stored" not in str(got), got
        else:
            assert isinstance(got, kvd.StoreResult) and got.stored_chunks == 4, got


def _store(ctx: kvd.KVCacheContext, src: Held, tokens: list[int]) -> object:
    try:
        return kvd.store_from(ctx, src, tokens)
    except Exception as e:  # (the thread hands it to the test)
        return e


def test_a_store_in_parts_keeps_its_committed_parts_until_its_last_commit(
    make_server: Callable[..., AnyServer],
) -> None:
    """A pool of 64 slots: A stores 80 chunks (64 reserved, 16 pool_full) in parts of 16; held
    after two parts (32 chunks committed), B stores 30 other chunks; then A's copy goes on."""
    srv = make_server(l1_size="256KiB")
    n = 80
    ta, ka = make_tokens(n * CHUNK, 60000), make_kv(n * CHUNK, seed=51)
    tb, kb = make_tokens(30 * CHUNK, 70000), make_kv(30 * CHUNK, seed=52)
    src = Held(ka, 40)
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as b,
    ):
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(_store(a, src, ta)))
        t.start()
        assert src.reached.wait(10)
        wait_for(lambda: kvd.lookup(b, ta) == 32 * CHUNK, "A's two parts")
        try:
            rb = kvd.store_chunks(b, kb, tb).stored_chunks
        except kvd.PoolFullError:  # (what B gets while A's 64 reserved slots are unevictable)
            rb = 0
        src.go.set()
        t.join(30)
        (ra,) = out
        assert isinstance(ra, kvd.StoreResult) and (ra.stored_chunks, ra.pool_full_chunks) == (64, 16), ra
        got = kvd.retrieve(a, ta)
        assert got is None or same(got, ka[:, :, : got.shape[2]])  # (holds: never wrong bytes)
        assert kvd.check_server_integrity(a) == []
        hit = kvd.lookup(a, ta) // CHUNK
        assert hit == 64, f"A finds {hit} of the 64 chunks it stored; B stored {rb} (evicting A's parts)"


def _prepare(ctx: kvd.KVCacheContext, tokens: list[int], sid: str) -> list[m.SlotRef]:
    whole = np.asarray(tokens, TOKEN_DTYPE).tobytes()
    return list(ctx.ask(m.PrepareStore(ctx.client_id, sid, whole, "", False)).slots)


def test_garbage_parts_are_refused_and_the_store_and_server_go_on(
    make_server: Callable[..., AnyServer],
) -> None:
    """Forged CommitStore(more=True) frames on the control socket: another session, repeated,
    negative and out-of-range indexes, a long list of indexes the session did not reserve,
    payload frames, a retrieve session: each refused with a clear error, the session intact;
    the store then commits whole and exact, and the manager is consistent."""
    srv = make_server()
    tokens, kv = make_tokens(N * CHUNK, 3000), make_kv(N * CHUNK, seed=13)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        slots = _prepare(ctx, tokens, "s")
        with ctx.transfer() as t:
            t.write(slots[:2], TensorChunks(kv, CHUNK))
        cid = ctx.client_id
        bad = [
            ([0], "nope", "no open session"),
            ([0, 0], "s", "repeat or are out of range"),
            ([-1], "s", "repeat or are out of range"),
            ([2**62], "s", "repeat or are out of range"),
            ([2**63 - 1], "s", "repeat or are out of range"),
            (list(range(N, N + 100_000)), "s", "not reserved"),
            ([0, 99], "s", "not reserved"),
        ]
        for chunks, sid, match in bad:
            with pytest.raises(kvd.LeaseExpiredError, match=match):
                ctx.ask(m.CommitStore(cid, sid, chunks, more=True))
        with pytest.raises(BadRequestError, match="only a shared-memory client"):
            ctx.ask(m.CommitStore(cid, "s", [0], more=True), [memoryview(bytes(3072))])
        other, other_kv = make_tokens(2 * CHUNK, 4000), make_kv(2 * CHUNK, seed=14)
        assert kvd.store(ctx, other_kv, other)  # (a retrieve session of it pins them)
        ctx.ask(m.PrepareRetrieve(cid, "r", np.asarray(other, TOKEN_DTYPE).tobytes(), ""))
        with pytest.raises(kvd.LeaseExpiredError, match="not reserved"):
            ctx.ask(m.CommitStore(cid, "r", [0], more=True))
        ctx.ask(m.EndSession(cid, "r"))
        assert kvd.lookup(ctx, tokens) == 0  # nothing of the garbage committed
        assert ctx.ask(m.CommitStore(cid, "s", [0, 1], more=True)).committed == 2
        assert same(kvd.retrieve(ctx, tokens), kv[:, :, : 2 * CHUNK])
        with ctx.transfer() as t:
            t.write(slots[2:], TensorChunks(kv, CHUNK))
        assert ctx.ask(m.CommitStore(cid, "s", list(range(N)))).committed == N
        assert same(kvd.retrieve(ctx, tokens), kv)
        assert kvd.check_server_integrity(ctx) == []
        assert srv.get("/status")["sessions"] == 0

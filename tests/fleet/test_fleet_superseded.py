"""A store whose chunks an overwrite through another server of the fleet supersedes while its
copy is under way: the server commits none of them (storage.commits), and the SDK says so
(``StoreResult.superseded_chunks``; an overwrite not kept raises StoreConflictError) instead of
counting them as already stored. Real servers sharing one real Redis."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from tests.fleet.test_fleet_coherence import _retrieve, _status, fleet
from tests.helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for

import kvdock.sdk as kvd
from kvdock.cli.main import main
from kvdock.sdk import _transfer


class Gate:
    """Holds the copy of one thread's store (its slots reserved, its commit not sent) until
    ``go`` is set: a client paused mid-store, which no real part does on demand."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None


@contextmanager
def gated(
    monkeypatch: pytest.MonkeyPatch, transfer: type[_transfer.Transfer] = _transfer.ShmTransfer
) -> Iterator[Gate]:
    """A Gate on ``transfer``'s writes (InlineTransfer: a client of a --no-shm server)."""
    gate = Gate()
    real = transfer.write

    def write(self, slots, source):  # type: ignore[no-untyped-def]
        if threading.current_thread() is gate.thread:
            gate.entered.set()
            assert gate.go.wait(30)
        return real(self, slots, source)

    monkeypatch.setattr(transfer, "write", write)
    try:
        yield gate
    finally:
        gate.go.set()


def _in_thread(gate: Gate, fn) -> dict[str, object]:  # type: ignore[no-untyped-def]
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # (asserted by the test)
            out["error"] = e

    gate.thread = threading.Thread(target=run)
    gate.thread.start()
    assert gate.entered.wait(30), out
    return out


def chunks_of(got: torch.Tensor, **kvs: torch.Tensor) -> list[str]:
    """Whose bytes each chunk of ``got`` is (a name of ``kvs``, or "?")."""
    return [
        next((name for name, kv in kvs.items() if torch.equal(got[:, :, i : i + CHUNK], kv[:, :, i : i + CHUNK])), "?")
        for i in range(0, got.shape[2], CHUNK)
    ]


def test_a_plain_store_superseded_mid_copy_is_reported_superseded_not_deduped(
    make_server, redis_server, monkeypatch
) -> None:
    """B's plain store is paused mid-copy while A's overwrite of the same tokens is acknowledged
    and B applies its entries; then B's store goes on and commits nothing. Before:
    StoreResult(0, 2, 0, 0, 0), "both chunks already stored", for chunks B had just dropped."""
    a, b = fleet(make_server, redis_server, 2)
    tokens = make_tokens(2 * CHUNK, start=9_000_000)
    mine, theirs = make_kv(2 * CHUNK, seed=5), make_kv(2 * CHUNK, seed=6)
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        with gated(monkeypatch) as gate:
            out = _in_thread(gate, lambda: kvd.store_chunks(cb, mine, tokens))
            applied = _status(b)["entries_applied"]
            assert kvd.store(ca, theirs, tokens, overwrite=True)
            wait_for(lambda: _status(b)["entries_applied"] >= applied + 2, "B to apply A's entries")
            gate.go.set()
            assert gate.thread is not None
            gate.thread.join(30)
        assert out == {"result": kvd.StoreResult(0, 0, 0, 0, 0, 2)}
        got_b = _retrieve(cb, tokens)
        # never the superseded bytes (a prefix of theirs: B may not have loaded all of it yet)
        if got_b is not None:
            assert torch.equal(got_b, theirs[:, :, : got_b.shape[2]]), chunks_of(got_b, mine=mine, theirs=theirs)
        assert torch.equal(_retrieve(ca, tokens), theirs)
        assert kvd.check_server_integrity(cb) == [] and kvd.check_server_integrity(ca) == []
    finally:
        kvd.close(ca)
        kvd.close(cb)


@pytest.mark.parametrize("via", ["sdk", "cli"])
def test_an_overwrite_not_kept_raises_instead_of_reporting_nothing_new(
    make_server, redis_server, monkeypatch, capsys, tmp_path, via: str
) -> None:
    """An overwrite paused mid-copy past the fleet's window (storage.coherence.too_late: its
    writer was stopped ~8 s; the clock is the fault injected here) is not committed. Before:
    ``store(..., overwrite=True)`` returned False ("every chunk already stored"), and the
    caller believed its bytes were there; ``kvdock store --overwrite`` exited 0."""
    (b,) = fleet(make_server, redis_server, 1)
    tokens = make_tokens(2 * CHUNK, start=9_100_000 + 10_000 * (via == "cli"))
    old, mine = make_kv(2 * CHUNK, seed=7), make_kv(2 * CHUNK, seed=8)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    torch.save(mine, tmp_path / "kv.pt")
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    flags = ["--url", b.url, "--http-url", b.http_url, "--model", MODEL, "--kv", str(tmp_path / "kv.pt")]
    cli = ["store", *flags, "--tokens-file", str(tmp_path / "tokens.json"), "--overwrite"]
    try:
        assert kvd.store(cb, old, tokens)
        with gated(monkeypatch) as gate:
            overwrite = (lambda: main(cli)) if via == "cli" else (lambda: kvd.store(cb, mine, tokens, overwrite=True))
            out = _in_thread(gate, overwrite)
            coherence = b.state.manager.coherence
            b.call(lambda: setattr(coherence, "too_late", lambda position: True))
            gate.go.set()
            assert gate.thread is not None
            gate.thread.join(30)
        if via == "cli":
            assert out == {"result": 1}, out
            assert json.loads(capsys.readouterr().out) == dataclasses.asdict(kvd.StoreResult(0, 0, 0, 0, 0, 2))
        else:
            assert set(out) == {"error"}, out
            err = out["error"]
            assert isinstance(err, kvd.StoreConflictError)
            assert "2 chunk(s) of this overwrite were not kept" in str(err)
        # a refused overwrite kept none of its bytes; the older version is gone once B applies its
        # own E1 and E2 (storage.commits: "older versions stay gone, a miss"), or still there before
        got = _retrieve(cb, tokens)
        assert got is None or torch.equal(got, old[:, :, : got.shape[2]]), "a refused overwrite's bytes, or a mix"
        b.call(lambda: delattr(coherence, "too_late"))  # (the class's own again)
        assert kvd.store_chunks(cb, mine, tokens, overwrite=True) == kvd.StoreResult(2, 0, 0)  # the retry asked for
        assert torch.equal(_retrieve(cb, tokens), mine)
        assert kvd.check_server_integrity(cb) == []
    finally:
        kvd.close(cb)

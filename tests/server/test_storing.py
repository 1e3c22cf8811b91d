"""The store path with real processes: an inline CommitStore's bytes are copied into the slots off
the event loop, so a large (or slow) inline copy never stalls other clients."""

from __future__ import annotations

import threading
import time

import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens

SLOW_COPY = {"KVDOCK_FAULT_COPY_DELAY_S": "1.5"}  # each inline copy takes 1.5 s longer


def test_an_inline_copy_does_not_stall_other_clients(make_server) -> None:
    srv = make_server("--no-shm", env=SLOW_COPY)
    tokens, kv = make_tokens(4 * CHUNK), make_kv(4 * CHUNK, seed=1)
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as b,
    ):
        assert a.transport == "inline"
        result: list[bool] = []
        store = threading.Thread(target=lambda: result.append(kvd.store(a, kv, tokens)))
        t0 = time.monotonic()
        store.start()
        lookups = []
        while store.is_alive():
            s = time.monotonic()
            assert kvd.lookup(b, make_tokens(CHUNK, start=9000)) == 0
            lookups.append(time.monotonic() - s)
        store.join()
        assert result == [True] and time.monotonic() - t0 >= 1.5  # the copy really was slow
        assert len(lookups) >= 10 and max(lookups) < 0.5  # and nobody else waited for it
        lookups.clear()
        got: list[torch.Tensor | None] = []
        retrieve = threading.Thread(target=lambda: got.append(kvd.retrieve(a, tokens)))
        retrieve.start()
        while retrieve.is_alive():  # an inline retrieve's copy out of the slots, likewise
            s = time.monotonic()
            assert kvd.lookup(b, tokens) == 4 * CHUNK
            lookups.append(time.monotonic() - s)
        retrieve.join()
        assert torch.equal(got[0], kv)
        assert len(lookups) >= 10 and max(lookups) < 0.5
        assert kvd.check_server_integrity(b) == []

"""A hung kvdock server holds requests for one ``kvdock.timeout`` at most once: after a call
failed by hanging (``Link.slow``), the scheduler's next tries run on in the background and the
requests asked meanwhile are misses at once (the benchmark's stopped-server batches waited one
``kvdock.timeout`` each before this, since lookups ask the server: ``lookup_tips``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_scheduler import BLOCK, CHUNK, MODEL, request

import kvdock.sdk as kvd
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.scheduler import SchedulerSide
from kvdock.testing import ServerProcess, start_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="16MiB", log_path=tmp_path / "s.log")
    kvd.register_model(srv.url, srv.http_url, MODEL, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()


def answer(s: SchedulerSide, req: object, timeout: float = 30.0) -> tuple[int, float]:
    """The hit vLLM is finally told, asking like vLLM (once per step), and how long it took."""
    start = time.monotonic()
    while True:
        n, _ = s.matched_tokens(req, 0)
        if n is not None:
            return n, time.monotonic() - start
        assert time.monotonic() - start < timeout
        time.sleep(0.01)


def test_after_a_hung_call_requests_are_misses_at_once_until_a_try_succeeds(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDOCK_FAST_READS", "0")  # lookups must reach the server (a stopped one's directory answers)
    cfg = ConnectorConfig(
        url=server.url, http_url=server.http_url, model_name=MODEL, timeout=1.0, retry_s=0.5, lookup_wait=0.0
    )
    s = SchedulerSide(cfg, BLOCK)
    toks = list(range(1, 201))
    assert answer(s, request("warm", list(range(900, 1000))))[0] == 0  # connected; learns the chunk size
    assert not s.link.slow
    os.kill(server.proc.pid, signal.SIGSTOP)
    hit, took = answer(s, request("first", toks))  # the first hang: held one kvdock.timeout, a miss
    assert hit == 0 and took >= 0.9
    deadline = time.monotonic() + 30
    while not s.link.slow:  # the hung call fails (the SDK's timeout) and says so
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.6)  # past retry_s: the next lookup tries the server again (and hangs)
    for i in range(3):
        hit, took = answer(s, request(f"meanwhile{i}", toks))
        assert hit == 0 and took < 0.5, took  # not held for the try
    os.kill(server.proc.pid, signal.SIGCONT)
    with kvd.connect(server.url, server.http_url, MODEL) as ctx:
        kvd.store(ctx, torch.randn(2, 2, 128, 64), toks[:128])
    deadline = time.monotonic() + 30
    while True:  # a try succeeds: lookups are waited for, and hit, again
        hit, _ = answer(s, request(f"after{time.monotonic()}", toks))
        if hit == 128:
            break
        assert time.monotonic() < deadline, "lookups never came back"
        time.sleep(0.1)
    assert not s.link.slow
    s.shutdown()

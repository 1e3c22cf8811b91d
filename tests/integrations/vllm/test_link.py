"""The connector's link to kvdock against real servers: lazy connect, registration, a down
server as a miss with a retry period (injected clock), re-registration after a restart."""

from __future__ import annotations

from pathlib import Path

import kvdock.sdk as kvd
from kvdock.errors import PoolFullError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.link import Link
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import EngineInfo, ModelLayout
from kvdock.testing import free_port, start_server

LAYOUT = ModelLayout("linked", KVGeometry(2, 2, 32, "float32"), 32, EngineInfo(name="vllm"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def config(url: str, http_url: str) -> ConnectorConfig:
    return ConnectorConfig(url=url, http_url=http_url, model_name="linked", timeout=2.0, retry_s=5.0)


def test_a_down_server_is_a_miss_tried_again_only_after_retry_s() -> None:
    port, http = free_port(), free_port()
    clock = Clock()
    link = Link(config(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}"), LAYOUT, clock)
    assert link.run("lookup", lambda ctx: 1, 0) == 0
    assert link.failures == 1 and not link.up
    clock.now = 4.9
    assert link.run("lookup", lambda ctx: 1, 0) == 0
    assert link.failures == 1  # not even tried within retry_s
    clock.now = 5.1
    assert link.context() is None and link.failures == 2


def test_the_worker_link_registers_the_model_and_comes_back_after_a_restart(tmp_path: Path) -> None:
    srv = start_server("--no-disk", chunk_size=64, l1_size="16MiB", log_path=tmp_path / "a.log")
    clock = Clock()
    link = Link(config(srv.url, srv.http_url), LAYOUT, clock)
    try:
        assert link.run("lookup", lambda ctx: ctx.model_name, "") == "linked"  # registered on first use
        assert [m["model_name"] for m in kvd.server_status(srv.http_url)["cache_context_meta"]] == ["linked"]
        # the scheduler's link has no layout: it needs the worker's registration
        assert Link(config(srv.url, srv.http_url), None, clock).run("x", lambda ctx: 1, 0) == 1
        srv.stop()
        srv = start_server(
            "--no-disk",
            chunk_size=64,
            l1_size="16MiB",
            port=srv.port,
            http_port=srv.http_port,
            log_path=tmp_path / "b.log",
        )
        assert link.run("lookup", lambda ctx: kvd.lookup(ctx, list(range(64))), -1) == -1  # the old client is gone
        assert not link.up
        clock.now += 5.1
        assert link.run("lookup", lambda ctx: kvd.lookup(ctx, list(range(64))), -1) == 0  # registered again
        assert [m["model_name"] for m in kvd.server_status(srv.http_url)["cache_context_meta"]] == ["linked"]
    finally:
        link.close()
        srv.stop()


def test_transient_failures_are_misses_that_keep_the_link_up(tmp_path: Path) -> None:
    srv = start_server("--no-disk", chunk_size=64, l1_size="16MiB", log_path=tmp_path / "s.log")
    link = Link(config(srv.url, srv.http_url), LAYOUT, Clock())
    try:

        def full(ctx: kvd.KVCacheContext) -> int:
            raise PoolFullError("no room")

        assert link.run("save", full, -1) == -1
        assert link.up and link.failures == 0
    finally:
        link.close()
        srv.stop()

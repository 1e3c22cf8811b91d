"""The connector's link to kvdock against real servers: lazy connect, registration, a down
server as a miss with a retry period (injected clock), re-registration after a restart."""

from __future__ import annotations

from pathlib import Path

import msgspec

import kvdock.sdk as kvd
from kvdock.errors import PoolFullError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.link import Link
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import EngineInfo, ModelLayout
from kvdock.testing import free_ports, start_server

LAYOUT = ModelLayout("linked", KVGeometry(2, 2, 32, "float32"), 32, EngineInfo(name="vllm"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def config(url: str, http_url: str, name: str = "linked") -> ConnectorConfig:
    return ConnectorConfig(url=url, http_url=http_url, model_name=name, timeout=2.0, retry_s=5.0)


def test_a_down_server_is_a_miss_tried_again_only_after_retry_s() -> None:
    port, http = free_ports(2)
    clock = Clock()
    link = Link(config(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}"), LAYOUT, clock)
    assert link.run("lookup", lambda ctx: 1, 0) == 0
    assert link.failures == 1 and not link.up
    clock.now = 4.9
    assert link.run("lookup", lambda ctx: 1, 0) == 0
    assert link.failures == 1  # not even tried within retry_s
    clock.now = 5.1
    assert link.context() is None and link.failures == 2


def test_a_link_with_the_layout_registers_the_model_and_again_at_once_after_a_restart(tmp_path: Path) -> None:
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
        # the first call finds the model gone: the link registers it again at once, and answers
        assert link.run("lookup", lambda ctx: kvd.lookup(ctx, list(range(64))), -1) == 0
        assert link.up and link.failures == 0
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


def test_a_link_with_a_fingerprint_never_serves_another_models_kv(tmp_path: Path) -> None:
    """A name registered with another fingerprint refuses both roles' links for good (every call a
    miss); a name registered without one gets the engine's; "" checks nothing."""
    srv = start_server("--no-disk", chunk_size=64, l1_size="16MiB", log_path=tmp_path / "f.log")
    clock = Clock()
    mine = msgspec.structs.replace(LAYOUT, fingerprint="vllm-v1:mine")
    links: list[Link] = []
    try:
        kvd.register_layout(srv.url, srv.http_url, LAYOUT, 10)  # an SDK user's, without a fingerprint
        worker = Link(config(srv.url, srv.http_url), mine, clock, fingerprint="vllm-v1:mine")
        links.append(worker)
        # it registers again, and its context sees the name with its fingerprint
        assert worker.run("lookup", lambda ctx: ctx.layout.fingerprint, "") == "vllm-v1:mine"
        assert kvd.describe_server(srv.url, "linked", 10).layout.fingerprint == "vllm-v1:mine"  # type: ignore[union-attr]
        other = Link(config(srv.url, srv.http_url), None, clock, fingerprint="vllm-v1:other")  # a scheduler's
        links.append(other)
        assert other.run("lookup", lambda ctx: 1, 0) == 0 and not other.up
        assert other.refused == (
            "kvdock holds 'linked' as another model of the same geometry: fingerprint vllm-v1:mine (this engine's: "
            "vllm-v1:other); use another kvdock.model_name"
        )
        clock.now += 60  # for good: never tried again
        assert other.run("lookup", lambda ctx: 1, 0) == 0 and other.failures == 1
        kvd.register_layout(srv.url, srv.http_url, msgspec.structs.replace(mine, model_name="linked2"), 10)
        lay = msgspec.structs.replace(LAYOUT, model_name="linked2", fingerprint="vllm-v1:other")
        theirs = Link(config(srv.url, srv.http_url, "linked2"), lay, clock, fingerprint="vllm-v1:other")
        links.append(theirs)
        assert theirs.run("lookup", lambda ctx: 1, 0) == 0  # known with another fingerprint: refused at open
        assert "fingerprint vllm-v1:mine (this engine's: vllm-v1:other)" in theirs.refused
        plain = Link(config(srv.url, srv.http_url), None, clock)  # no fingerprint: nothing checked
        links.append(plain)
        assert plain.run("lookup", lambda ctx: 1, 0) == 1 and not plain.refused
    finally:
        for link in links:
            link.close()
        srv.stop()


def test_a_worker_link_refused_at_registration_says_why(tmp_path: Path) -> None:
    srv = start_server("--no-disk", chunk_size=64, l1_size="16MiB", log_path=tmp_path / "r.log")
    clock = Clock()
    try:
        other = msgspec.structs.replace(LAYOUT, geometry=KVGeometry(2, 1, 64, "float32"))
        kvd.register_layout(srv.url, srv.http_url, other, 10)  # the same chunk shape, other KV
        worker = Link(config(srv.url, srv.http_url), LAYOUT, clock, fingerprint="vllm-v1:mine")
        assert worker.run("lookup", lambda ctx: 1, 0) == 0 and not worker.up
        assert worker.refused.startswith("kvdock holds 'linked' as another model: registration: model 'linked' is")
        assert "different geometry" in worker.refused
    finally:
        srv.stop()

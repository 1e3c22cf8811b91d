from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, RedisProc, ServerProc, free_port, serving, start_server
from kvdock.testing import RedisCluster, cluster_ports

# tests/integrations/vllm needs vLLM, which lives in its own virtual environment (.ci/run makes it and runs
# them there; README "Tests"); a python without vLLM collects everything else.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAVE_VLLM else ["integrations/vllm"]


def pytest_report_header(config: pytest.Config) -> str:
    if HAVE_VLLM:
        return "vLLM: installed, tests/integrations/vllm collected"
    return "vLLM: not installed here, tests/integrations/vllm not collected (.ci/run runs them in their own venv)"


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers started without --disk-dir use $XDG_CACHE_HOME: keep the tests' L2 out of ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    """Factory: start a server (extra CLI flags as args), stopped and checked at teardown."""
    started: list[ServerProc] = []

    def make(*extra: str, l1_size: str = "64MiB", register: str | None = "bfloat16", **kw: object) -> ServerProc:
        srv = start_server(tmp_path, *extra, l1_size=l1_size, chunk_size=CHUNK, **kw)  # type: ignore[arg-type]
        started.append(srv)
        if register:
            kvd.register_model(srv.url, srv.http_url, MODEL, dtype=register, **GEOMETRY, timeout=10)
        return srv

    yield make
    for srv in started:
        if srv.proc.poll() is None:
            assert srv.stop() == 0, srv.log()


@pytest.fixture
def server(make_server: Callable[..., ServerProc]) -> ServerProc:
    """A fresh server: 64 MiB pool, chunk_size 16, model MODEL registered in bfloat16."""
    return make_server()


@pytest.fixture
def ctx(server: ServerProc) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        yield c


@pytest.fixture
def redis_server() -> Iterator[RedisProc]:
    """A real redis-server on a free loopback port, killed at teardown (restartable)."""
    r = RedisProc(free_port()).start()
    yield r
    r.stop()


@pytest.fixture(scope="module", params=["shm", "inline"])
def transport_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server per transport for a whole test module (MODEL registered): its tests store under
    tokens of their own."""
    with serving(tmp_path_factory.mktemp("server"), request.param) as srv:
        yield srv


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A real local Redis Cluster (3 masters, 3 replicas) on free loopback ports, killed at teardown."""
    work = tmp_path / "cluster"
    work.mkdir()
    cluster = RedisCluster(cluster_ports(6), work)
    try:
        yield cluster.start()
    finally:
        cluster.stop()

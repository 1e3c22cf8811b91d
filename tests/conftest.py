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
from kvdock.testing import SERVER_KINDS, RedisCluster, cluster_ports, server_binary

# tests/integrations/vllm needs vLLM, which lives in its own virtual environment (.ci/run makes it and runs
# them there; README "Tests"); a python without vLLM collects everything else.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAVE_VLLM else ["integrations/vllm"]


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [
        "vLLM: installed, tests/integrations/vllm collected"
        if HAVE_VLLM
        else "vLLM: not installed here, tests/integrations/vllm not collected (.ci/run runs them in their own venv)"
    ]
    for kind in SERVER_KINDS:
        try:
            lines.append(f"L3 server {kind}: {server_binary(kind)}")
        except RuntimeError as e:  # the tests that need it fail (their fixture raises the same), never skip
            lines.append(f"L3 server {kind}: MISSING, its tests will fail: {e}")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "valkey: run the test once per L3 server, redis-server and valkey-server (ids [redis], [valkey]): "
        "its redis_server / redis_cluster fixtures (and l3_server) follow the parameter",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``valkey`` that uses the L3 (``l3_server``, through ``redis_server`` /
    ``redis_cluster`` or by itself) runs on each of SERVER_KINDS; the others keep Redis only."""
    if "l3_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("valkey") is not None:
        metafunc.parametrize("l3_server", SERVER_KINDS, indirect=True)


@pytest.fixture
def l3_server(request: pytest.FixtureRequest) -> str:
    """Which server the test's L3 runs on (kvdock.testing.server_binary's ``kind``): "redis", or
    each of SERVER_KINDS in turn for a test marked ``valkey``."""
    return str(getattr(request, "param", "redis"))


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
def redis_server(l3_server: str) -> Iterator[RedisProc]:
    """A real redis-server (valkey-server for ``l3_server`` "valkey") on a free loopback port,
    killed at teardown (restartable)."""
    r = RedisProc(free_port(), server=l3_server).start()
    yield r
    r.stop()


@pytest.fixture(scope="module", params=["shm", "inline"])
def transport_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server per transport for a whole test module (MODEL registered): its tests store under
    tokens of their own."""
    with serving(tmp_path_factory.mktemp("server"), request.param) as srv:
        yield srv


@pytest.fixture
def redis_cluster(tmp_path: Path, l3_server: str) -> Iterator[RedisCluster]:
    """A real local Redis Cluster (3 masters, 3 replicas; of valkey-server for ``l3_server``
    "valkey") on free loopback ports, killed at teardown."""
    work = tmp_path / "cluster"
    work.mkdir()
    cluster = RedisCluster(cluster_ports(6), work, server=l3_server)
    try:
        yield cluster.start()
    finally:
        cluster.stop()

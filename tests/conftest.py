from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, ServerProc, start_server


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    """Factory: start a server (extra CLI flags as args), stopped and checked at teardown."""
    started: list[ServerProc] = []

    def make(*extra: str, l1_size: str = "64MiB", register: str | None = "bfloat16") -> ServerProc:
        srv = start_server(tmp_path, *extra, l1_size=l1_size, chunk_size=CHUNK)
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

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import ServerProc, start_server  # noqa: E402

import kvdock.sdk as kvd  # noqa: E402

MODEL = "tiny"
GEOMETRY = dict(num_layers=3, num_kv_heads=2, head_dim=8)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    """A fresh server: 64 MiB pool, chunk_size 16, model MODEL registered in bfloat16."""
    srv = start_server(tmp_path)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def ctx(server: ServerProc) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        yield c

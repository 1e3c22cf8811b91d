"""L2 on a disk that fills up and then has room again, with a real server on a real small file system
(a tmpfs mounted for the test: the tests run as root, here and in CI). ENOSPC cuts L2's budget, and
it comes back once the disk has room: later stores are written down to L2 again, ``/status`` says so
(``disk_full`` false, ``capacity_bytes`` the configured budget) and so does the log, once per
transition. Writes skipped while the disk was full stay counted."""

from __future__ import annotations

import errno
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, ServerProc, make_kv, make_tokens, start_server, tier, wait_for, wait_written

BUDGET = 1 << 20  # --disk-size: well below the file system's 4 MiB


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (created), unmounted at exit."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(path: Path) -> None:
    """Write ``path`` until its file system has no byte left (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for block in (1 << 20, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\xa5" * block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)


def backlog(srv: ServerProc) -> int:
    return int(srv.get("/status")["tiers"]["writeback_backlog_bytes"])


def test_l2_stores_again_once_a_full_disk_has_room(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "4m") as fs:
        l2 = fs / "l2"
        srv = start_server(tmp_path, "--disk-dir", str(l2), "--disk-size", str(BUDGET))
        try:
            kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            assert tier(srv, "l2")["capacity_bytes"] == BUDGET
            filler = fs / "filler"
            fill(filler)
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                assert kvd.store(c, make_kv(2 * CHUNK, seed=1), make_tokens(2 * CHUNK))
                wait_for(lambda: tier(srv, "l2")["writes_skipped"] >= 2 and backlog(srv) == 0, "the skipped writes")
                full = tier(srv, "l2")
                assert (full["disk_full"], full["capacity_bytes"], full["writes"], full["objects"]) == (True, 0, 0, 0)
                skipped = full["writes_skipped"]
                filler.unlink()  # room again: later stores are written down again (re-probed with backoff)
                deadline, i = time.monotonic() + 60, 0
                while tier(srv, "l2")["writes"] == 0:
                    assert time.monotonic() < deadline, f"L2 never stored again: {tier(srv, 'l2')}"
                    i += 1
                    assert kvd.store(c, make_kv(CHUNK, seed=100 + i), make_tokens(CHUNK, start=10_000 * i))
                    time.sleep(0.2)
                wait_for(lambda: backlog(srv) == 0, "the write-downs")
                back = tier(srv, "l2")
                assert back["disk_full"] is False and back["capacity_bytes"] == BUDGET
                assert back["writes_skipped"] >= skipped  # the writes skipped while full stay counted
                # a new store lands on disk, and comes back from there once L1 forgot it
                kv, tokens = make_kv(3 * CHUNK, seed=7), make_tokens(3 * CHUNK, start=900_000)
                assert kvd.store(c, kv, tokens)
                wait_written(srv, "l2", back["writes"] + 3)
                assert len(list(l2.glob("*/*.kv"))) == tier(srv, "l2")["objects"] >= 4
                clear = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
                urllib.request.urlopen(clear, timeout=10).read()
                out = kvd.retrieve(c, tokens)
                assert out is not None and torch.equal(out, kv)
                assert tier(srv, "l2")["hits"] == 3
        finally:
            assert srv.stop() == 0, srv.log()
    log = srv.log()
    assert log.count("L2: disk full at ") == 1, log
    assert log.count("has room again (") == 1, log
    assert f"budget back to {BUDGET} bytes" in log

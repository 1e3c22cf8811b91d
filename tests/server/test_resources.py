"""kvdock.server.resources: the server process keeps freed memory for its next inline payloads, so
receiving one costs no page faults once the first has been received (real server, real zmq)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import kvdock.sdk as kvd
from helpers import make_tokens, start_server
from kvdock.server.resources import FD_LIMIT

MODEL = "process-model"  # 8 layers x 4 heads x 128 x bf16: a 64-token chunk is 1 MiB


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_inline_stores_fault_no_new_memory_in_the_server(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--no-shm", l1_size="256MiB", chunk_size=64)
    try:
        kvd.register_model(srv.url, srv.http_url, MODEL, num_layers=8, num_kv_heads=4, head_dim=128, dtype="bfloat16")
        kv = torch.randn(2, 8, 32 * 64, 512).to(torch.bfloat16)  # 32 chunks: 32 MiB per store
        tokens = make_tokens(32 * 64)
        with kvd.connect(srv.url, srv.http_url, MODEL) as c:
            assert c.transport == "inline"
            for _ in range(2):  # the first ones fault the server's heap in
                assert kvd.store(c, kv, tokens, overwrite=True)
            before = minor_faults(srv.proc.pid)
            for _ in range(4):
                assert kvd.store(c, kv, tokens, overwrite=True)
            faults = minor_faults(srv.proc.pid) - before
            got = kvd.retrieve(c, tokens)
            assert got is not None and torch.equal(got, kv)
        # 4 stores of 32 MiB received into fresh mappings would fault 32,768 pages
        assert faults < 2000, faults
    finally:
        assert srv.stop() == 0


REUSE = """
import resource, sys
from kvdock.server.resources import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is True  # glibc: both settings taken
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buf = bytearray(64 << 20)  # malloc'd (and, by glibc's default, mmapped: fresh pages)
del buf
before = faults()
buf = bytearray(64 << 20)  # zeroed: every page touched
print(faults() - before)
"""


def test_memory_freed_by_the_server_process_is_reused_without_faults() -> None:
    def run(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert run("default") >= pages // 2  # glibc maps large blocks fresh and unmaps them when freed
    assert run("keep") < pages // 20  # kept in the heap: the second buffer reuses the first's pages
    assert FD_LIMIT == 1 << 16

"""Adversarial A-BULK (item 3): a writer process SIGSTOPped in the middle of its copy into the
shared-memory slots of a 48-chunk store, for longer than its session's lease (--session-ttl 0.3),
then SIGCONTinued: meanwhile another client overwrites the same keys through the same server
(whose bulk commits could take the slots the lease released) and readers on that server (fast
reads) and on a second server of the fleet (one L3) read every byte. A read that is not a miss is
one value throughout, of a store that was acknowledged or still in flight, never of a store that
failed; the stopped writer's late commit is refused; integrity stays clean."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from tests.helpers import CHUNK, MODEL, l3_coherence, make_tokens, wait_for

import kvdock.sdk as kvd
import zygote

pytestmark = pytest.mark.subprocess_server

N = 48  # chunks per store
TTL = 0.3  # --session-ttl of the writer's server

WRITER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, kvdock.sdk as kvd
    from kvdock.sdk import _transfer
    from helpers import make_tokens
    url, http, model, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    N, C = {n}, 16
    orig = _transfer.ShmTransfer.write
    count = [0]

    def write(self, slots, source):  # every 3rd store: half its chunks, then SIGSTOP itself
        count[0] += 1
        if count[0] % 3 or len(slots) < 2:
            return orig(self, slots, source)
        orig(self, slots[: len(slots) // 2], source)
        print("stopped", count[0], flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return orig(self, slots[len(slots) // 2 :], source)

    _transfer.ShmTransfer.write = write
    tokens = make_tokens(N * C, start=3000)
    with kvd.connect(url, http, model, timeout=10) as c, open(out, "w", buffering=1) as log:
        assert c.transport == "shm", c.transport
        for v in range(1, 22):
            log.write(f"begin {{v}}\\n")
            try:
                ok = kvd.store(c, torch.full((2, 3, N * C, 16), float(v), dtype=torch.bfloat16), tokens, overwrite=True)
                log.write(f"end {{v}} {{ok}}\\n")
            except Exception as e:
                log.write(f"fail {{v}} {{type(e).__name__}}\\n")
        print("done", flush=True)
    """
)


def test_a_writer_stopped_past_its_lease_mid_copy(make_server, redis_server, tmp_path: Path) -> None:
    s0 = make_server("--redis-url", redis_server.url, "--no-disk", "--session-ttl", str(TTL))
    s1 = make_server("--redis-url", redis_server.url, "--no-disk")
    for s in (s0, s1):
        wait_for(lambda s=s: l3_coherence(s)["vouched"], "vouching", 30)
    tokens = make_tokens(N * CHUNK, start=3000)
    log = tmp_path / "writer.log"
    script = WRITER.format(tests=str(Path(__file__).parent.parent), n=N)
    p = zygote.Popen(
        [sys.executable, "-c", script, s0.url, s0.http_url, MODEL, str(log)], stdout=subprocess.PIPE, text=True
    )
    stop = threading.Event()
    seen: dict[int, float] = {}  # value -> first time read
    errors: list[str] = []
    other: dict[int, object] = {}
    counts = {"reads": 0, "hits": 0, "other_overwrites": 0, "stops": 0}

    def reader(srv, seed: int) -> None:
        rng = random.Random(seed)
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            while not stop.is_set():
                k = rng.randint(1, N)
                got = kvd.retrieve(c, tokens[: k * CHUNK])
                counts["reads"] += 1
                if got is None:
                    continue
                counts["hits"] += 1
                vals = got.unique()
                if len(vals) != 1:
                    errors.append(f"a read of {k} chunks on {srv.port} mixes {vals.tolist()[:8]}")
                    continue
                seen.setdefault(int(vals[0].item()), time.monotonic())

    v_other = [100]

    def overwrite(c: kvd.KVCacheContext) -> None:  # the same keys, the same server, values 100..
        v = v_other[0]
        v_other[0] += 1
        kv = torch.full((2, 3, N * CHUNK, 16), float(v), dtype=torch.bfloat16)
        try:
            other[v] = kvd.store(c, kv, tokens, overwrite=True)
        except kvd.KVCacheSDKError as e:
            other[v] = repr(e)
        counts["other_overwrites"] += 1

    threads = [threading.Thread(target=reader, args=(s, i)) for i, s in enumerate((s0, s0, s1))]
    oc = kvd.connect(s0.url, s0.http_url, MODEL, timeout=10)
    for t in threads:
        t.start()
    try:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("stopped"):
                wait_for(lambda: Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T", "the stop")
                time.sleep(3 * TTL + 0.2)  # past its lease: the server reaps it meanwhile
                for _ in range(3):  # bulk commits of the same keys, while the writer's copy is half done
                    overwrite(oc)
                counts["stops"] += 1
                p.send_signal(signal.SIGCONT)
            if line.startswith("done"):
                break
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        stop.set()
        for t in threads:
            t.join(30)
        oc.close()
    results: dict[int, str] = {}
    for line in log.read_text().splitlines():
        kind, v, *rest = line.split()
        if kind != "begin":
            results[int(v)] = f"{kind} {' '.join(rest)}"
    for v in seen:
        if v < 100:
            assert results.get(v) == "end True", f"value {v} read, its store: {results.get(v)}; all {results}"
        else:
            assert other.get(v) is True, f"value {v} read, its overwrite: {other.get(v)!r}"
    assert errors == [], errors[:10]
    for s in (s0, s1):
        with kvd.connect(s.url, s.http_url, MODEL, timeout=10) as c:
            assert kvd.check_server_integrity(c) == []
    failed = sorted(v for v, r in results.items() if r != "end True")
    print(
        f"\nA-BULK stopped writer: {counts}, values seen {len(seen)}, writer results not True: "
        f"{[(v, results[v]) for v in failed]}"
    )
    assert counts["stops"] >= 6 and counts["hits"] > 50, counts

"""Review R-BULK: fast reads (pool directory) racing a writer in another process whose stores
commit many chunks in one L1Store.commit: overwrites of a prompt whose chunks were partly evicted
(a batch of replaced keys and new keys in any order: replacements handed over in the loop, new keys
published after), overwrites of a prefix of it (its old tail left unchained), and filler stores
that evict. Every chain write is one value for all its chunks, so a read that is not a miss must be
one value throughout, for the whole prompt and for any prefix of it, and never a value the writer
had already replaced when the read began (values up to 250: exact in bfloat16)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, MODEL, make_tokens

N = 6  # chunks of the prompt

WRITER = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, {tests!r})
    import torch, kvdock.sdk as kvd
    from helpers import make_tokens
    url, http, model, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    N, C = {n}, 16
    tokens = make_tokens(N * C, start=7000)
    rng = random.Random(5)
    with kvd.connect(url, http, model) as c, open(out, "w") as log:
        v = 0
        while v < n:
            v += 1
            r = rng.random()
            if r < 0.4:  # the whole prompt, one value
                kvd.store(c, torch.full((2, 3, N * C, 16), float(v), dtype=torch.bfloat16), tokens, overwrite=True)
                log.write(f"{{v}} {{N}}\\n")
            elif r < 0.55:  # a prefix of it: the old tail no longer chains
                k = rng.randint(1, N - 1)
                kv = torch.full((2, 3, k * C, 16), float(v), dtype=torch.bfloat16)
                kvd.store(c, kv, tokens[: k * C], overwrite=True)
                log.write(f"{{v}} {{k}}\\n")
            elif r < 0.75 and v < n:  # a prefix, its orphaned next chunk evicted, then the whole prompt:
                k = rng.randint(1, N - 2)  # new keys between replaced ones in one commit
                kv = torch.full((2, 3, k * C, 16), float(v), dtype=torch.bfloat16)
                kvd.store(c, kv, tokens[: k * C], overwrite=True)
                log.write(f"{{v}} {{k}}\\n")
                log.flush()
                other = make_tokens(C, start=100000 + rng.randint(0, 10**6))
                kvd.store(c, torch.full((2, 3, C, 16), -1.0, dtype=torch.bfloat16), other)
                v += 1
                kvd.store(c, torch.full((2, 3, N * C, 16), float(v), dtype=torch.bfloat16), tokens, overwrite=True)
                log.write(f"{{v}} {{N}}\\n")
            else:  # other prompts: evict some of the prompt's chunks
                for _ in range(rng.randint(1, 4)):
                    other = make_tokens(3 * C, start=100000 + rng.randint(0, 10**6))
                    kvd.store(c, torch.full((2, 3, 3 * C, 16), -1.0, dtype=torch.bfloat16), other)
            log.flush()
    print("done", flush=True)
    """
)


@pytest.mark.subprocess_server
@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru", "lru"])
def test_fast_reads_racing_bulk_commits_never_mix_versions(make_server, tmp_path: Path, policy: str) -> None:
    srv = make_server("--eviction-policy", policy, l1_size="112KiB")  # 28 one-page slots: evictions
    tokens = make_tokens(N * CHUNK, start=7000)
    log = tmp_path / "writes.log"
    script = WRITER.format(tests=str(Path(__file__).parent.parent), n=N)
    with kvd.connect(srv.url, srv.http_url, MODEL) as c:
        p = zygote.Popen(
            [sys.executable, "-c", script, srv.url, srv.http_url, MODEL, "250", str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        reads = hits = partial = 0
        seen: set[float] = set()
        k = N
        floor = 0.0  # the last chain write acknowledged before the read began
        before = srv.metric('kvdock_requests_total{op="PrepareRetrieve"}', 0.0)
        while p.poll() is None or reads < 50:
            k = k % N + 1  # every prefix in turn
            done = log.read_text().splitlines() if log.exists() else []
            floor = float(done[-1].split()[0]) if done and done[-1].strip() else floor
            got = kvd.retrieve(c, tokens[: k * CHUNK])
            reads += 1
            if got is None:
                continue
            hits += 1
            values = got.unique()
            assert len(values) == 1, f"a mix of versions {values.tolist()} in a read of {k} chunks"
            assert got.shape[2] % CHUNK == 0 and got.shape[2] <= k * CHUNK
            partial += got.shape[2] < k * CHUNK
            assert float(values[0]) > 0, "another prompt's KV"
            assert float(values[0]) >= floor, f"read {values[0]} after write {floor} was acknowledged"
            seen.add(float(values[0]))
        assert p.wait() == 0 and p.stdout is not None and p.stdout.read().strip() == "done"
        assert kvd.check_server_integrity(c) == []
        asked = srv.metric('kvdock_requests_total{op="PrepareRetrieve"}', 0.0) - before
    print(f"{policy}: reads {reads} hits {hits} partial {partial} versions {len(seen)} asked {asked}")
    assert asked < reads / 2, (asked, reads)  # most reads were fast reads
    assert len(seen) > 5 and hits > 20 and partial > 0, (len(seen), hits, partial, reads)

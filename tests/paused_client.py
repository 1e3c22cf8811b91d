"""A real SDK client process that stops itself (SIGSTOP) in the middle of a transfer, for tests
of leases running out under a paused client. Run as a script:

    python paused_client.py URL HTTP_URL MODEL read  TOKENS_START N_TOKENS OUT.pt
    python paused_client.py URL HTTP_URL MODEL write TOKENS_START N_TOKENS SEED
    python paused_client.py URL HTTP_URL MODEL view  TOKENS_START N_TOKENS -

``read`` retrieves the tokens (from the pool directory, unless KVDOCK_FAST_READS=0), stopping
before its first copy out of the pool, and saves what it got (torch.save) to OUT.pt; ``write``
stores ``make_kv(N_TOKENS, seed=SEED)``, stopping before its first copy into the pool; ``view``
opens a zero-copy view of the tokens and stops inside the block, then reads chunk 0 again and
closes it. Each prints ``paused`` before stopping, and one JSON line at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch

import kvdock.sdk as kvd
from helpers import make_kv, make_tokens
from kvdock.sdk import _transfer as transfer


def pause_once(cls: type, name: str) -> list[int]:
    """Make ``cls.name`` stop this process before its first call; returns the call counter."""
    calls = [0]
    original = getattr(cls, name)

    def paused(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            print("paused", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, *args, **kwargs)

    setattr(cls, name, paused)
    return calls


def main() -> None:
    url, http_url, model, what, start, n, arg = sys.argv[1:8]
    tokens = make_tokens(int(n), start=int(start))
    with kvd.connect(url, http_url, model, timeout=10) as ctx:
        assert ctx.transport == "shm", ctx.transport
        if what == "view":
            try:
                with kvd.view(ctx, tokens) as v:
                    print("paused", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                    after = v.chunk(0).clone()
                print(json.dumps({"closed": "ok", "zeros": bool((after == 0).all())}), flush=True)
            except kvd.KVCacheSDKError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        elif what == "read":
            calls = pause_once(transfer.ShmTransfer, "read_at")  # (both ways of reading go through it)
            kv = kvd.retrieve(ctx, tokens)
            torch.save(kv, arg)
            print(json.dumps({"reads": calls[0]}), flush=True)
        else:
            pause_once(transfer.ShmTransfer, "write")
            try:
                result = kvd.store_chunks(ctx, make_kv(int(n), seed=int(arg)), tokens)
                print(json.dumps({"stored": result.stored_chunks}), flush=True)
            except kvd.KVCacheSDKError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)


if __name__ == "__main__":
    main()

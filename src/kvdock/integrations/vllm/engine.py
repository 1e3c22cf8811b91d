"""A vLLM engine in its own process, driven by JSON lines (examples, tests and benchmarks use it).

    python -m kvdock.integrations.vllm.engine MODEL_DIR DTYPE CONFIG_JSON

CONFIG_JSON: ``{"kvdock": {kv_connector_extra_config} or null (no connector), "llm": {more LLM
kwargs}}``. The engine is ``LLM(..., skip_tokenizer_init=True, enforce_eager=True, block_size=32)``
in this one process (engine core and worker in-process: ~20 s less to start). Each stdin line is a
command; each answer is one stdout line starting with ``@@`` (vLLM's output goes elsewhere):

    {"op": "generate", "prompts": [[ids], ...], "max_tokens": 8, "salts": ["", ...]}
        -> {"outputs": [[ids], ...], "cached": [num_cached_tokens, ...], "seconds": wall time}
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "metrics"} -> {"name": value, ...} (vLLM's counters and gauges)
    {"op": "quit"}

:class:`EngineProcess` starts one and talks to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, dtype, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    kwargs = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": 32,
        "dtype": dtype,
        "kv_cache_memory_bytes": 256 << 20,
        "distributed_executor_backend": "uni",
        "seed": 0,
        "disable_log_stats": False,
        **cfg.get("llm", {}),
    }
    if cfg.get("kvdock") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvdockConnector",
            kv_connector_module_path="kvdock.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=cfg["kvdock"],
        )
    llm = LLM(model=model, **kwargs)

    def answer(obj: object) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "reset_prefix_cache":
            answer({"ok": bool(llm.reset_prefix_cache())})
        elif op == "metrics":
            answer({m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")})
        elif op == "generate":
            salts = cmd.get("salts") or [None] * len(cmd["prompts"])
            prompts = [
                TokensPrompt(prompt_token_ids=p, **({"cache_salt": s} if s else {}))
                for p, s in zip(cmd["prompts"], salts, strict=True)
            ]
            params = SamplingParams(
                max_tokens=cmd.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
            )
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            answer(
                {
                    "seconds": time.perf_counter() - start,
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "cached": [o.num_cached_tokens for o in outs],
                }
            )
        else:
            answer({"error": f"unknown op {op!r}"})


class EngineProcess:
    """One vLLM engine in a child process (this module's ``main``); ``generate`` blocks until it
    answers. Its log (vLLM's stderr) goes to ``log``."""

    def __init__(
        self,
        model: Path | str,
        dtype: str,
        kvdock: dict[str, Any] | None,
        log: Path,
        start_timeout: float = 240.0,
        **llm: Any,
    ) -> None:
        cfg = json.dumps({"kvdock": kvdock, "llm": llm})
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvdock.integrations.vllm.engine", str(model), dtype, cfg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self._answers: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait(timeout=start_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("@@"):
                with self._cv:
                    self._answers.append(json.loads(line[2:]))
                    self._cv.notify_all()
            else:
                self._log.write(raw)
        with self._cv:
            self._cv.notify_all()

    def _wait(self, timeout: float) -> dict[str, Any]:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._answers or self.proc.poll() is not None, timeout)
            if self._answers:
                return self._answers.popleft()
        tail = self.log_path.read_text(errors="replace")[-12000:]
        why = "timed out" if not ok else f"exited with {self.proc.returncode}"
        raise RuntimeError(f"vLLM engine {why}; log tail:\n{tail}")

    def call(self, timeout: float = 300, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._wait(timeout)

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 8, salts: list[str] | None = None
    ) -> list[list[int]]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, salts=salts)["outputs"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()

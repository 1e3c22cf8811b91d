"""A vLLM engine in its own process, driven by JSON lines (examples, tests and benchmarks use it).

    python -m kvdock.integrations.vllm.engine MODEL_DIR DTYPE CONFIG_JSON

CONFIG_JSON: ``{"kvdock": {kv_connector_extra_config} or null (no connector), "llm": {more LLM
kwargs}}``; with ``"time_connector": true`` each generate also reports the seconds spent inside
each of the connector's hooks (engine core and worker share this process, so one timer sees all);
``"plugin": "/path/to/file.py"`` (tests) loads that file and calls its ``install()`` before vLLM
starts: it may patch anything in this process, and returns more ops (``{"op name": fn(llm, cmd)
-> answer}``).
The engine is ``LLM(..., skip_tokenizer_init=True, enforce_eager=True, block_size=32)`` in this one
process (engine core and worker in-process: ~20 s less to start). With ``tensor_parallel_size``
above 1 the ranks are worker processes (vLLM's ``mp`` executor; on CPU each rank's OpenMP threads
are bound to its share of this process's CPUs, ``VLLM_CPU_OMP_THREADS_BIND``, unless set); the
engine runs in a process group of its own, and :meth:`EngineProcess.stop` ends the whole group. Each stdin line is a
command; each answer is one stdout line starting with ``@@`` (vLLM's output goes elsewhere):

    {"op": "generate", "prompts": [[ids], ...], "max_tokens": 8, "salts": ["", ...], "settle": true}
        -> {"outputs": [[ids], ...], "cached": [num_cached_tokens, ...], "seconds": wall time,
            "connector": {"hook": seconds, ...} (with time_connector),
            "settle_seconds": time to settle}
        With ``settle`` (the default) the connector's background saves are waited for after the
        batch (``seconds`` does not include it), and the engine is stepped until it has returned
        the finished requests' blocks (kept while saves read them): what a test reads from kvdock
        is then there, and ``reset_prefix_cache`` finds every block free.
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "pages", "tokens": [ids], "path": "..."} -> {"found": bool}: the KV vLLM's pages hold for
        a recent save of exactly those tokens, written to path (``torch.save``; rank 0's)
    {"op": "loaded_pages", "tokens": [ids], "path": "..."} -> {"found": bool}: the same for the
        blocks a recent load of exactly those tokens wrote, each layer through its own KV cache
        group's blocks; NaN where the layer's group keeps no block (outside a sliding window)
    {"op": "copied"} -> {"bytes": n, "copies": k}: what the connector copied out of vLLM's pages
        for saves, in how many copies (every rank's, since start)
    {"op": "metrics"} -> {"name": value, ...} (vLLM's counters and gauges)
    {"op": "kv_cache"} -> {"hybrid": bool, "groups": [spec class name, ...]}: whether vLLM's hybrid
        KV cache manager is on, and its KV cache groups
    {"op": "quit"} -> the process exits at once (no vLLM teardown)

The first line is ``{"ready": true}``, or ``{"error": "..."}`` when vLLM failed to start (the
process then exits 1). :class:`EngineProcess` starts one and talks to it; a failed start raises
RuntimeError with that error and the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model, dtype, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm_kwargs = cfg.get("llm", {})
    ranks = int(llm_kwargs.get("tensor_parallel_size", 1)) * int(llm_kwargs.get("pipeline_parallel_size", 1))
    if ranks > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(ranks))
    kwargs = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": 32,
        "dtype": dtype,
        "kv_cache_memory_bytes": 256 << 20,
        "distributed_executor_backend": "uni" if ranks == 1 else "mp",
        "seed": 0,
        "disable_log_stats": False,
        **llm_kwargs,
    }
    if cfg.get("kvdock") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvdockConnector",
            kv_connector_module_path="kvdock.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=cfg["kvdock"],
        )
    spent = _time_hooks() if cfg.get("time_connector") else None

    def answer(obj: object) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    ops = _plugin(cfg["plugin"]) if cfg.get("plugin") else {}
    try:
        llm = LLM(model=model, **kwargs)
    except BaseException as e:  # say why at once: a failed vLLM start can hang in its teardown
        traceback.print_exc()
        answer({"error": f"{type(e).__name__}: {e}"})
        sys.stderr.flush()
        os._exit(1)
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            # nothing outlives this process (generate settled its saves, the server keeps the KV), and
            # vLLM's own teardown takes ~5 s of every test and example that stops an engine
            sys.stdout.flush()
            os._exit(0)
        if op == "reset_prefix_cache":
            answer({"ok": bool(llm.reset_prefix_cache())})
        elif op == "pages":
            answer({"found": llm.collective_rpc(pages_of, args=(cmd["tokens"], cmd["path"]))[0]})
        elif op == "loaded_pages":
            answer({"found": llm.collective_rpc(loaded_pages_of, args=(cmd["tokens"], cmd["path"]))[0]})
        elif op == "copied":
            done = llm.collective_rpc(copied_bytes)
            answer({"bytes": sum(b for b, _ in done), "copies": sum(n for _, n in done)})
        elif op == "kv_cache":
            vc = llm.llm_engine.vllm_config
            groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
            hybrid = not vc.scheduler_config.disable_hybrid_kv_cache_manager
            answer({"hybrid": hybrid, "groups": [type(g.kv_cache_spec).__name__ for g in groups]})
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
            before = dict(spent or {})
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            res = {
                "seconds": time.perf_counter() - start,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
            }
            if spent is not None:
                res["connector"] = {k: v - before.get(k, 0.0) for k, v in spent.items()}
            if cfg.get("kvdock") is not None and cmd.get("settle", True):
                start = time.perf_counter()
                res["drained"] = all(llm.collective_rpc(drain_kvdock))
                for _ in range(4):  # deliver the finished requests; their blocks come back
                    llm.llm_engine.step()
                res["settle_seconds"] = time.perf_counter() - start
            answer(res)
        elif op in ops:
            answer(ops[op](llm, cmd))
        else:
            answer({"error": f"unknown op {op!r}"})


def _plugin(path: str) -> dict[str, Any]:
    """The ops a plugin file's ``install()`` adds (see the module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvdock_engine_plugin", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.install())


def drain_kvdock(worker: Any = None, timeout: float = 120.0) -> bool:
    """On a vLLM worker (``collective_rpc``): wait until the connector's background transfers
    are over; False when they were not within ``timeout``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    side = getattr(get_kv_transfer_group(), "_worker", None)
    return side is None or bool(side.drain(timeout))


def copied_bytes(worker: Any = None) -> tuple[int, int]:
    """On a vLLM worker (``collective_rpc``): the bytes its connector copied out of vLLM's pages
    for saves since the engine started, and in how many copies."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0, 0
    side = getattr(get_kv_transfer_group(), "_worker", None)
    transfers = getattr(side, "transfers", None)
    return (int(transfers.copied_bytes), int(transfers.copies)) if transfers is not None else (0, 0)


def pages_of(worker: Any, tokens: list[int], path: str) -> bool:
    """On a vLLM worker (``collective_rpc``): the KV its pages hold now for the blocks of a recent
    save of exactly ``tokens``, written to ``path`` as the chunk tensor ``[2, L, T, D]``
    (``torch.save``); False when no recent save was of ``tokens``."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker  # type: ignore[attr-defined]
    spec = next((s for s in reversed(side.recent) if s.tokens == tokens), None)
    if spec is None:
        return False
    geometry = side.codec.geometry
    out = torch.empty(geometry.chunk_shape(len(spec.block_ids) * side.block_size), dtype=getattr(torch, geometry.dtype))
    side.codec.gather(torch.tensor(spec.block_ids, dtype=torch.long), out)
    torch.save(out, path)
    return True


def loaded_pages_of(worker: Any, tokens: list[int], path: str) -> bool:
    """On a vLLM worker (``collective_rpc``): what its pages hold now in the blocks a recent load of
    exactly ``tokens`` wrote (``[2, L, T, D]``, per layer through its group's blocks, NaN where its
    group has none), saved to ``path``; False when no recent load was of ``tokens``."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvdock.integrations.vllm.groups import layer_rows

    side = get_kv_transfer_group()._worker  # type: ignore[attr-defined]
    spec = next((s for s in reversed(side.recent_loads) if s.tokens == tokens), None)
    if spec is None:
        return False
    n, bs, geometry = len(spec.block_ids), side.block_size, side.codec.geometry
    rows = layer_rows(side.group_of, spec.groups, 0, n) if spec.groups else [spec.block_ids] * geometry.num_layers
    ids = torch.tensor([[max(b, 0) for b in row] for row in rows], dtype=torch.long)
    out = torch.empty(geometry.chunk_shape(n * bs), dtype=getattr(torch, geometry.dtype))
    side.codec.gather(ids, out)
    for layer, row in enumerate(rows):
        for j, b in enumerate(row):
            if b < 0:
                out[:, layer, j * bs : (j + 1) * bs] = float("nan")
    torch.save(out, path)
    return True


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` local ranks its share of this
    process's CPUs (vLLM's ``auto`` wants a NUMA node per rank); ranks share CPUs when there are
    fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    shares = [
        cpus[i * len(cpus) // ranks : (i + 1) * len(cpus) // ranks] or [cpus[i % len(cpus)]] for i in range(ranks)
    ]
    return "|".join(",".join(map(str, share)) for share in shares)


HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_block_ids_with_load_errors", "handle_preemptions", "request_finished_all_groups",
)  # fmt: skip


def _time_hooks() -> dict[str, float]:
    """Wrap KvdockConnector's vLLM hooks with timers; returns the running totals (seconds)."""
    from kvdock.integrations.vllm import KvdockConnector

    spent: dict[str, float] = dict.fromkeys(HOOKS, 0.0)

    def timed(name: str, fn: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return hook

    for name in HOOKS:
        setattr(KvdockConnector, name, timed(name, getattr(KvdockConnector, name)))
    return spent


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
        time_connector: bool = False,
        plugin: Path | str | None = None,
        **llm: Any,
    ) -> None:
        more = {"plugin": str(plugin)} if plugin is not None else {}
        cfg = json.dumps({"kvdock": kvdock, "llm": llm, "time_connector": time_connector, **more})
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvdock.integrations.vllm.engine", str(model), dtype, cfg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,  # its worker processes too: stop() ends the group
        )
        self._answers: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self._wait(timeout=start_timeout)
        except BaseException:  # (a start that timed out: nothing of it may keep running)
            self.proc.kill()
            self.proc.wait()
            self._end_group()
            self._log.close()
            raise
        if "error" in ready:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._end_group()
            self._log.close()
            tail = self.log_path.read_text(errors="replace")[-12000:]
            raise RuntimeError(f"vLLM engine failed to start: {ready['error']}; log tail:\n{tail}")

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
        self, prompts: list[list[int]], max_tokens: int = 8, salts: list[str] | None = None, settle: bool = True
    ) -> list[list[int]]:
        res = self.call(op="generate", prompts=prompts, max_tokens=max_tokens, salts=salts, settle=settle)
        return res["outputs"]  # type: ignore[no-any-return]

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
        self._end_group()
        self._log.close()

    def _end_group(self) -> None:
        """Kill what is left of the engine's process group (a tensor-parallel engine's workers
        outlive its ``os._exit``, and hold its output pipe open), then let the reader finish."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()

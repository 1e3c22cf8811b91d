"""Test-only stand-in for ``sgl_kernel`` (PyPI's ``sglang-kernel`` is CUDA-only): the one op
SGLang's CPU engine calls on the paths the engine tests run, in torch. Never installed: the
engine tests put this directory on the engine processes' ``PYTHONPATH``."""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_len: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[...]`` for each request, in order."""
    at = 0
    for i in range(int(req_pool_indices.shape[0])):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[at : at + e - s]
        at += e - s


def __getattr__(name: str) -> object:
    """Any other op imports (SGLang imports many at module level on CPU) and raises if called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: not in kvdock's test stand-in")

    missing.__name__ = name
    return missing

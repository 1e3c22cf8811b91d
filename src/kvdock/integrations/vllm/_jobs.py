"""The jobs of :mod:`~kvdock.integrations.vllm.transfers`, its counters, and what it needs of the
worker (a seam for tests)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvdock.integrations.vllm.hybrid import GroupCopy
from kvdock.integrations.vllm.plan import LoadSpec, SaveSpec

STAT_KEYS = (
    "loads", "loaded_tokens", "load_bytes", "load_s", "load_errors",
    "saves", "saved_tokens", "save_bytes", "save_s", "saves_dropped", "copy_s", "copy_bytes",
)  # fmt: skip


class Worker(Protocol):
    """What the transfers need of the worker side (a seam for tests)."""

    def mark(self) -> Any:
        """On the model-runner thread, when a save is submitted: what orders its copy after the
        forward pass that wrote the KV (a CUDA event; None on the CPU)."""

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        """The KV of ``block_ids`` as a host tensor ``[2, L, n * block_size, D]`` (copier thread)."""

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        """Store ``staged`` (the KV of ``spec``'s tokens from ``spec.first`` on); bytes written
        (network thread). PrefixMissingError (nothing written) when kvdock lacks a chunk before
        ``spec.first``: its ``at`` attribute is that chunk's first token."""

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        """Load ``spec``: the planned blocks it did not fill, and the bytes loaded (network thread)."""

    @property
    def hybrid(self) -> GroupCopy | None:
        """The copy-out of saves with ``spec.groups`` (several KV cache groups, :mod:`.hybrid`):
        ``presave`` on the model-runner thread, ``copy_rest`` on the copier thread."""


@dataclass
class _Save:
    spec: SaveSpec
    nbytes: int
    mark: Any
    staged: torch.Tensor | None = None
    ready: Any = None  # (several groups, GPU) an event after the window layers' download into staged


@dataclass
class _Load:
    spec: LoadSpec
    done: threading.Event | None = None  # set when a load vLLM waits for is over
    failed: set[int] = field(default_factory=set)

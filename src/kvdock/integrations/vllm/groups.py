"""vLLM's KV cache groups mapped to kvdock (the connector is ``SupportsHMA``: vLLM keeps its hybrid
KV cache manager on, and models with sliding-window layers keep only their window's blocks).

vLLM puts layers whose KV is managed alike in one *group*; each group has its own block table
(block ids are unique only within a group: the groups share vLLM's KV tensors, each indexing them
with its own ids). A kvdock chunk is every layer's KV of its tokens, whatever the group, so:

* a **full-attention** group (``FullAttentionSpec``, MLA, sliding-window layers vLLM promoted to
  full attention with the manager off) keeps every block while the request runs: its layers are
  loaded into, and copied out of, its blocks as with one group (the copier reads them after the
  step: vLLM keeps them until the request is reported finished sending);
* a **sliding-window** group (``SlidingWindowSpec``) keeps only the blocks of its window: vLLM
  frees the blocks before ``computed - window + 1 - extra_retained_tokens`` (block-wise) at the
  request's next allocation and when it finishes, before any hook can delay it, and fills the
  table with its null block (id 0) there. A prefix hit of ``N`` tokens then has real blocks only
  for the window before ``N``: a load writes the group's layers into exactly those (what vLLM's
  own prefix cache gives it), never into the null block. A save copies the group's layers of a
  step's new chunks *synchronously* in ``wait_for_save`` (all still allocated then; the next
  step's allocation may free and hand them to another request), and only from the first block
  that is still real (``SaveSpec.real_from``, computed by the scheduler, which knows what vLLM
  freed): a chunk whose window blocks are gone is never saved, so its request saves nothing
  after it unless kvdock holds it already;
* anything else is refused at engine start, naming the group: Mamba / linear-attention state
  (one recurrent state per request, not per-token KV: a hit would need the state at exactly that
  token), chunked-local attention, R-SWA, circular buffers, cross / encoder-only attention,
  sparse-attention pools, EAGLE groups, and groups whose block size is not the engine's (a chunk
  is whole blocks of one size).

A layout of several groups changes the engine's fingerprint (:func:`fingerprint_with`): kvdock
never mixes its KV with that of the same model under another layout (the server refuses a
second fingerprint under a name), and a single full-attention group keeps the plain fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations import fingerprint as fp

NULL_BLOCK = 0  # vLLM's null block: BlockPool takes the first block of its queue (id 0) for it


@dataclass(frozen=True)
class Group:
    """One KV cache group: its layers, and its window (0: full attention, every block kept)."""

    index: int
    layers: tuple[str, ...]
    window: int = 0
    retained: int = 0  # SlidingWindowSpec.extra_retained_tokens: kept below the window too

    def skipped_blocks(self, computed: int, block_size: int) -> int:
        """How many leading blocks vLLM has freed (or never filled) once ``computed`` tokens are
        processed: ``SlidingWindowManager.get_num_skipped_tokens``, in whole blocks."""
        if not self.window:
            return 0
        return max(0, computed - self.window + 1 - self.retained) // block_size


@dataclass(frozen=True)
class GroupMap:
    groups: tuple[Group, ...]
    block_size: int

    @property
    def several(self) -> bool:
        """More than one group: block ids are per group (and load failures per request)."""
        return len(self.groups) > 1

    @property
    def windowed(self) -> bool:
        return any(g.window for g in self.groups)

    @property
    def plain(self) -> bool:
        """One full-attention group: kvdock's behaviour before SupportsHMA, block for block."""
        return not self.several and not self.windowed

    @property
    def main(self) -> int:
        """The group whose block ids the connector's bookkeeping follows (the first full one)."""
        return next((g.index for g in self.groups if not g.window), 0)

    def group_of(self, layer_names: Sequence[str]) -> list[int]:
        """The group of each of ``layer_names`` (the worker's layers in layer order)."""
        where = {name: g.index for g in self.groups for name in g.layers}
        missing = [n for n in layer_names if n not in where]
        if missing:
            raise UnsupportedLayoutError(f"kvdock: layers {missing} are in no KV cache group vLLM reported")
        return [where[n] for n in layer_names]

    def null_skipped(self, ids: list[list[int]], computed: int) -> None:
        """Mark in ``ids`` (one list per group) the blocks vLLM freed once ``computed`` tokens were
        processed (windowed groups): they may be another request's now."""
        for g in self.groups:
            row = ids[g.index]
            for i in range(min(g.skipped_blocks(computed, self.block_size), len(row))):
                row[i] = NULL_BLOCK

    def real_from(self, ids: Sequence[Sequence[int]], nblocks: int) -> int:
        """The first token from which every group's blocks among the first ``nblocks`` are real
        (after the last null block of any group): a save may copy only from there."""
        last = -1
        for row in ids:
            for i in range(min(nblocks, len(row)) - 1, -1, -1):
                if row[i] == NULL_BLOCK:
                    last = max(last, i)
                    break
        return (last + 1) * self.block_size

    def describe(self) -> list[dict[str, Any]]:
        """The layout as the fingerprint covers it: each group's window, not its layer names --
        every pipeline stage's config names only its own layers (the scheduler's is stage 0's),
        and all stages must register one fingerprint; which layers are windowed is the model
        config's (in the model fingerprint already)."""
        return [{"window": g.window, "retained": g.retained} for g in self.groups]


def _refusal(index: int, group: Any, spec: Any, why: str) -> UnsupportedLayoutError:
    names = list(getattr(group, "layer_names", ()))
    shown = names if len(names) <= 4 else [*names[:3], f"... ({len(names)} layers)"]
    return UnsupportedLayoutError(
        f"kvdock cannot map vLLM's KV cache group {index} ({type(spec).__name__}, layers {shown}): {why}"
    )


WHY = {
    "MambaSpec": "a recurrent state per request, not per-token KV: a prefix hit would need the state at "
    "exactly that token, which kvdock does not hold",
    "ChunkedLocalAttentionSpec": "chunked-local attention frees blocks at chunk boundaries mid-request; not mapped",
    "RSWASpec": "R-SWA evicts a middle range of blocks mid-request; not mapped",
    "CircularBufferSpec": "a circular buffer reuses its blocks for later tokens; not mapped",
    "CrossAttentionSpec": "cross-attention KV depends on the encoder input, not on the token ids",
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV across steps",
    "SlidingWindowMLASpec": "sliding-window MLA is not mapped",
}


def map_groups(kv_cache_config: Any, block_size: int) -> GroupMap | None:
    """vLLM's KV cache groups as kvdock maps them (see the module); UnsupportedLayoutError naming
    the group for what cannot be mapped exactly. None when vLLM gave no config (older callers:
    one full-attention group is assumed, as before)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return None
    from vllm.v1 import kv_cache_interface as kvi

    full = tuple(getattr(kvi, n) for n in ("FullAttentionSpec", "MLAAttentionSpec") if hasattr(kvi, n))
    out: list[Group] = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if getattr(group, "is_eagle_group", False):
            raise _refusal(i, group, spec, "a speculative-decoding (EAGLE) group; not mapped")
        if not getattr(group, "enable_kv_transfer", True):
            raise _refusal(i, group, spec, "vLLM does not hand its blocks to KV connectors")
        if type(spec) in full:
            window = 0
        elif type(spec) is kvi.SlidingWindowSpec:
            window = int(spec.sliding_window)
        else:
            why = WHY.get(kind, "not a full-attention or sliding-window KV cache; not mapped")
            raise _refusal(i, group, spec, why)
        if int(spec.block_size) != block_size:
            raise _refusal(
                i, group, spec, f"its block size {spec.block_size} is not the engine's {block_size} (a kvdock "
                "chunk is whole blocks of one size)"
            )  # fmt: skip
        retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        out.append(Group(i, tuple(group.layer_names), window, retained))
    if not out:
        raise UnsupportedLayoutError("kvdock: vLLM reported no KV cache group")
    return GroupMap(tuple(out), block_size)


def fingerprint_with(fingerprint: str, groups: GroupMap | None) -> str:
    """The engine's fingerprint, covering its group layout when that is not one full-attention
    group (another layout of the same model is another namespace: the server refuses it)."""
    if groups is None or groups.plain:
        return fingerprint
    return fp.fingerprint("vllm-groups", {"model": fingerprint, "groups": groups.describe()})


def real_blocks(rows: Sequence[Sequence[int]], lo: int, hi: int) -> int:
    """How many (layer, block) pairs of ``layer_rows``' ``rows`` in blocks ``[lo, hi)`` are real
    (not -1): what a load writes, for its byte count (a window's layers fill fewer blocks)."""
    return sum(1 for row in rows for b in row[lo:hi] if b >= 0)


def layer_rows(group_of: Iterable[int], ids: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[int]]:
    """Per layer, its group's block ids ``[lo, hi)``, the null block as -1 (a load skips it)."""
    return [[-1 if b == NULL_BLOCK else b for b in ids[g][lo:hi]] for g in group_of]


__all__ = ["NULL_BLOCK", "WHY", "Group", "GroupMap", "fingerprint_with", "layer_rows", "map_groups", "real_blocks"]

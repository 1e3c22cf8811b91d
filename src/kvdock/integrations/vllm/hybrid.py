"""Copying a save out of vLLM's pages when its layers are in several KV cache groups (the
mapping: :mod:`~kvdock.integrations.vllm.groups`): each layer through its own group's block ids,
the sliding-window layers in ``wait_for_save`` (on the model-runner thread: vLLM may free their
blocks at the next step's allocation), the others by the copier thread afterwards (vLLM keeps
their blocks until the request is reported finished sending)."""

from __future__ import annotations

from typing import Any

import torch

from kvdock.codecs import PagedCodec
from kvdock.integrations.vllm.groups import GroupMap, layer_rows
from kvdock.integrations.vllm.plan import SaveSpec
from kvdock.integrations.vllm.staging import DeviceCopyOut, HostCopyOut, copy_out_for


class GroupCopy:
    def __init__(
        self, groups: GroupMap, group_of: list[int], codec: PagedCodec, copier: HostCopyOut | DeviceCopyOut
    ) -> None:
        self.group_of = group_of  # per layer (in layer order): its group
        windows = [groups.groups[g].window for g in group_of]
        self.windowed = [i for i, w in enumerate(windows) if w]  # the layers of sliding-window groups
        self.kept = [i for i, w in enumerate(windows) if not w]  # the others: every block kept
        self.codec = codec
        self.block_size = groups.block_size
        self.copier = copier  # the copier thread's
        # the model-runner thread's own (a DeviceCopyOut's scratch is one thread's)
        self.sync_copier = copy_out_for(codec) if self.windowed else None

    def _rows(self, spec: SaveSpec, first_block: int) -> list[list[int]]:
        rows = layer_rows(self.group_of, spec.groups, first_block, len(spec.block_ids))
        if any(b < 0 for row in rows for b in row):  # (the scheduler's real_from excludes them: a bug)
            raise RuntimeError(f"kvdock: a save of {spec.req_id} names blocks vLLM does not keep")
        return rows

    def presave(self, spec: SaveSpec) -> torch.Tensor:
        """(Model-runner thread, in ``wait_for_save``.) The staging of a save (its tokens from
        ``spec.first`` on), its sliding-window layers copied now, the rest left to the copier."""
        first_block = spec.first // self.block_size
        shape = self.codec.geometry.chunk_shape((len(spec.block_ids) - first_block) * self.block_size)
        pinned = self.codec.device.type == "cuda"
        # (vLLM runs this hook in inference mode: the copier thread may write only a normal tensor)
        with torch.inference_mode(False):
            staged = torch.empty(shape, dtype=getattr(torch, self.codec.geometry.dtype), pin_memory=pinned)
            copier = self.sync_copier
            if copier is not None:
                copier.copy_out(self._rows(spec, first_block), copier.mark(), shape, self.windowed, staged)
        return staged

    def copy_rest(self, spec: SaveSpec, first_block: int, mark: Any, staged: torch.Tensor) -> torch.Tensor:
        """(Copier thread.) The full-attention layers of a save into :meth:`presave`'s staging."""
        if not self.kept:
            return staged
        return self.copier.copy_out(self._rows(spec, first_block), mark, tuple(staged.shape), self.kept, staged)


__all__ = ["GroupCopy"]

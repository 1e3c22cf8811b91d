"""Copying a save out of vLLM's pages when its layers are in several KV cache groups (the
mapping: :mod:`~kvdock.integrations.vllm.groups`): each layer through its own group's block ids,
the sliding-window layers started in ``wait_for_save`` (on the model-runner thread: vLLM may free
their blocks at the next step's allocation), the others by the copier thread afterwards (vLLM
keeps their blocks until the request is reported finished sending).

On a GPU ``wait_for_save`` only *enqueues* the window layers' copy, never waits for it: an event
recorded on the engine's stream after the forward pass, the gather and the device -> pinned
download on the model-runner thread's side stream after that event, and the engine's stream made
to wait (on the device) for an event after the gather -- so the next step's kernels, which may
write blocks vLLM freed, run only after the copy read them. The copier thread waits for the
download (``ready``) before the save goes on to kvdock. On the CPU (pages in host memory) the
window layers are copied in ``wait_for_save`` as before (a memory copy).
"""

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

    def presave(self, spec: SaveSpec) -> tuple[torch.Tensor, Any]:
        """(Model-runner thread, in ``wait_for_save``.) The staging of a save (its tokens from
        ``spec.first`` on), its sliding-window layers copied (on a GPU: enqueued, see the module;
        the rest is left to the copier), and what the copier waits for before reading it (an
        event, or None: copied)."""
        first_block = spec.first // self.block_size
        shape = self.codec.geometry.chunk_shape((len(spec.block_ids) - first_block) * self.block_size)
        pinned = self.codec.device.type == "cuda"
        ready = None
        # (vLLM runs this hook in inference mode: the copier thread may write only a normal tensor)
        with torch.inference_mode(False):
            staged = torch.empty(shape, dtype=getattr(torch, self.codec.geometry.dtype), pin_memory=pinned)
            copier = self.sync_copier
            if copier is not None:
                rows = self._rows(spec, first_block)
                _, _, ready = copier.enqueue(rows, copier.mark(), shape, self.windowed, staged, hold=True)
        return staged, ready

    def copy_rest(self, spec: SaveSpec, first_block: int, mark: Any, staged: torch.Tensor) -> torch.Tensor:
        """(Copier thread.) The full-attention layers of a save into :meth:`presave`'s staging."""
        if not self.kept:
            return staged
        return self.copier.copy_out(self._rows(spec, first_block), mark, tuple(staged.shape), self.kept, staged)


__all__ = ["GroupCopy"]

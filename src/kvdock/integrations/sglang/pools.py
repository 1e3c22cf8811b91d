"""SGLang's HiCache host pools as kvdock chunks (no SGLang import: duck-typed on the pool).

A host pool page (``page_size`` tokens from host index ``i``, a multiple of the page size) is one
kvdock chunk ``[planes, L, page_size, D]``: K and V (``planes`` 2, ``D = head_num * head_dim``)
of an MHA pool, the latent (``planes`` 1, ``D = kv_cache_dim``: ``kv_lora_rank`` then the rope
part) of an MLA pool. :meth:`HostPages.page` is that chunk as a strided *view* of the pool's
buffer, so a chunk moves between a kvdock slot and the pool in one copy, whatever the layout:

==================  ==================================  ==================================
layout              MHA ``kv_buffer``                    MLA ``kv_buffer``
==================  ==================================  ==================================
layer_first         ``[2, L, size, H, D]``               ``[L, size, 1, C]``
page_first          ``[2, size, L, H, D]``               ``[size, L, 1, C]``
page_first_direct   ``[2, pages, L, P, H, D]``           ``[pages, L, P, 1, C]``
page_head           ``[2, pages, H, P, L, D]``           --
page_unified        ``[pages, G, L, 2, P, H/G, D]``      ``[pages, L, P, C]``
==================  ==================================  ==================================

``page_unified`` (SGLang's ``page-unified-v1`` page block; ``G`` the pool's ``head_group_num``)
is refused unless SGLang's ``PAGE_UNIFIED_OBJECT_LAYOUT`` still names that byte order. With
``G > 1`` a page's heads are two axes ``(G, H/G)`` (:attr:`HostPages.head_shape`), head
``g * H/G + h`` either way.

:meth:`HostPages.flat_page` reads a *flat data page* (what SGLang's generic ``get`` / ``set``
hand a backend: ``get_data_page(i, flat=True)``, the page's bytes in the pool's own order) as the
same chunk. :class:`~kvdock.integrations.sglang.ends.Pages` and ``Flat`` are those pages as
the two ends of an SDK transfer (``ChunkSource`` / ``ChunkSink``), copied by :class:`Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdock import _native  # type: ignore[attr-defined]
from kvdock.errors import UnsupportedLayoutError
from kvdock.layout import KV_LATENT, KV_PAIR
from kvdock.memcpy import Copier, _disjoint
from kvdock.protocol.messages import EngineInfo, ModelLayout

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")
UNIFIED_ORDER = "page-unified-v1"  # the page block's byte order kvdock reads (SGLang's name for it)


class HostPages:
    """One SGLang host KV pool (``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``) seen as
    kvdock chunks of ``page_size`` tokens. UnsupportedLayoutError for any other pool, layout,
    K and V of different widths, a pool whose buffer is not one tensor, or one that keeps
    per-token state outside it (its ``get_size_per_token()`` is more than the buffer's)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.layout = str(getattr(pool, "layout", ""))
        self.page_size = int(pool.page_size)
        self.num_layers = int(pool.layer_num)
        self.dtype: torch.dtype = pool.dtype
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise UnsupportedLayoutError(f"kvdock: {type(pool).__name__} keeps no single KV buffer tensor")
        self.buffer = buf
        self.latent = hasattr(pool, "kv_cache_dim") and not hasattr(pool, "head_num")
        if self.latent:
            if self.layout not in MLA_LAYOUTS:
                raise UnsupportedLayoutError(f"kvdock: MLA host layout {self.layout!r} (supported: {MLA_LAYOUTS})")
            self.kv_kind, self.planes, self.heads, self.head_dim = KV_LATENT, 1, 1, int(pool.kv_cache_dim)
        else:
            if self.layout not in MHA_LAYOUTS:
                raise UnsupportedLayoutError(f"kvdock: MHA host layout {self.layout!r} (supported: {MHA_LAYOUTS})")
            if int(pool.head_dim) != int(getattr(pool, "v_head_dim", pool.head_dim)):
                raise UnsupportedLayoutError(
                    f"kvdock: K and V of different widths ({pool.head_dim} and {pool.v_head_dim}) are not supported"
                )
            self.kv_kind, self.planes, self.heads, self.head_dim = KV_PAIR, 2, int(pool.head_num), int(pool.head_dim)
        self.dim = self.heads * self.head_dim
        groups = int(getattr(pool, "head_group_num", 1)) if self.layout == "page_unified" and not self.latent else 1
        if groups < 1 or self.heads % groups:
            raise UnsupportedLayoutError(f"kvdock: {groups} head groups of {self.heads} KV heads")
        self.groups = groups  # page_unified's head groups (1 otherwise)
        self.head_shape = (self.heads,) if groups == 1 else (groups, self.heads // groups)
        if self.layout == "page_unified":
            _check_unified_order()
        self.shape = (self.planes, self.num_layers, self.page_size, self.dim)
        expected = self._buffer_shape()
        if tuple(buf.shape) != expected:
            raise UnsupportedLayoutError(
                f"kvdock: {type(pool).__name__} ({self.layout}) buffer of shape {tuple(buf.shape)}, expected {expected}"
            )
        self.capacity = int(pool.size)  # host slots (tokens)
        self._plan: tuple[tuple[tuple[int, ...], tuple[int, ...]], Plan | None] | None = None
        self._slot_plan: tuple[Plan | None] | None = None
        # a pool with per-page state outside kv_buffer (MXFP8's block scales) says so in its size
        sized = getattr(pool, "get_size_per_token", None)
        per_token = int(sized()) if callable(sized) else self.chunk_nbytes // self.page_size
        if per_token != self.chunk_nbytes // self.page_size:
            raise UnsupportedLayoutError(
                f"kvdock: {type(pool).__name__} keeps {per_token} bytes per token, its KV buffer "
                f"{self.chunk_nbytes // self.page_size}: state outside kv_buffer is not supported"
            )

    def _buffer_shape(self) -> tuple[int, ...]:
        L, P, H, D, size = self.num_layers, self.page_size, self.heads, self.head_dim, int(self.pool.size)
        pages = size // P
        if self.latent:
            return {
                "layer_first": (L, size, 1, D),
                "page_first": (size, L, 1, D),
                "page_first_direct": (pages, L, P, 1, D),
                "page_unified": (pages, L, P, D),
            }[self.layout]
        return {
            "layer_first": (2, L, size, H, D),
            "page_first": (2, size, L, H, D),
            "page_first_direct": (2, pages, L, P, H, D),
            "page_head": (2, pages, H, P, L, D),
            "page_unified": (pages, self.groups, L, 2, P, H // self.groups, D),
        }[self.layout]

    @property
    def chunk_nbytes(self) -> int:
        return self.planes * self.num_layers * self.page_size * self.dim * self.dtype.itemsize

    def page(self, index: int) -> torch.Tensor:
        """The page at host index ``index`` (a multiple of the page size, inside the pool) as a
        ``[planes, L, page_size, *head_shape, head_dim]`` view of the pool's buffer (``H`` 1 for a
        latent): the chunk :meth:`chunk5` gives of a slot. ValueError otherwise."""
        P = self.page_size
        if index % P or not 0 <= index <= self.capacity - P:
            raise ValueError(f"host index {index} is not the start of a page of the pool (page size {P})")
        b, pg = self.buffer, index // P
        if self.latent:
            if self.layout == "layer_first":
                v = b[:, index : index + P]  # [L, P, 1, C]
            elif self.layout == "page_first":
                v = b[index : index + P].transpose(0, 1)
            elif self.layout == "page_unified":
                v = b[pg].unsqueeze(2)  # [L, P, C] -> [L, P, 1, C]
            else:
                v = b[pg]
            return v.unsqueeze(0)
        if self.layout == "layer_first":
            return b[:, :, index : index + P]  # [2, L, P, H, D]
        if self.layout == "page_first":
            return b[:, index : index + P].transpose(1, 2)
        if self.layout == "page_first_direct":
            return b[:, pg]
        if self.layout == "page_unified":
            return self._ungroup(b[pg])
        return b[:, pg].permute(0, 3, 2, 1, 4)  # page_head: [2, H, P, L, D]

    def _ungroup(self, block: torch.Tensor) -> torch.Tensor:
        """An MHA ``page_unified`` page block ``[G, L, 2, P, H/G, D]`` as ``[2, L, P, *head_shape, D]``."""
        v = block.permute(2, 1, 3, 0, 4, 5)
        return v.squeeze(3) if len(self.head_shape) == 1 else v

    def chunk5(self, chunk: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[planes, L, page_size, D]`` chunk (a kvdock slot) as ``[planes, L,
        page_size, *head_shape, head_dim]``, the shape of :meth:`page`."""
        return chunk.view(self.planes, self.num_layers, self.page_size, *self.head_shape, self.head_dim)

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat data page of this pool (contiguous, ``chunk_nbytes`` bytes, the pool's dtype)
        as a ``[planes, L, page_size, *head_shape, head_dim]`` view, like :meth:`page` (a
        ``page_unified`` flat page: the page block's bytes). ValueError for anything else."""
        if (
            not isinstance(flat, torch.Tensor)
            or flat.dtype != self.dtype
            or flat.numel() * flat.element_size() != self.chunk_nbytes
            or not flat.is_contiguous()
        ):
            raise ValueError(f"not a flat data page of this pool ({self.chunk_nbytes} bytes of {self.dtype})")
        L, P, H, D = self.num_layers, self.page_size, self.heads, self.head_dim
        if self.latent:
            if self.layout == "page_first":
                return flat.view(P, L, 1, D).transpose(0, 1).unsqueeze(0)
            return flat.view(1, L, P, 1, D)
        if self.layout == "page_first":
            return flat.view(2, P, L, H, D).transpose(1, 2)
        if self.layout == "page_head":
            return flat.view(2, H, P, L, D).permute(0, 3, 2, 1, 4)
        if self.layout == "page_unified":
            return self._ungroup(flat.view(self.groups, L, 2, P, H // self.groups, D))
        return flat.view(2, L, P, H, D)

    def starts(self, pages: int, host_indices: torch.Tensor, distinct: bool = False) -> np.ndarray:
        """The host index of each of ``pages`` pages at ``host_indices`` (int64); ValueError unless
        they are one whole page of consecutive slots per page, each page inside the pool, and (when
        ``distinct``: pages a load writes) no page twice: two chunks copied into one page at once
        would leave it a mix of both (review R-CLI)."""
        P = self.page_size
        if host_indices.dtype == torch.int64 and host_indices.is_cpu and not host_indices.requires_grad:
            idx = host_indices.numpy()  # (SGLang's: one call, no torch op; a cold torch op costs ~40 us)
        else:
            idx = host_indices.detach().to("cpu", torch.int64).numpy()
        if idx.size != pages * P:
            raise ValueError(f"{idx.size} host indices for {pages} pages of {P}")
        first = np.empty(pages, np.int64)
        # one native call: each numpy operation costs 10-50 us on the caches a batch's copy left cold
        code, at = _native.page_starts(idx if idx.flags.c_contiguous else idx.copy(), first, P, self.capacity, distinct)
        if code == 1:
            raise ValueError("host indices are not whole pages of consecutive slots")
        if code == 2:
            raise ValueError(f"host index {at} is not the start of a page of the pool (page size {P})")
        if code == 3:
            raise ValueError("host indices name a page twice: a load into it would mix two pages")
        return first

    def check_starts(self, starts: np.ndarray) -> None:
        """ValueError unless every host index of ``starts`` starts a page inside the pool."""
        P = self.page_size
        if len(starts) and ((starts % P).any() or starts.min() < 0 or starts.max() > self.capacity - P):
            bad = (starts % P != 0) | (starts < 0) | (starts > self.capacity - P)
            at = int(starts[np.flatnonzero(bad)[0]])
            raise ValueError(f"host index {at} is not the start of a page of the pool (page size {P})")

    def model_layout(
        self, model_name: str, version: str, ranks: tuple[int, int, int, int], total_kv_heads: int, fingerprint: str
    ) -> ModelLayout:
        """The layout a rank (``ranks``: tp_size, tp_rank, pp_size, pp_rank) of SGLang ``version``
        registers for this pool (engine ``"sglang"``: kvdock keys the model SGLang's way)."""
        from kvdock.sdk.engine import make_layout

        tp_size, tp_rank, pp_size, pp_rank = ranks
        engine = EngineInfo(name="sglang", version=version, attention_backend=f"hicache/{self.layout}")
        return make_layout(
            model_name,
            num_layers=self.num_layers,
            num_kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            tokens_per_block=self.page_size,
            world_size=tp_size,
            rank=tp_rank,
            total_kv_heads=0 if self.latent else total_kv_heads,
            kv_kind=self.kv_kind,
            pp_size=pp_size,
            pp_rank=pp_rank,
            engine=engine,
            fingerprint=fingerprint,
        )

    def plan(self, slot: torch.Tensor) -> Plan | None:
        """How a page moves to or from a slot view like ``slot`` (``[planes, L, page_size, D]``)
        as runs of bytes (:class:`Plan`, made once per slot shape), or None when the copy does
        not reduce to long disjoint runs (the Copier copies such pages one by one)."""
        key = (tuple(slot.shape), tuple(slot.stride()))
        cached = self._plan
        if cached is not None and cached[0] == key:
            return cached[1]
        plan = None
        view, page = self.chunk5(slot), self.page(0)
        runs = Copier._runs(view, page)
        if runs is not None and _disjoint(runs[2], runs[0]):
            run, d, s = runs
            P = self.page_size
            step = self.page(P).data_ptr() - page.data_ptr() if self.capacity >= 2 * P else 0
            ptr0 = page.data_ptr()
            in_slot, in_page = d.view(np.int64) - view.data_ptr(), s.view(np.int64) - ptr0
            by_page = np.argsort(in_page, kind="stable")  # (a page_first page: its runs out of order)
            plan = Plan(key, run, in_slot, in_page, ptr0, step, in_slot[by_page], in_page[by_page])
        self._plan = (key, plan)
        return plan

    def slot_plan(self) -> Plan | None:
        """:meth:`plan` for a contiguous slot (a kvdock slot of this pool's chunks), made once."""
        if self._slot_plan is None:
            self._slot_plan = (self.plan(torch.empty(self.shape, dtype=self.dtype)),)
        return self._slot_plan[0]

    def describe(self) -> str:
        kind = "MLA latent" if self.latent else f"{self.heads} KV heads of {self.head_dim}"
        return f"{self.layout}, {self.num_layers} layers, {kind}, page {self.page_size}, {self.dtype}"


def _check_unified_order() -> None:
    """UnsupportedLayoutError unless SGLang's ``page_unified`` page block is still in the byte
    order kvdock reads (SGLang renames it when the order changes: old objects must then miss)."""
    try:
        from sglang.srt.mem_cache.pool_host.page_unified import PAGE_UNIFIED_OBJECT_LAYOUT as theirs
    except ImportError:
        theirs = None
    if theirs != UNIFIED_ORDER:
        raise UnsupportedLayoutError(f"kvdock: page_unified byte order {theirs!r} (kvdock reads {UNIFIED_ORDER!r})")


@dataclass(frozen=True)
class Plan:
    """The copy of one page between a slot and the pool as ``run``-byte runs: their offsets from
    the slot's first byte and from the page's, in the slot's order and (``page_*``) in the page's,
    and where page ``k`` starts (``ptr0 + k * step``). A copy reads its source in order (a set
    reads the page: in ``page_first`` its runs are one token of one layer, and reading them in the
    slot's order jumps a layer's width each run, ~10 % slower)."""

    key: tuple[tuple[int, ...], tuple[int, ...]]  # the slot views' shape and strides
    run: int
    in_slot: np.ndarray  # int64
    in_page: np.ndarray  # int64
    ptr0: int
    step: int
    page_slot: np.ndarray  # in_slot, in the page's order
    page_page: np.ndarray  # in_page, sorted


__all__ = ["MHA_LAYOUTS", "MLA_LAYOUTS", "UNIFIED_ORDER", "HostPages", "Plan"]

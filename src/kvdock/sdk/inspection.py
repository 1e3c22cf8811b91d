"""Looking at cached KV without moving it into a tensor: where each chunk lives, its checksum,
per-layer norms (:func:`inspect_prefix`), and how two cached prefixes differ (:func:`diff_prefixes`).

What ``kvdock inspect`` and ``kvdock diff`` print. The numbers come from the bytes a retrieve
returns, streamed chunk by chunk out of the server (no tensor of the whole prefix is built for
an inspection); the tier listing is a second request, so a store in between can make the two
disagree (inspection tools, not transactions).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvdock.errors import InvalidInputError, KVCacheSDKError
from kvdock.protocol import messages as m
from kvdock.sdk import _validate as validate
from kvdock.sdk._requests import keyed, whole_chunks
from kvdock.sdk.bundle import digest
from kvdock.sdk.context import KVCacheContext, checked
from kvdock.sdk.ops import retrieve, retrieve_into

DIFF_BYTES = 256 << 20  # how much of each prefix a diff holds at once (it goes by groups of layers)


@dataclass(frozen=True)
class ChunkInfo:
    """Chunk ``index`` (tokens ``start`` to ``start + chunk_size``): every object stored under its
    key, L1 first (``stored``; a tier without a local index, L3, answers for the leading chunks it
    holds only), and, if it is part of the cached prefix, the blake3 of the bytes a retrieve
    returns (the checksum a bundle of the same KV records)."""

    index: int
    start: int
    nbytes: int
    stored: tuple[m.Stored, ...]
    blake3: str | None

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(s.tier for s in self.stored)


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_prefix` found. ``k_norms[l]`` / ``v_norms[l]``: the Frobenius norm of
    layer ``l``'s K / V over the cached prefix (computed in float32; empty on a miss)."""

    model_name: str
    cache_salt: str
    chunk_size: int
    tokens: int  # whole-chunk tokens asked about
    hit_tokens: int
    chunks: tuple[ChunkInfo, ...]
    k_norms: tuple[float, ...]
    v_norms: tuple[float, ...]
    unreachable_tiers: tuple[str, ...] = ()  # tiers that were down: they may hold chunks too

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (what ``kvdock inspect --json`` prints)."""
        doc = asdict(self)
        doc["chunks"] = [
            {"index": c.index, "start": c.start, "nbytes": c.nbytes, "blake3": c.blake3,
             "stored": [{"tier": s.tier, "version": s.version, "parent": s.parent} for s in c.stored]}
            for c in self.chunks
        ]  # fmt: skip
        return doc


class _Stats:
    """A sink keeping each chunk's digest and each plane and layer's sum of squares."""

    def __init__(self, planes: int, layers: int) -> None:
        self.planes, self.layers = planes, layers
        self.take(-1, None)

    def take(self, index: int, src: torch.Tensor | None) -> None:
        if index <= 0:  # a (re)started transfer begins at chunk 0
            self.digests: list[str] = []
            self.squares = torch.zeros(self.planes, self.layers, dtype=torch.float64)
        if src is not None:
            self.digests.append(digest(src))
            self.squares += src.float().square().sum(dim=(2, 3), dtype=torch.float64)

    def finish(self) -> None:
        pass


def inspect_prefix(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> Inspection:
    """Where each whole chunk of ``tokens`` is stored, and checksums and per-layer K/V norms of
    the cached prefix. Raises what :func:`~kvdock.sdk.retrieve` raises."""
    ctx = checked(ctx)
    validate.whole_model_only(ctx, "inspection")
    arr = validate.tokens(tokens)
    cache_salt = validate.cache_salt(cache_salt)
    keys, key_salt = keyed(ctx, arr, cache_salt)  # what the server names them (kvdock.keying)
    whole = whole_chunks(ctx, keys)
    n = len(whole) // 4 // ctx.chunk_size
    if not n:
        return Inspection(ctx.model_name, cache_salt, ctx.chunk_size, 0, 0, (), (), ())
    geo = ctx.geometry
    stats = _Stats(geo.planes, geo.num_layers)
    hit = retrieve_into(ctx, arr, stats, cache_salt)
    found = _locate(ctx, whole, key_salt, n)
    nbytes = geo.chunk_nbytes(ctx.chunk_size)
    cached = hit // ctx.chunk_size  # digests past it are of an attempt whose bytes were refused
    chunks = tuple(
        ChunkInfo(i, i * ctx.chunk_size, nbytes, tuple(found.chunks[i]), stats.digests[i] if i < cached else None)
        for i in range(n)
    )
    norms = stats.squares.sqrt().tolist() if hit else [[], []]
    return Inspection(
        ctx.model_name, cache_salt, ctx.chunk_size, n * ctx.chunk_size, hit, chunks,
        tuple(norms[0]), tuple(norms[1]) if geo.planes > 1 else (), tuple(found.unreachable),
    )  # fmt: skip


def _locate(ctx: KVCacheContext, whole: bytes, cache_salt: str, n: int) -> m.Located:
    found = ctx.ask(m.Locate(ctx.client_id, whole, cache_salt))
    if len(found.chunks) != n:
        raise KVCacheSDKError(f"malformed reply to Locate for {n} chunks: {len(found.chunks)}")
    return found


def _versions(ctx: KVCacheContext, tokens: np.ndarray, cache_salt: str) -> tuple[int, ...]:
    """The version of each whole chunk of ``tokens`` where it is stored first (0: nowhere)."""
    keys, key_salt = keyed(ctx, tokens, cache_salt)
    whole = whole_chunks(ctx, keys)
    n = len(whole) // 4 // ctx.chunk_size
    return tuple(row[0].version if row else 0 for row in _locate(ctx, whole, key_salt, n).chunks) if n else ()


@dataclass(frozen=True)
class PrefixDiff:
    """How two cached prefixes differ over the tokens both have (``compared_tokens``).
    ``k_max_abs[l]`` / ``v_max_abs[l]``: the largest absolute difference in layer ``l`` (float32);
    ``first_differing_chunk``: the first chunk whose bytes differ, None if none does;
    ``identical``: something cached on both sides, of the same length and the same bytes."""

    tokens: int
    other_tokens: int
    compared_tokens: int
    k_max_abs: tuple[float, ...]
    v_max_abs: tuple[float, ...]
    first_differing_chunk: int | None

    @property
    def identical(self) -> bool:
        return self.tokens == self.other_tokens > 0 and self.first_differing_chunk is None

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "identical": self.identical}


def diff_prefixes(
    ctx: KVCacheContext,
    tokens: object,
    other_tokens: object,
    cache_salt: str = "",
    other_cache_salt: str | None = None,
    other_ctx: KVCacheContext | None = None,
) -> PrefixDiff:
    """Compare the cached prefix of ``tokens`` with that of ``other_tokens`` (under
    ``other_cache_salt``, default ``cache_salt``, through ``other_ctx``, default ``ctx``: another
    model or server of the same number of layers and hidden size). Both are read a group of
    layers at a time (about ``DIFF_BYTES`` held at once); if either prefix changes meanwhile (its
    hit or a chunk's version), KVCacheSDKError says so rather than mixing versions.
    InvalidInputError for unlike geometries."""
    ctx = checked(ctx)
    validate.whole_model_only(ctx, "inspection")
    other = checked(other_ctx) if other_ctx is not None else ctx
    a, b = ctx.geometry, other.geometry
    if (a.planes, a.num_layers, a.hidden_dim) != (b.planes, b.num_layers, b.hidden_dim):
        raise InvalidInputError(
            f"cannot compare {ctx.model_name!r} ([{a.planes}, {a.num_layers}, T, {a.hidden_dim}]) with "
            f"{other.model_name!r} ([{b.planes}, {b.num_layers}, T, {b.hidden_dim}])"
        )
    mine, theirs = validate.tokens(tokens), validate.tokens(other_tokens)
    salt = validate.cache_salt(cache_salt)
    other_salt = salt if other_cache_salt is None else validate.cache_salt(other_cache_salt)
    # bytes held per token and layer: both reads, their float32 copies and the difference
    row = a.planes * a.hidden_dim * (a.itemsize + b.itemsize + 12)
    step = max(1, DIFF_BYTES // max(row * max(len(mine), len(theirs), 1), 1))
    groups = [range(lo, min(lo + step, a.num_layers)) for lo in range(0, a.num_layers, step)]
    versions = (_versions(ctx, mine, salt), _versions(other, theirs, other_salt)) if len(groups) > 1 else None
    maxes = torch.zeros(a.planes, a.num_layers)
    hits: tuple[int, int] | None = None
    first: int | None = None
    chunk = ctx.chunk_size  # chunk indexes are the first prefix's
    for layers in groups:
        x = retrieve(ctx, mine, salt, layers=layers)
        y = retrieve(other, theirs, other_salt, layers=layers)
        got = (0 if x is None else x.shape[2], 0 if y is None else y.shape[2])
        if hits is not None and got != hits:
            raise KVCacheSDKError(f"a prefix changed during the diff (cached tokens {hits} then {got}); run it again")
        hits = got
        n = min(hits)
        if x is None or y is None or not n:
            break
        x, y = x[:, :, :n], y[:, :, :n]
        maxes[:, layers.start : layers.stop] = (x.float() - y.float()).abs().amax(dim=(2, 3))
        for c in range(0, -(-n // chunk) if first is None else first):
            if not _equal(x[:, :, c * chunk : (c + 1) * chunk], y[:, :, c * chunk : (c + 1) * chunk]):
                first = c
                break
    if versions is not None and versions != (_versions(ctx, mine, salt), _versions(other, theirs, other_salt)):
        raise KVCacheSDKError("a prefix was overwritten during the diff; run it again")
    assert hits is not None
    compared = min(hits)
    if compared == 0:
        maxes = torch.zeros(a.planes, 0)
    k, v = maxes.tolist() + [[]] * (2 - a.planes)
    return PrefixDiff(hits[0], hits[1], compared, tuple(k), tuple(v) if a.planes > 1 else (), first)


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same bytes (same dtype: NaNs and -0.0 compare as stored), else the same values."""
    if x.dtype == y.dtype:
        return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
    return torch.equal(x.float(), y.float())


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError("plotting needs matplotlib: pip install 'kvdock[plot]'") from None
    return plt


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a file :func:`plot_norms` can write: an image extension matplotlib knows
    (``.png``, ``.svg``, ``.pdf``, ...) in an existing directory; InvalidInputError otherwise."""
    out = Path(path)
    formats = _pyplot().figure().canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise InvalidInputError(
            f"cannot plot to {str(out)!r}: give a file name ending in one of .{', .'.join(formats)}"
        )
    if not out.parent.is_dir():
        raise InvalidInputError(f"cannot plot to {str(out)!r}: no directory {str(out.parent)!r}")
    return out


def plot_norms(inspection: Inspection, path: str | os.PathLike[str]) -> None:
    """Draw ``inspection``'s per-layer K and V norms to an image file (its format from the
    extension, see :func:`check_plot_path`). Needs matplotlib (``pip install 'kvdock[plot]'``)."""
    out = check_plot_path(path)
    if not inspection.hit_tokens:
        raise InvalidInputError("nothing of these tokens is cached: no norms to plot")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    layers = range(len(inspection.k_norms))
    ax.plot(layers, inspection.k_norms, marker="o", label="K")
    if inspection.v_norms:
        ax.plot(layers, inspection.v_norms, marker="s", label="V")
    ax.set_xlabel("layer")
    ax.set_ylabel("norm over the cached prefix")
    salt = f", cache_salt {inspection.cache_salt!r}" if inspection.cache_salt else ""
    ax.set_title(f"{inspection.model_name}: {inspection.hit_tokens} cached tokens{salt}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out)
    finally:
        plt.close("all")


__all__ = ["ChunkInfo", "Inspection", "PrefixDiff", "check_plot_path", "diff_prefixes", "inspect_prefix", "plot_norms"]

"""Checks of the SDK's arguments: every bad input becomes an InvalidInputError that says what is
expected, before anything is sent to the server.

Each function returns the value in the form the caller uses (a uint32 token array, a CPU
tensor, a float, ...) or raises :class:`~kvdock.errors.InvalidInputError`.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Protocol

import numpy as np
import torch

from kvdock import layout, memcpy
from kvdock.config import TOKEN_ENV
from kvdock.errors import InvalidInputError
from kvdock.keys import normalize_tokens
from kvdock.layout import KVGeometry
from kvdock.protocol import messages as m
from kvdock.reach import cache_salt as cache_salt  # (torch-free: kvdock lookup uses them too)
from kvdock.reach import http_url as http_url
from kvdock.reach import url as url
from kvdock.sdk.buffers import default_max_bytes


class KVCacheContext(Protocol):
    """What the checks below read of a context (:class:`kvdock.sdk.KVCacheContext` is one: this
    module imports no SDK module but the buffer pool's, so that every other may import it)."""

    @property
    def model_name(self) -> str: ...
    @property
    def geometry(self) -> KVGeometry: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def shards(self) -> int: ...
    @property
    def layout(self) -> m.ModelLayout: ...

MAX_TIMEOUT_S = 24 * 3600.0  # a day; zmq's millisecond timeouts overflow at about 24.8 days


FAST_READS_ENV = "KVDOCK_FAST_READS"


def environment() -> None:
    """KVDOCK_COPY_THREADS, KVDOCK_BUFFER_POOL_BYTES and KVDOCK_FAST_READS, if set, must be usable
    (InvalidInputError naming the variable otherwise): checked at connect, not at every copy."""
    try:
        memcpy.default_threads()
        default_max_bytes()
        fast_reads_default()
    except ValueError as e:
        raise InvalidInputError(str(e)) from None


def fast_reads_default() -> bool:
    """KVDOCK_FAST_READS: whether a new context reads from the pool directory (default yes;
    ``0``/``false``/``no``/``off`` turn it off, ``1``/``true``/``yes``/``on`` on; ValueError else)."""
    raw = os.environ.get(FAST_READS_ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{FAST_READS_ENV}={raw!r}: expected 1 or 0 (on or off)")


def tokens(value: object) -> np.ndarray:
    """Token ids (a sequence, numpy array or torch tensor of integers) as a uint32 array."""
    try:
        return normalize_tokens(value)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(str(e)) from None


def prompts(value: object) -> list[np.ndarray]:
    """A batch of prompts (a list or tuple of token sequences, or a 2-D array or tensor, one row
    each) as uint32 arrays."""
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 2:
        rows: list[object] = list(value)
    elif isinstance(value, (list, tuple)):
        rows = list(value)
    else:
        raise InvalidInputError(
            f"prompts must be a list of token sequences (or a 2-D array, one row each), got {type(value).__name__}"
        )
    if rows and all(isinstance(r, numbers.Integral) for r in rows):
        raise InvalidInputError("prompts must be a list of token sequences, got one flat sequence of ints")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(normalize_tokens(row))
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"prompt {i}: {e}") from None
    return out


def cache_salts(value: object, count: int) -> list[str]:
    """One cache_salt for every prompt (a str), or a list of ``count`` of them."""
    if isinstance(value, str):
        return [cache_salt(value)] * count
    if not isinstance(value, (list, tuple)) or len(value) != count:
        got = f"{len(value)} of them" if isinstance(value, (list, tuple)) else type(value).__name__
        raise InvalidInputError(f"cache_salt must be a str or a list of {count} str (one per prompt), got {got}")
    return [cache_salt(v) for v in value]


def overwrite(value: object) -> bool:
    return flag("overwrite", value)


def flag(name: str, value: object) -> bool:
    """``value`` as a bool (a bool or numpy bool only); InvalidInputError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidInputError(f"{name} must be True or False, got {type(value).__name__} {value!r:.40}")
    return bool(value)


def timeout(value: object) -> float:
    """Seconds to wait for the server: a real number in ``(0, MAX_TIMEOUT_S]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"timeout must be a number of seconds, got {type(value).__name__} {value!r:.40}")
    t = float(value)
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT_S):
        raise InvalidInputError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {value!r}")
    return t


def model_name(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"model_name must be a non-empty str, got {type(value).__name__} {value!r:.40}")
    return value


def _tensor_usable(name: str, t: torch.Tensor) -> None:
    if t.is_meta:
        raise InvalidInputError(
            f"{name} is on the meta device, which holds no data; pass a tensor with values (CPU or GPU)"
        )
    if t.layout != torch.strided:
        raise InvalidInputError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def kv(ctx: KVCacheContext, value: object, num_tokens: int) -> torch.Tensor:
    """``value`` as a ``KV_2LTD`` CPU tensor for ``ctx``'s model, of at most ``num_tokens`` tokens
    (the token ids given for it: ids past ``value``'s tokens are the caller's to drop, so that a
    retrieved prefix stores with the whole prompt's ids)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(f"kv must be a torch.Tensor, got {type(value).__name__}")
    geo = ctx.geometry
    want = geo.chunk_shape(num_tokens)  # the canonical layout
    if value.dim() != 4 or (value.shape[0], value.shape[1], value.shape[3]) != (want[0], want[1], want[3]):
        raise InvalidInputError(
            f"kv must be {layout.KV_1LTD if geo.planes == 1 else layout.KV_2LTD} [{geo.planes}, "
            f"num_layers={geo.num_layers}, tokens, D={geo.hidden_dim}] for "
            f"{ctx.model_name!r}, got {list(value.shape)}"
        )
    if value.shape[2] > num_tokens:
        raise InvalidInputError(
            f"kv has {value.shape[2]} tokens but {num_tokens} token ids were given: pass at least one id per "
            f"token of kv (ids past kv's tokens are ignored)"
        )
    if value.dtype != ctx.dtype:
        raise InvalidInputError(f"kv dtype {value.dtype} does not match {ctx.model_name!r}'s {ctx.dtype}")
    _tensor_usable("kv", value)
    value = value.detach()
    return value if value.device.type == "cpu" else value.cpu()


def kv_rank(value: object) -> int | None:
    """None (the whole model) or a non-negative int rank; InvalidInputError otherwise (the
    server says whether the model has that rank)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"kv_rank must be None (the whole model) or a rank >= 0, got {value!r}")
    return value


def tips(ctx: KVCacheContext, value: object) -> list[int] | None:
    """None, or one u64 version per shard ``ctx`` reads (``ctx.shards``); InvalidInputError otherwise."""
    if value is None:
        return None
    try:
        given = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"tips must be a sequence of versions, got {type(value).__name__}") from None
    if len(given) != ctx.shards or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**64 for v in given
    ):
        raise InvalidInputError(f"tips must be {ctx.shards} version(s) from lookup_tips, got {given[:4]}")
    return [int(v) for v in given]


def parallelism(geo: layout.KVGeometry) -> str:
    """Why a model is stored in several shards: its tensor parallelism, its pipeline stages or both."""
    kinds = ["tensor parallelism"] if geo.tp_shards > 1 else []
    kinds += [f"{geo.pp_size} pipeline stages"] if geo.pp_size > 1 else []
    return " and ".join(kinds) or "one shard"


def whole_model_only(ctx: KVCacheContext, what: str) -> None:
    """InvalidInputError when ``ctx`` assembles each chunk from several shards and ``what`` cannot."""
    if ctx.shards > 1:
        raise InvalidInputError(
            f"{what} of {ctx.model_name!r}, stored in {ctx.shards} shards ({parallelism(ctx.layout.geometry)}), is not "
            "supported for "
            f"the whole model yet; connect with kv_rank=r to work on one rank's shard"
        )


def layers(ctx: KVCacheContext, value: object) -> range:
    """``value`` (None: every layer) as a non-empty increasing range of the model's layers."""
    n = ctx.geometry.num_layers
    if value is None:
        return range(n)
    if not isinstance(value, range):
        raise InvalidInputError(f"layers must be a range of layer indices (range(0, 4)), got {type(value).__name__}")
    if len(value) == 0 or value.step < 0 or value.start < 0 or value[-1] >= n:
        raise InvalidInputError(f"layers {value} is not a non-empty increasing range within the model's {n} layers")
    return value


def start(ctx: KVCacheContext, value: object) -> int:
    """``value`` as a chunk-aligned, non-negative token offset."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % ctx.chunk_size:
        raise InvalidInputError(
            f"start must be a non-negative multiple of the chunk size {ctx.chunk_size}, got {value!r:.40}"
        )
    return value


def out(ctx: KVCacheContext, value: object, num_tokens: int, num_layers: int | None = None) -> torch.Tensor:
    """``value`` as a CPU buffer that retrieve can write ``num_tokens`` tokens (of ``num_layers``
    layers, default all) into, in place."""
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(f"out must be a torch.Tensor, got {type(value).__name__}")
    p, layers, _, d = ctx.geometry.chunk_shape(num_tokens)
    layers = layers if num_layers is None else num_layers
    if value.dim() != 4 or (value.shape[0], value.shape[1], value.shape[3]) != (p, layers, d):
        raise InvalidInputError(f"out must be [{p}, {layers}, tokens, {d}], got {list(value.shape)}")
    if value.shape[2] < num_tokens:
        raise InvalidInputError(f"out holds {value.shape[2]} tokens, fewer than the {num_tokens} asked for")
    if value.dtype != ctx.dtype or value.device.type != "cpu":
        raise InvalidInputError(f"out must be a CPU tensor of {ctx.dtype}, got {value.dtype} on {value.device}")
    _tensor_usable("out", value)
    if value.requires_grad:
        raise InvalidInputError("out must not require grad (retrieve writes into it in place)")
    if _may_overlap(value):
        raise InvalidInputError(
            f"out must not have overlapping elements (strides {list(value.stride())} for shape {list(value.shape)}: "
            "a stride of 0 from expand(), or an as_strided view whose rows share memory)"
        )
    return value


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: unless every stride, taken smallest first,
    steps past all the elements the smaller ones span (what every view of a dense tensor does)."""
    dims = sorted((abs(st), n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    span = 1  # elements covered by the dims taken so far, from the first to the last + 1
    for stride, n in dims:
        if stride < span:
            return True
        span += (n - 1) * stride
    return False


def token(value: object) -> str:
    """A tenant token (None: ``KVDOCK_TOKEN``, else none); InvalidInputError if not a str."""
    if value is None:
        return os.environ.get(TOKEN_ENV, "")
    if not isinstance(value, str):
        raise InvalidInputError(f"token must be a str, got {type(value).__name__}")
    return value

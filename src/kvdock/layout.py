"""One model's KV geometry (:class:`KVGeometry`), the canonical chunk and engine formats (pure, no torch).

The canonical chunk is ``[planes, num_layers, chunk_size, D]`` with ``D = num_kv_heads * head_dim``
(the KV of one rank, i.e. of one *shard*: see :class:`KVGeometry` for tensor parallelism).
A K/V cache (:data:`KV_PAIR`) has 2 planes, index 0 = keys, 1 = values: the
SDK's ``KV_2LTD`` ``[2, L, T, D]``. An MLA latent cache (:data:`KV_LATENT`) has one plane, one
latent of ``head_dim`` values per token and layer (``num_kv_heads`` 1). One stored object is one
canonical chunk, whatever the engine's own block size or axis order.

Engines name their own per-layer KV tensor with a *format name* (``EngineInfo.kv_cache_layout``);
for the two formats below, :func:`concrete_shape` gives that tensor's shape (what ``/status`` shows
as ``engine_kv_concrete_shape`` for clients that decode the geometry from it):

======  ======================================================  =============================
format  per-layer shape                                         used by
======  ======================================================  =============================
NHD     ``[2, num_blocks, block_size, num_kv_heads, head_dim]``  vLLM FlashAttention family
HND     ``[2, num_blocks, num_kv_heads, block_size, head_dim]``  vLLM HND layout, HF (1 block)
======  ======================================================  =============================
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec
from blake3 import blake3

from kvdock.protocol.limits import MAX_HEAD_DIM, MAX_NUM_KV_HEADS, MAX_NUM_LAYERS, MAX_WORLD_SIZE

KV_2LTD = "KV_2LTD"
KV_1LTD = "KV_1LTD"  # the SDK's format of an MLA latent cache: [1, L, T, kv_lora_rank + qk_rope_head_dim]
KV_PAIR = "pair"  # K and V: axis 0 of a chunk has 2 planes (0 = keys, 1 = values)
KV_LATENT = "latent"  # one MLA latent per token: 1 plane
KV_PLANES: dict[str, int] = {KV_PAIR: 2, KV_LATENT: 1}

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# axis names of each engine format's per-layer shape
FORMAT_AXES: dict[str, tuple[str, ...]] = {
    "NHD": ("kv", "blocks", "block", "heads", "dim"),
    "HND": ("kv", "blocks", "heads", "block", "dim"),
}


def check_dtype(name: str) -> str:
    """Return ``name`` if it is a supported KV dtype name; raise ValueError otherwise."""
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {', '.join(DTYPE_SIZES)}")
    return name


def concrete_shape(kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """The per-layer shape an engine of ``kv_format`` uses for ``num_blocks`` blocks."""
    try:
        axes = FORMAT_AXES[kv_format]
    except KeyError:
        raise ValueError(f"unknown KV format {kv_format!r}; known: {', '.join(FORMAT_AXES)}") from None
    sizes = {"kv": 2, "blocks": num_blocks, "block": block_size, "heads": num_kv_heads, "dim": head_dim}
    return [sizes[a] for a in axes]


class KVGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's KV cache as one tensor-parallel rank holds it; the canonical chunk is
    ``[planes, L, chunk, D]``.

    **Tensor parallelism.** Rank ``rank`` of ``world_size`` holds ``num_kv_heads`` of the model's
    ``kv_heads_total`` KV heads. Its KV is stored as the objects of its *shard* (:meth:`shard_of`):
    ranks holding the same heads share one shard, so a head replicated over several ranks (GQA
    with fewer KV heads than ranks) is stored once, and an MLA latent (the same on every rank)
    once for all ranks. Shard ``s`` holds KV heads ``[s * num_kv_heads, (s + 1) * num_kv_heads)``
    of the model; :meth:`logical` is the whole model's KV as one tensor (what the SDK's all-rank
    context reads and writes).

    **Pipeline parallelism.** Stage ``pp_rank`` of ``pp_size`` holds ``num_layers`` layers (stages
    of equal size: layers ``[pp_rank * num_layers, (pp_rank + 1) * num_layers)``), each split over
    the stage's ``world_size`` tensor-parallel ranks as above: shard ``pp_rank * tp_shards + t``.
    A rank is named by its global rank ``pp_rank * world_size + rank`` (:meth:`shard_of`,
    :meth:`at_rank`), vLLM's order."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: str  # "float32", "bfloat16", ... (DTYPE_SIZES keys)
    kv_kind: str = KV_PAIR
    world_size: int = 1  # tensor-parallel world size
    rank: int = 0  # tensor-parallel rank
    total_kv_heads: int = 0  # the model's KV heads over all ranks; 0: num_kv_heads * world_size
    pp_size: int = 1  # pipeline stages
    pp_rank: int = 0  # pipeline stage

    @property
    def hidden_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def planes(self) -> int:
        """Axis 0 of a chunk: 2 for a K/V pair, 1 for an MLA latent."""
        return KV_PLANES[self.kv_kind]

    @property
    def kv_heads_total(self) -> int:
        """The model's KV heads (an MLA latent counts as one head)."""
        if self.kv_kind == KV_LATENT:
            return 1
        return self.total_kv_heads or self.num_kv_heads * self.world_size

    @property
    def tp_shards(self) -> int:
        """How many distinct shards a stage's ranks hold: ``world_size``, fewer when heads are
        replicated over ranks, 1 for an MLA latent."""
        return self.kv_heads_total // self.num_kv_heads

    @property
    def shards(self) -> int:
        """How many shards the model is stored in: ``tp_shards`` per pipeline stage."""
        return self.tp_shards * self.pp_size

    @property
    def ranks(self) -> int:
        """Ranks of an engine of this geometry (every stage's): the global ranks 0 .. ranks - 1."""
        return self.world_size * self.pp_size

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.world_size + self.rank

    def shard_of(self, rank: int) -> int:
        """The shard global rank ``rank`` holds (whose objects it reads and writes): in its stage,
        ranks ``[t * world_size // tp_shards, (t + 1) * world_size // tp_shards)`` hold shard
        ``t``, the assignment of vLLM's ``QKVParallelLinear`` (``tp_rank // num_kv_head_replicas``)."""
        stage, tp = divmod(rank, self.world_size)
        return stage * self.tp_shards + tp * self.tp_shards // self.world_size

    def shard_span(self, shard: int) -> tuple[range, range]:
        """The model's layers and KV heads that shard ``shard`` holds."""
        stage, t = divmod(shard, self.tp_shards)
        n, h = self.num_layers, self.num_kv_heads
        return range(stage * n, (stage + 1) * n), range(t * h, (t + 1) * h)

    def logical(self) -> KVGeometry:
        """The whole model's KV (every shard's layers and heads, in order) as one rank would hold it."""
        return KVGeometry(self.num_layers * self.pp_size, self.kv_heads_total, self.head_dim, self.dtype, self.kv_kind)

    def at_rank(self, rank: int) -> KVGeometry:
        """The geometry of global rank ``rank``."""
        stage, tp = divmod(rank, self.world_size)
        return msgspec.structs.replace(self, rank=tp, pp_rank=stage)

    def canonical(self) -> KVGeometry:
        """The same shards as rank 0 holds them, ``total_kv_heads`` 0 unless heads are replicated:
        two geometries of one model's shards compare equal."""
        replicated = self.kv_kind != KV_LATENT and self.kv_heads_total != self.num_kv_heads * self.world_size
        total = self.kv_heads_total if replicated else 0
        return msgspec.structs.replace(self, rank=0, pp_rank=0, total_kv_heads=total)

    def digest(self, chunk_size: int) -> str:
        """The 32-hex-digit identity of what this geometry's stored objects hold with chunks of
        ``chunk_size`` tokens: a blake3 hash of a versioned, canonical text of every value that
        changes a stored byte or which bytes a shard's key names -- layers (per stage), KV heads
        per shard, the model's KV heads, head_dim, dtype, kind, shards per stage, pipeline stages
        and the chunk size. The rank and stage a geometry describes do not change it (every rank of
        an engine stores one model's shards), nor does ``world_size`` beyond the shards it makes
        (ranks holding replicas of a head share its shard). Object headers and the L3 namespace
        carry it, so an object written under another geometry is never read as this one's.

        Contract: never change the text for a given geometry (stored objects depend on it); a new
        encoding gets a new version tag."""
        return _digest(self.canonical(), chunk_size)

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int]:
        """Shape of one stored (canonical) chunk: ``(planes, num_layers, chunk_size, hidden_dim)``."""
        return (self.planes, self.num_layers, chunk_size, self.hidden_dim)

    def chunk_nbytes(self, chunk_size: int) -> int:
        return self.planes * self.num_layers * chunk_size * self.hidden_dim * self.itemsize

    def check(self) -> KVGeometry:
        """Return self if every value is possible; ValueError naming the first field that is not."""
        for name, most in (
            ("num_layers", MAX_NUM_LAYERS),
            ("num_kv_heads", MAX_NUM_KV_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("world_size", MAX_WORLD_SIZE),
        ):
            _bounded(name, getattr(self, name), most)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be between 0 and world_size - 1 = {self.world_size - 1}, got {self.rank!r}")
        _bounded("pp_size", self.pp_size, MAX_WORLD_SIZE)
        if isinstance(self.pp_rank, bool) or not isinstance(self.pp_rank, int) or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be between 0 and pp_size - 1 = {self.pp_size - 1}, got {self.pp_rank!r}")
        if self.num_layers * self.pp_size > MAX_NUM_LAYERS:
            raise ValueError(f"{self.pp_size} stages of {self.num_layers} layers are more than {MAX_NUM_LAYERS} layers")
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a str, got {self.dtype!r}")
        check_dtype(self.dtype)
        if self.kv_kind not in KV_PLANES:
            raise ValueError(f"unknown kv_kind {self.kv_kind!r}; known: {', '.join(KV_PLANES)}")
        total = self.total_kv_heads
        if isinstance(total, bool) or not isinstance(total, int) or not 0 <= total <= MAX_NUM_KV_HEADS:
            raise ValueError(f"total_kv_heads must be between 0 and {MAX_NUM_KV_HEADS}, got {total!r}")
        if self.kv_kind == KV_LATENT:
            if self.num_kv_heads != 1 or total > 1:
                raise ValueError(
                    f"an MLA latent cache has one latent per token (num_kv_heads 1), got num_kv_heads "
                    f"{self.num_kv_heads} and total_kv_heads {total}"
                )
        elif (
            total
            and total != self.num_kv_heads * self.world_size
            and (self.num_kv_heads != 1 or self.world_size % total)
        ):
            # (fewer KV heads than ranks: each rank holds one head, shared by world_size // total ranks)
            raise ValueError(
                f"total_kv_heads {total} does not fit world_size {self.world_size} ranks of "
                f"{self.num_kv_heads} KV head(s): it must be num_kv_heads * world_size, or, with one KV "
                "head per rank, divide world_size (heads replicated over ranks)"
            )
        return self

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> KVGeometry:
        """The geometry of a HuggingFace ``config.json`` dict (text configs; multimodal ones nest it
        under ``text_config``), checked. An MLA config (``kv_lora_rank``, DeepSeek-V2/V3) gives a
        latent geometry: one head of ``kv_lora_rank + qk_rope_head_dim``. ValueError when a required
        field is missing or a value impossible (e.g. an unsupported dtype)."""
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = cfg["text_config"]
        try:
            layers = int(cfg["num_hidden_layers"])
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
            if cfg.get("kv_lora_rank"):
                latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
                return cls(layers, 1, latent, dtype, kv_kind=KV_LATENT).check()
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]!r}") from None
        except TypeError as e:  # a null where a number belongs
            raise ValueError(f"config.json: {e}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return cls(layers, kv_heads, head_dim, dtype).check()


DIGEST_TAG = "kvdock/geometry/v1"


@functools.lru_cache(maxsize=1024)
def _digest(geo: KVGeometry, chunk_size: int) -> str:
    fields = (
        ("layers", geo.num_layers),
        ("kv_heads", geo.num_kv_heads),
        ("total_kv_heads", geo.kv_heads_total),
        ("head_dim", geo.head_dim),
        ("dtype", geo.dtype),
        ("kind", geo.kv_kind),
        ("tp_shards", geo.tp_shards),
        ("pp_size", geo.pp_size),
        ("chunk_size", chunk_size),
    )
    text = DIGEST_TAG + "".join(f";{name}={value}" for name, value in fields)
    return str(blake3(text.encode()).hexdigest()[:32])


def _bounded(name: str, value: object, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not 1 <= value <= most:
        raise ValueError(f"{name} must be between 1 and {most}, got {value}")


__all__ = [
    "DTYPE_SIZES",
    "FORMAT_AXES",
    "KV_1LTD",
    "KV_2LTD",
    "KV_LATENT",
    "KV_PAIR",
    "KV_PLANES",
    "KVGeometry",
    "check_dtype",
    "concrete_shape",
]

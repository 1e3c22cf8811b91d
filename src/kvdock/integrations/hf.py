"""HuggingFace transformers engine: register a model, save a prefill's KV, load a cached prefix.

import kvdock.integrations.hf as kvhf

ctx = kvhf.connect(model, "tcp://127.0.0.1:5555", "http://127.0.0.1:9000")  # registers the layout
res = kvhf.generate(model, ctx, input_ids, max_new_tokens=32)  # loads, generates, saves the prompt
res.output_ids, res.hit_tokens, res.ttft_s

Layout. transformers keeps, per layer, keys and values ``[batch, kv_heads, seq, head_dim]`` (keys
after RoPE). kvdock stores ``KV_2LTD`` ``[2, L, T, D]`` with ``D = kv_heads * head_dim`` and
``D index = head * head_dim + dim``; :func:`save_kv` and :func:`load_kv` convert between the two.
The model is registered in the ``HND`` engine format.

Models. Decoder-only models whose every layer has a plain K/V cache: full attention and sliding-
window attention (Llama, Qwen2, Qwen3, Mistral, ...), in any dtype kvdock stores. Models with
other layer kinds (linear attention / SSM, chunked attention, KV sharing, MLA's K/V of different
widths, indexer caches) are refused with :class:`~kvdock.errors.InvalidInputError`.

Sliding windows. A transformers ``DynamicCache(config=...)`` keeps only the last ``window - 1``
tokens of a sliding-window layer, so it cannot give back a whole prefix. This module therefore
always uses caches of plain full layers (``DynamicCache()``): every layer keeps all its keys and
the model's own sliding-window mask limits what each query sees, which gives the same result as
the windowed cache (tested against full recompute). :func:`save_kv` refuses a sliding layer that
dropped tokens, with a message saying how to prefill instead — never stores a wrong prefix.

Whole-prompt cap. :func:`load_kv` never covers the whole prompt: it loads at most
the last whole chunk strictly below ``len(tokens)``, so at least one prompt token is computed
(``generate`` silently recomputes everything, against a full cache, otherwise).
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

import kvdock.sdk as kvd
from kvdock.codecs import hf as hf_codec
from kvdock.errors import InvalidInputError
from kvdock.integrations import fingerprint as fp
from kvdock.keys import normalize_tokens
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import EngineInfo
from kvdock.sdk.chunks import TensorChunks
from kvdock.sdk.engine import dtype_name, lookup_tips, retrieve_into

KV_FORMAT = hf_codec.KV_FORMAT
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config attributes whose presence means the cache is not one plain K/V pair per layer
_UNSUPPORTED_ATTRS = ("attention_chunk_size", "kv_lora_rank", "kv_sharing_modes", "num_kv_shared_layers")

__all__ = ["GenerateResult", "cache_kwarg", "connect", "generate", "load_kv", "model_fingerprint", "save_kv"]

_FINGERPRINTS: weakref.WeakKeyDictionary[PreTrainedModel, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Spec:
    """A transformers model as kvdock sees it: its KV geometry (off its config and parameters)."""

    model_type: str
    geometry: KVGeometry
    attention_backend: str


def _spec(model: object) -> _Spec:
    """Validate ``model`` and derive its KV geometry; InvalidInputError if it is not supported."""
    if not isinstance(model, PreTrainedModel):
        raise InvalidInputError(
            f"model must be a transformers PreTrainedModel (e.g. LlamaForCausalLM), got {type(model).__name__}"
        )
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise InvalidInputError(f"{type(model).__name__} is an encoder-decoder model; only decoder-only models")
    tc = cfg.get_text_config(decoder=True)
    kind = str(getattr(tc, "model_type", "") or type(model).__name__)
    try:
        num_layers = int(tc.num_hidden_layers)
        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or int(tc.hidden_size) // heads)
        kv_heads = int(getattr(tc, "num_key_value_heads", None) or heads)
    except (AttributeError, TypeError, ValueError) as e:
        raise InvalidInputError(f"cannot read the KV geometry of {kind!r} from its config: {e}") from None
    layer_types = getattr(tc, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - _LAYER_TYPES)
        if other:
            raise InvalidInputError(
                f"{kind!r} has layers of type {other}; kvdock's transformers integration supports only "
                f"{sorted(_LAYER_TYPES)} layers (hybrid and non-standard caches are refused)"
            )
        if len(layer_types) != num_layers:
            raise InvalidInputError(f"{kind!r}: {len(layer_types)} layer_types for {num_layers} layers")
    for attr in _UNSUPPORTED_ATTRS:
        if getattr(tc, attr, None):
            raise InvalidInputError(f"{kind!r} sets {attr}; its KV cache is not one plain K/V pair per layer")
    v_head_dim = getattr(tc, "v_head_dim", None)
    if v_head_dim not in (None, head_dim):
        raise InvalidInputError(f"{kind!r}: values are {v_head_dim}-wide but keys {head_dim}-wide; unsupported")
    attn = str(getattr(cfg, "_attn_implementation", None) or "")
    try:
        geo = KVGeometry(num_layers, kv_heads, head_dim, dtype_name(model.dtype)).check()
    except ValueError as e:
        raise InvalidInputError(f"{kind!r}: impossible KV geometry: {e}") from None
    return _Spec(kind, geo, attn)


def _check_ctx(ctx: object) -> kvd.KVCacheContext:
    if not isinstance(ctx, kvd.KVCacheContext):
        raise InvalidInputError(f"ctx must be a kvdock.sdk.KVCacheContext, got {type(ctx).__name__}")
    return ctx


def model_fingerprint(model: PreTrainedModel) -> str:
    """What names ``model`` beyond its KV shapes (:mod:`kvdock.integrations.fingerprint`): the
    config fields that change its KV, its dtype, and a sample of every parameter. Computed once
    per model object (weights changed in place afterwards are not seen)."""
    found = _FINGERPRINTS.get(model)
    if found is None:
        parts = {
            "config": fp.config_fields(model.config),
            "dtype": dtype_name(model.dtype),
            "weights": fp.tensors_digest(model.named_parameters()),
        }
        found = _FINGERPRINTS[model] = fp.fingerprint("hf", parts)
    return found


def _check_pair(model: object, ctx: object) -> _Spec:
    """``model`` is supported and ``ctx`` was registered with the same geometry and dtype, and
    (when the registration has one) the same fingerprint."""
    spec = _spec(model)
    c = _check_ctx(ctx)
    if spec.geometry != c.geometry:
        raise InvalidInputError(
            f"the model's KV geometry does not match {c.model_name!r}: {spec.geometry} (registered: {c.geometry})"
        )
    theirs = c.layout.fingerprint
    if theirs and theirs != (mine := model_fingerprint(model)):  # type: ignore[arg-type]
        raise InvalidInputError(
            f"{c.model_name!r} is registered as another model of the same geometry: fingerprint {theirs} (this "
            f"model's: {mine}); its KV would be wrong for this one"
        )
    return spec


def _tokens(tokens: object) -> list[int]:
    try:
        return normalize_tokens(tokens).tolist()  # type: ignore[no-any-return]
    except (TypeError, ValueError) as e:
        raise InvalidInputError(str(e)) from None


def connect(
    model: PreTrainedModel,
    url: str,
    http_url: str,
    model_name: str | None = None,
    timeout: float = 60.0,
    admin_token: str = "",
    *,
    server_key: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
) -> kvd.KVCacheContext:
    """Register ``model``'s KV layout with the server and return a connected SDK context
    (``server_key`` / ``client_key`` for CURVE and ``token`` for a tenant: as in
    :func:`kvdock.sdk.connect`).

    The geometry (layers, KV heads, head_dim) comes from the model's text config, the dtype from the
    model. ``model_name`` defaults to ``config._name_or_path``, else ``config.model_type``. The
    registration carries the model's fingerprint (:func:`model_fingerprint`): a name registered
    with another one is refused (ServerError), and so is a context of such a name in
    :func:`generate` (InvalidInputError).
    ``tokens_per_block`` is 16 (or the chunk size when 16 does not divide it); a name registered
    before with the same geometry keeps its first layout (the stored chunks do not depend on the
    block size). A plain ``kvdock.sdk.connect(url, http_url, model_name)`` finds the model
    afterwards. ``admin_token`` is needed when the server has one (registering a
    model is an admin action there). Raises InvalidInputError (unsupported model),
    ServerUnavailableError, PermissionDeniedError (token missing or wrong), or ServerError (the
    name is registered with another geometry)."""
    spec = _spec(model)
    cfg = model.config
    name = model_name or str(getattr(cfg, "_name_or_path", "") or "") or spec.model_type
    keys = {"server_key": server_key, "client_key": client_key, "token": token}
    chunk = kvd.describe_server(url, "", timeout, **keys).chunk_size
    tpb = 16 if chunk % 16 == 0 else chunk
    geo = spec.geometry
    engine = EngineInfo(name="transformers", version=transformers.__version__, attention_backend=spec.attention_backend)
    lay = kvd.make_layout(
        name,
        num_layers=geo.num_layers,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        dtype=geo.dtype,
        tokens_per_block=tpb,
        kv_format=KV_FORMAT,
        engine=engine,
        fingerprint=model_fingerprint(model),
    )
    assert lay.geometry == geo, (lay.geometry, geo)
    kvd.register_layout(url, http_url, lay, timeout, admin_token, **keys)
    return kvd.connect(url, http_url, name, timeout, server_key=server_key, client_key=client_key, token=token)


def save_kv(
    ctx: kvd.KVCacheContext,
    cache: DynamicCache,
    tokens: object,
    cache_salt: str = "",
    row: int = 0,
    *,
    over: Sequence[int] | None = None,
) -> bool:
    """Store positions ``[0, len(tokens))`` of batch row ``row`` of ``cache`` under ``tokens``.
    The KV is stored as the model's own (``kvdock.sdk.store(..., edited=False)``: not marked
    edited). ``over``: when ``cache`` was computed over a prefix loaded from kvdock, that prefix's
    tips (kvdock.sdk.store's ``over``; :func:`generate` passes them), so the KV may extend a
    stored prefix holding an edit (an overwrite, an SDK store, a bundle import); without them it
    does so only when its first tokens are byte-identical to that prefix (else it was computed
    over other bytes: nothing past the prefix is stored).

    ``cache`` is a transformers ``DynamicCache`` of plain layers holding at least ``len(tokens)``
    positions (keys after RoPE, as the model left them). Only whole chunks are stored; returns
    True when at least one chunk was newly stored, False when all were already there or
    ``tokens`` is shorter than a chunk (then the server is not contacted). Raises
    InvalidInputError (not a DynamicCache, other layer kinds, a sliding-window layer that dropped
    tokens, wrong shape / dtype / row / length), and the SDK's errors."""
    ctx = _check_ctx(ctx)
    toks = _tokens(tokens)
    n = len(toks) // ctx.chunk_size * ctx.chunk_size
    kv = hf_codec.cache_to_kv(cache, ctx.geometry, ctx.dtype, len(toks), n, row, ctx.model_name)
    if n == 0:
        return False
    return kvd.store(ctx, kv, toks[:n], cache_salt, over=over, edited=False)  # the model's own KV


def load_kv(
    ctx: kvd.KVCacheContext, tokens: object, cache_salt: str = "", *, device: torch.device | str | None = None
) -> tuple[DynamicCache | None, int]:
    """The cached prefix of ``tokens`` as a fresh ``DynamicCache`` (batch 1) and its length.

    Never the whole prompt: at most the last whole chunk strictly below ``len(tokens)`` is loaded,
    so the caller computes at least one token. Returns ``(None, 0)`` when nothing is cached or the
    prompt has no whole chunk below its last token. Every layer is a plain full ``DynamicLayer``
    (see the module docstring for sliding-window models), on ``device`` (default CPU), in the
    registered dtype. Pass it to ``model.generate(input_ids, cache=...)`` (transformers 5.x;
    ``past_key_values=`` before the rename) with the whole prompt as ``input_ids``."""
    cache, hit, _ = _load(_check_ctx(ctx), _tokens(tokens), cache_salt, device)
    return cache, hit


def _load(
    ctx: kvd.KVCacheContext, toks: list[int], cache_salt: str, device: torch.device | str | None
) -> tuple[DynamicCache | None, int, list[int] | None]:
    """:func:`load_kv`, with the tips of the prefix it loaded (None when it loaded nothing): the
    prefix is loaded only if it is still the version a lookup saw, so the tips name its bytes."""
    cap = (len(toks) - 1) // ctx.chunk_size * ctx.chunk_size if toks else 0
    if cap == 0:
        return None, 0, None
    seen = lookup_tips(ctx, toks[:cap], cache_salt)
    if not seen.hit_tokens:
        return None, 0, None
    kv = torch.empty(ctx.geometry.chunk_shape(seen.hit_tokens), dtype=ctx.dtype)
    hit = retrieve_into(ctx, toks[: seen.hit_tokens], TensorChunks(kv, ctx.chunk_size), cache_salt, tips=seen.versions)
    if not hit:
        return None, 0, None  # overwritten or gone since the lookup
    assert hit == seen.hit_tokens <= cap, (hit, seen.hit_tokens, cap)
    return hf_codec.kv_to_cache(kv, ctx.geometry, device), hit, list(seen.versions)


@dataclass(frozen=True)
class GenerateResult:
    """What :func:`generate` did.

    ``output_ids``: ``[1, prompt + new]``, what ``model.generate`` returned (its ``sequences``);
    ``hit_tokens``: prompt tokens loaded from kvdock instead of computed; ``ttft_s``: seconds from
    the call to the first new token (kvdock retrieve, cache build, prefill and first decode step)."""

    output_ids: torch.Tensor
    hit_tokens: int
    ttft_s: float


class _FirstTokenClock(BaseStreamer):
    """A streamer that notes when ``generate`` hands over the first new token, then passes every
    call on to the caller's own streamer. ``generate`` puts the prompt first, then each token."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which ``model.generate``/``forward`` take a prefilled cache: transformers 5.x
    renamed ``past_key_values`` to ``cache``; whichever the model takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prompt(input_ids: object, device: torch.device) -> torch.Tensor:
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(_tokens(input_ids))
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise InvalidInputError(
            f"input_ids must be one non-empty prompt of token ids, [T] or [1, T]; got {list(ids.shape)} {ids.dtype} "
            "(batches: call generate once per prompt)"
        )
    return ids.to(device=device, dtype=torch.long)


def generate(
    model: PreTrainedModel, ctx: kvd.KVCacheContext, input_ids: object, cache_salt: str = "", **generate_kwargs: Any
) -> GenerateResult:
    """Generate from one prompt, loading its cached prefix from kvdock and saving its KV after.

    1. :func:`load_kv` (capped below the whole prompt); 2. ``model.generate(input_ids, cache=...)``
    with ``generate_kwargs`` (transformers computes only the uncached tail of the prompt);
    3. :func:`save_kv` of the prompt's positions of the same cache (the prompt's whole chunks not
    already stored; skipped when there are none, or when ``generate`` produced no token so the
    prompt was never prefilled). Greedy decoding and sampling are supported; beam search and
    ``num_return_sequences > 1`` are refused, as are a cache, ``position_ids``, ``inputs_embeds``
    and a padded ``attention_mask`` (the prefix's keys sit at positions ``0..hit``). A
    ``streamer`` is honoured: the timing streamer passes everything on to it. ``ttft_s`` is
    measured from the start of this call (before the kvdock retrieve) to the moment ``generate``
    hands the first new token to the streamer (the whole call when no token was produced).
    Raises InvalidInputError (model, prompt, arguments, or a model that does not match ``ctx``'s
    registration) and the SDK's errors."""
    _check_pair(model, ctx)
    model_generate: Any = getattr(model, "generate", None)
    if not callable(model_generate):
        raise InvalidInputError(f"{type(model).__name__} cannot generate (use a *ForCausalLM model)")
    for key in ("cache", "past_key_values", "position_ids", "inputs_embeds"):
        if key in generate_kwargs:
            raise InvalidInputError(
                f"do not pass {key}=: kvdock's generate derives it from input_ids and the stored prefix"
            )
    mask = generate_kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise InvalidInputError("attention_mask must be all ones: the stored prefix assumes an unpadded prompt")
    gen_cfg = generate_kwargs.get("generation_config") or model.generation_config
    for key in ("num_beams", "num_return_sequences"):
        value = generate_kwargs.get(key, getattr(gen_cfg, key, 1))
        if value not in (None, 1):
            raise InvalidInputError(f"{key}={value} is not supported (one sequence per prompt only)")
    ids = _prompt(input_ids, model.device)
    tokens = ids[0].tolist()
    clock = _FirstTokenClock(generate_kwargs.pop("streamer", None))

    start = time.perf_counter()
    cache, hit, over = _load(_check_ctx(ctx), tokens, cache_salt, model.device)
    if cache is None:
        cache = DynamicCache()  # plain layers, so sliding-window layers keep the whole prompt to save
    out = model_generate(ids, streamer=clock, **{cache_kwarg(model): cache}, **generate_kwargs)
    done = time.perf_counter()

    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    whole = len(tokens) // ctx.chunk_size * ctx.chunk_size
    if whole > hit and cache.get_seq_length() >= len(tokens):
        save_kv(ctx, cache, tokens, cache_salt, over=over)  # computed over the prefix it loaded
    return GenerateResult(sequences, hit, (clock.first_token_at or done) - start)

"""Codecs between engines' own KV layouts and kvdock's canonical ``[2, L, T, D]`` chunk.

:mod:`kvdock.codecs.base` defines the seam (:class:`PagedCodec`, :class:`CodecKey`, the
:data:`CODECS` registry, :func:`codec_for`); :mod:`kvdock.codecs.vllm` registers vLLM's layouts.
Codecs are pure torch: importing them imports no engine.
"""

from kvdock.codecs import vllm as _vllm  # noqa: F401  (registers the vLLM codecs)
from kvdock.codecs.base import CODECS, CodecKey, PagedCodec, codec_for, register_codec

__all__ = ["CODECS", "CodecKey", "PagedCodec", "codec_for", "register_codec"]

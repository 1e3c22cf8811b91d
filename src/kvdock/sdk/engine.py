"""The SDK for engine authors: connectors that move an engine's paged KV to and from kvdock.

* :func:`store_from` / :func:`retrieve_into` copy chunk by chunk straight between the engine's
  own buffers and the shared-memory slots, through a :class:`ChunkSource` / :class:`ChunkSink`
  the engine implements (one copy, no intermediate tensor); an engine's KV is what its model
  computed (``store_from``'s ``edited=False``; an engine storing a tensor passes ``edited=False``
  to ``store_chunks``, whose default marks a user's KV edited), and a save of KV computed over a
  prefix loaded from kvdock names that prefix's tips (``over``);
* :func:`lookup_tips` and ``retrieve_into(..., tips=)``: the ranks of a tensor-parallel engine
  load the versions one lookup saw;
* :func:`make_layout` / :func:`register_layout`: register the engine's KV layout
  (``kvdock.sdk.register_model`` does both from plain numbers);
* :func:`describe_server`: the server's limits and a model's layout, before connecting.

Connecting and the plain calls (``connect``, ``lookup``, ``store``, ...) are :mod:`kvdock.sdk`'s.
"""

from kvdock.sdk._handshake import dtype_name
from kvdock.sdk.chunks import ChunkSink, ChunkSource
from kvdock.sdk.ops import StoreResult, Tips, lookup_tips, retrieve_into, store_chunks, store_from
from kvdock.sdk.registration import describe_server, make_layout, register_layout

__all__ = [
    "ChunkSink",
    "ChunkSource",
    "StoreResult",
    "Tips",
    "describe_server",
    "dtype_name",
    "lookup_tips",
    "make_layout",
    "register_layout",
    "retrieve_into",
    "store_chunks",
    "store_from",
]

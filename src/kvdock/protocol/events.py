"""KV events: what a server publishes (``--kv-events-port``) when chunks enter or leave its L1, so
that a cache-aware router can send a request to the host that holds its prefix.

The shape follows vLLM's ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, with kvdock's chunk hashes: a chunk's hash covers every token before it
too (``kvdock.keys.chunk_hashes``), so a router hashes a request's tokens the same way and looks
for the longest run of hashes a host has. Each message on the PUB socket is three frames:
``[b"kvdock", seq (8 bytes, big-endian, counting batches from 0), KVEventBatch (msgpack)]``; a gap
in ``seq`` means the subscriber missed batches (slow, or joined late) and should resync from
``/status`` or by waiting for new events.
"""

from __future__ import annotations

import msgspec

from kvdock.protocol.codec import decode_with

TOPIC = b"kvdock"


class _Event(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    pass


class ChunkStored(_Event, frozen=True):
    """Chunks of one namespace became readable on this server (in ``medium``). ``namespace`` is
    ``kvdock.keys.namespace(model, rank, cache_salt)``: a router computes it for a request's salt;
    the salt itself, a tenant's secret, is never published."""

    chunk_hashes: list[bytes]
    model: str
    rank: int
    namespace: str
    chunk_size: int
    medium: str = "l1"


class ChunkRemoved(_Event, frozen=True):
    """Chunks left ``medium`` (evicted or deleted) and are no longer served from it."""

    chunk_hashes: list[bytes]
    model: str
    rank: int
    namespace: str
    medium: str = "l1"


class AllChunksCleared(_Event, frozen=True):
    """Everything left ``medium`` (an admin clear)."""

    medium: str = "l1"


Event = ChunkStored | ChunkRemoved | AllChunksCleared


class KVEventBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ts: float  # time.time() when the batch was sent
    server: str  # the publishing server's ZMQ URL (which host to route to)
    events: list[Event]
    dropped: int = 0  # chunk hashes this server dropped since its last batch (a backlog over its cap)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes | memoryview) -> KVEventBatch:
    """ProtocolError for anything that is not a batch."""
    batch: KVEventBatch = decode_with(_decoder, data, "KV event batch")
    return batch

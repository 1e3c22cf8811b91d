"""KVGeometry.digest: the identity of what a geometry's stored objects hold (object headers and
the L3 namespace carry it), and keys.storage_namespace, which puts it into L3 keys."""

from __future__ import annotations

import msgspec
import pytest

from kvdock.keys import namespace, storage_namespace
from kvdock.layout import KV_LATENT, KVGeometry

BASE = KVGeometry(2, 2, 32, "bfloat16")
CHUNK = 256


def test_the_digest_is_pinned() -> None:
    """Stored objects depend on it: a new encoding needs a new version tag, never a silent change."""
    assert BASE.digest(CHUNK) == "88bf071074662afcda0459851e1cf0f8"
    # (the world size beyond its shards does not enter: one latent shard for 8 ranks as for 1)
    latent = "cca53db5e698248101b0ebe02c28ba70"
    assert KVGeometry(61, 1, 576, "bfloat16", KV_LATENT, world_size=8, rank=3).digest(64) == latent
    assert KVGeometry(61, 1, 576, "bfloat16", KV_LATENT).digest(64) == latent
    assert storage_namespace("m", 0, "", "abc") == "ef7a48ac00a8a65a2036b3e1a5eba615"


@pytest.mark.parametrize(
    ("other", "what"),
    [
        (KVGeometry(3, 2, 32, "bfloat16"), "layers"),
        (KVGeometry(2, 1, 64, "bfloat16"), "heads per shard (the same chunk shape)"),
        (KVGeometry(2, 4, 16, "bfloat16"), "heads per shard (the same chunk shape, more heads)"),
        (KVGeometry(2, 2, 32, "float16"), "dtype (the same item size)"),
        (KVGeometry(2, 2, 32, "float32"), "dtype"),
        (KVGeometry(2, 1, 128, "bfloat16", KV_LATENT), "kind (a latent of the same width)"),
        (KVGeometry(2, 2, 32, "bfloat16", world_size=2), "shards: shard 0 holds heads 0-1 of 4"),
        (KVGeometry(2, 1, 32, "bfloat16", world_size=2), "shards: shard 0 holds head 0 of 2"),
        (KVGeometry(2, 1, 32, "bfloat16", world_size=4, total_kv_heads=2), "total heads (replicated over ranks)"),
        (KVGeometry(2, 2, 32, "bfloat16", pp_size=2), "pipeline stages"),
    ],
)
def test_every_field_that_changes_stored_bytes_changes_the_digest(other: KVGeometry, what: str) -> None:
    assert other.check().digest(CHUNK) != BASE.digest(CHUNK), what


def test_the_chunk_size_changes_the_digest() -> None:
    assert BASE.digest(CHUNK) != BASE.digest(2 * CHUNK) != BASE.digest(CHUNK // 2)


def test_digests_of_related_geometries_are_all_distinct() -> None:
    geos = [
        KVGeometry(layers, heads, 128 // heads, dtype, world_size=ws)
        for layers in (1, 2)
        for heads in (1, 2, 4)
        for dtype in ("bfloat16", "float16", "float32")
        for ws in (1, 2)
    ]
    digests = {g.digest(c) for g in geos for c in (16, 32)}
    assert len(digests) == len(geos) * 2
    assert all(len(d) == 32 and int(d, 16) >= 0 for d in digests)


def test_what_does_not_change_the_stored_bytes_keeps_the_digest() -> None:
    tp = KVGeometry(2, 1, 32, "bfloat16", world_size=2)
    # every rank and stage of one engine stores one model's shards
    assert tp.at_rank(1).digest(CHUNK) == tp.digest(CHUNK)
    pp = KVGeometry(2, 2, 32, "bfloat16", pp_size=2)
    assert pp.at_rank(1).digest(CHUNK) == pp.digest(CHUNK)
    # replicas of one KV head share its shard, whatever the number of ranks: the same bytes per key
    assert (
        KVGeometry(2, 1, 32, "bfloat16", world_size=4, total_kv_heads=1).digest(CHUNK)
        == KVGeometry(2, 1, 32, "bfloat16", world_size=2, total_kv_heads=1).digest(CHUNK)
        == KVGeometry(2, 1, 32, "bfloat16").digest(CHUNK)
    )
    # a decoded copy (what a restarted server reads from models.msgpack) names the same objects
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(tp), type=KVGeometry)
    assert copy.digest(CHUNK) == tp.digest(CHUNK)


def test_the_storage_namespace_covers_the_geometry() -> None:
    a, b = BASE.digest(CHUNK), KVGeometry(2, 1, 64, "bfloat16").digest(CHUNK)
    assert storage_namespace("m", 0, "", a) != storage_namespace("m", 0, "", b)
    assert storage_namespace("m", 0, "", a) == storage_namespace("m", 0, "", a)
    assert len(storage_namespace("m", 0, "", a)) == 32
    # fields are length-prefixed: no two namespaces share an input
    assert storage_namespace("m", 0, "x", a) != storage_namespace("m", 0, "", "x" + a)
    assert storage_namespace("m", 1, "", a) != storage_namespace("m", 0, "1", a)
    # KV events keep the namespace a router computes from (model, rank, salt) alone
    assert namespace("m", 0, "") != storage_namespace("m", 0, "", a)

"""kvdock.sharding.place: which SDK context holds an engine rank's KV, for every pairing of the
engine's tensor parallelism with the model's stored shards."""

from __future__ import annotations

import pytest

from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.sharding import Placement, place


def geo(world: int, rank: int = 0, heads: int = 8, **kw: object) -> KVGeometry:
    """A model of ``heads`` KV heads of dim 4 as rank ``rank`` of ``world`` holds it."""
    per = max(heads // world, 1)
    total = heads if heads < world else 0
    return KVGeometry(2, per, 4, "float32", world_size=world, rank=rank, total_kv_heads=total, **kw).check()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stored", "mine", "want"),
    [
        (geo(2), geo(2, 1), Placement(1, None, True)),  # the same sharding: its own shard
        (geo(1), geo(1), Placement(0, None, True)),
        (geo(4), geo(1), Placement(None, None, True)),  # TP=1 over 4 shards: the whole model
        (geo(1), geo(2, 1), Placement(0, (16, 32), False)),  # half of the one shard: loads only
        (geo(2), geo(4, 3), Placement(1, (8, 16), False)),  # rank 3 of 4: the second half of shard 1
        (geo(2), geo(8, 5), Placement(1, (4, 8), False)),
        # 2 heads over 4 ranks (each replicated twice) stored at TP=2: ranks 2 and 3 hold shard 1 whole
        (geo(2, heads=2), geo(4, 3, heads=2), Placement(1, None, True)),
        (geo(4, heads=2), geo(2, 1, heads=2), Placement(2, None, True)),  # shard 1 is held first by rank 2
        (geo(8, heads=2), geo(8, 7, heads=2), Placement(7, None, True)),
    ],
)
def test_where_a_rank_kv_lies(stored: KVGeometry, mine: KVGeometry, want: Placement) -> None:
    assert place(stored.canonical(), mine) == want


def test_an_mla_latent_is_read_and_written_whole_by_every_rank() -> None:
    stored = KVGeometry(2, 1, 576, "bfloat16", KV_LATENT, world_size=2)
    for world in (1, 2, 8):
        for rank in range(world):
            mine = KVGeometry(2, 1, 576, "bfloat16", KV_LATENT, world_size=world, rank=rank)
            want = {1: Placement(None, None, True), 2: Placement(rank, None, True)}.get(world, Placement(0, None, True))
            assert place(stored, mine) == want


def test_what_cannot_be_placed_says_why() -> None:
    with pytest.raises(ValueError, match=r"^the model is stored with geometry"):
        place(geo(2), KVGeometry(3, 4, 4, "float32", world_size=2))  # another number of layers
    with pytest.raises(ValueError, match=r"^the model is stored with geometry"):
        place(geo(2), KVGeometry(2, 4, 4, "bfloat16", world_size=2))
    with pytest.raises(ValueError) as err:
        place(geo(4), geo(2, 1))  # rank 1 of 2 holds heads 4..7: shards 2 and 3 of 4
    assert str(err.value) == (
        "rank 1 of 2 holds KV heads [4, 8), which span several of the 4 shards the model is stored in "
        "(tensor-parallel degree 4); run this engine at that degree, at 1, or at a degree that splits those shards"
    )


def test_pipeline_stages_must_be_the_stored_ones() -> None:
    stored = KVGeometry(2, 2, 4, "float32", world_size=2, pp_size=2)  # 4 layers, 4 heads: 4 shards
    # global rank 3 = stage 1, tp rank 1: shard 3
    assert place(stored, KVGeometry(2, 2, 4, "float32", world_size=2, rank=1, pp_size=2, pp_rank=1)) == Placement(
        3, None, True
    )
    # the same stages at TP=4: stage 1's rank 2 holds half of stored shard 3 (first rank: global 3)
    half = KVGeometry(2, 1, 4, "float32", world_size=4, rank=2, pp_size=2, pp_rank=1)
    assert place(stored, half) == Placement(3, (0, 4), False)
    assert place(stored, KVGeometry(4, 4, 4, "float32")) == Placement(None, None, True)  # one rank: everything
    with pytest.raises(ValueError, match=r"this engine's 1 pipeline stage\(s\) are not the 2 the model is stored in"):
        place(stored, KVGeometry(4, 2, 4, "float32", world_size=2, rank=1))

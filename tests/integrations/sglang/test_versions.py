"""Tensor-parallel ranks load one version of a page or miss (the tips ``batch_exists`` saw go to
``batch_get_v1``), and SGLang's continuation of a prefix it loaded from kvdock (an SDK edit) is
stored (``over``): real SGLang host pools, two backends as the two ranks of one engine."""

from __future__ import annotations

from collections.abc import Callable

import torch

import kvdock.sdk as kvd
from conftest import HEAD_DIM, HEADS, LAYERS, PAGE, extra, host_pool, pages_kv, prompt, storage_config
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.integrations.sglang.versions import Loaded, Seen
from kvdock.keying import key_tokens, sglang_page_hashes
from kvdock.testing import ServerProcess

Make = Callable[..., KvdockHiCacheStorage]
HALF = HEADS // 2 * HEAD_DIM  # one rank's share of D


def kv_of(seed: int, n_pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, n_pages * PAGE, HEADS * HEAD_DIM, generator=g).to(torch.bfloat16)


def two_ranks(srv: ServerProcess, backend: Make, name: str, v1: bool = True) -> list[KvdockHiCacheStorage]:
    return [
        backend(
            storage_config(srv, tp_rank=r, tp_size=2, v1=v1, **{"kvdock.model_name": name}),
            host_pool(False, "page_first", heads=HEADS // 2),
        )
        for r in range(2)
    ]


def version_of(got: torch.Tensor, rank: int, versions: dict[str, torch.Tensor], n: int) -> str:
    """Which stored version a rank's loaded pages are (its heads of the first ``n`` pages' KV)."""
    names = [v for v, kv in versions.items() if torch.equal(got, kv[:, :, : n * PAGE, rank * HALF : (rank + 1) * HALF])]
    assert len(names) == 1, f"rank {rank} loaded bytes of no stored version"
    return names[0]


def load_both(
    ranks: list[KvdockHiCacheStorage],
    keys: list[list[str]],
    n: int,
    versions: dict[str, torch.Tensor],
    which: tuple[int, ...] = (0, 1),
) -> list[str | None]:
    """Ranks ``which``' gets of the first ``n`` of their keys: the version each loaded, or None (a miss)."""
    out: list[str | None] = []
    for r in which:
        b = ranks[r]
        dst = b.mem_pool_host.alloc(n * PAGE)
        got = b.batch_get_v1(keys[r][:n], dst, extra([]))
        assert got in ([True] * n, [False] * n), got
        out.append(version_of(pages_kv(b, dst), r, versions, n) if got[0] else None)
        b.mem_pool_host.free(dst)
    return out


def never_mixed(loaded: list[str | None]) -> None:
    assert None in loaded or loaded[0] == loaded[1], f"ranks loaded versions {loaded}"


def test_an_overwrite_between_two_ranks_loads_never_mixes_versions(sgl_server: ServerProcess, backend: Make) -> None:
    name = "sgl-tips-tp2"
    ranks = two_ranks(sgl_server, backend, name)
    tokens = prompt(3, seed=1, tail=3)
    versions = {"old": kv_of(2, 3), "new": kv_of(3, 3)}
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.store(ctx, versions["old"], tokens)

        def overwrite(v: str) -> None:
            assert kvd.store(ctx, versions[v], tokens, overwrite=True)

        def hashes() -> list[list[str]]:  # each rank hashes a prompt itself, once per operation
            return [sglang_page_hashes(tokens, PAGE) for _ in ranks]

        # 1. every rank's exists, the overwrite, then the gets: both miss (their versions are gone)
        keys = hashes()
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, keys, strict=True)] == [3, 3]
        overwrite("new")
        assert load_both(ranks, keys, 3, versions) == [None, None]
        assert [b.stats["get_stale"] for b in ranks] == [1, 1]

        # 2. the overwrite lands between rank 0's get and rank 1's: rank 0 the old bytes, rank 1 a miss
        keys = hashes()
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, keys, strict=True)] == [3, 3]
        first = load_both(ranks, keys, 3, versions, which=(0,))
        overwrite("old")
        dst = ranks[1].mem_pool_host.alloc(3 * PAGE)
        assert ranks[1].batch_get_v1(keys[1], dst, extra([])) == [False] * 3
        assert first == ["new"]

        # 3. nothing in between: both load the version their exists saw
        keys = hashes()
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, keys, strict=True)] == [3, 3]
        assert load_both(ranks, keys, 3, versions) == ["old", "old"]

        # 4. fewer pages than exists saw (SGLang's MIN over the ranks, or its host memory cut):
        #    kvdock is asked for the whole chain exists saw, only the pages asked for are copied
        keys = hashes()
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, keys, strict=True)] == [3, 3]
        assert load_both(ranks, keys, 2, versions) == ["old", "old"]
        keys = hashes()
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, keys, strict=True)] == [3, 3]
        overwrite("new")
        assert load_both(ranks, keys, 2, versions) == [None, None]

        # 5. a get no exists of its operation saw (equal page hashes, hashed anew): a miss
        assert [b.batch_exists(k, extra([])) for b, k in zip(ranks, hashes(), strict=True)] == [3, 3]
        assert load_both(ranks, hashes(), 3, versions) == [None, None]
        assert [b.stats["get_unvouched"] for b in ranks] == [1, 1]

        # 6. interleavings of exists / overwrite / get over both ranks: never two versions
        for step in range(6):
            keys = hashes()
            order = [(0, "exists"), (1, "exists"), (0, "get"), (1, "get")]
            where = step % 5  # the overwrite goes before the step at this place (4: none)
            loaded: list[str | None] = [None, None]
            for i, (r, what) in enumerate(order):
                if i == where:
                    overwrite("new" if step % 2 else "old")
                if what == "exists":
                    assert ranks[r].batch_exists(keys[r], extra([])) == 3
                else:
                    loaded[r] = load_both(ranks, keys, 3, versions, which=(r,))[0]
            never_mixed(loaded)
            assert where != 4 or loaded[0] is not None  # no overwrite: both load


def test_the_generic_path_of_two_ranks_loads_only_what_exists_saw(sgl_server: ServerProcess, backend: Make) -> None:
    name = "sgl-tips-generic"
    ranks = two_ranks(sgl_server, backend, name, v1=False)
    tokens = prompt(2, seed=4, tail=3)
    versions = {"old": kv_of(5, 2), "new": kv_of(6, 2)}
    keys = [sglang_page_hashes(tokens, PAGE) for _ in ranks]
    for r, b in enumerate(ranks):  # each rank stores its heads of the old version, page by page
        assert b.pages is not None
        src = b.mem_pool_host.alloc(2 * PAGE)
        for j in range(2):
            half = versions["old"][:, :, j * PAGE : (j + 1) * PAGE, r * HALF : (r + 1) * HALF]
            b.pages.page(int(src[j * PAGE])).copy_(half.reshape(2, LAYERS, PAGE, HEADS // 2, HEAD_DIM))
        assert b.batch_set(keys[r], [b.mem_pool_host.get_data_page(int(i)) for i in src[::PAGE]])
    assert [b.batch_exists(k) for b, k in zip(ranks, keys, strict=True)] == [2, 2]
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        # the generic path stores each page as a chain of its own: page 0's, overwritten by the SDK
        ctx.chunk_keys = "kvdock"  # type: ignore[attr-defined]
        assert kvd.store(ctx, versions["new"][:, :, :PAGE], key_tokens(keys[0][:1], PAGE), overwrite=True)
    for r, (b, k) in enumerate(zip(ranks, keys, strict=True)):
        got = b.batch_get(k, [b.mem_pool_host.get_dummy_flat_data_page() for _ in k])
        assert got[0] is None  # overwritten after both exists: a miss on both ranks
        assert b.pages is not None and got[1] is not None
        assert torch.equal(
            b.pages.flat_page(got[1]).flatten(3), versions["old"][:, :, PAGE:, r * HALF : (r + 1) * HALF]
        )
    fresh = sglang_page_hashes(tokens, PAGE)  # hashed anew: no exists of this operation saw them
    assert ranks[0].get(fresh[1], ranks[0].mem_pool_host.get_dummy_flat_data_page()) is None
    assert ranks[0].stats["get_unvouched"] == 1


def test_a_continuation_of_a_prefix_loaded_from_kvdock_is_stored(sgl_server: ServerProcess, backend: Make) -> None:
    """The SDK stores edited KV (an overwrite: an edit) under a prompt's first 4 pages; SGLang
    loads it, computes the next 2 pages over it and backs them up: they land, and the SDK reads
    the edit with SGLang's continuation. An engine that computed the prefix itself: dropped."""
    name = "sgl-over"
    pool = host_pool(False, "page_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), pool)
    tokens = prompt(6, seed=7, tail=3)
    edit = kv_of(8, 4)
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.store(ctx, edit, tokens[: 4 * PAGE], overwrite=True)
    keys = sglang_page_hashes(tokens, PAGE)
    assert b.batch_exists(keys, extra([])) == 4
    dst = pool.alloc(4 * PAGE)
    assert b.batch_get_v1(keys[:4], dst, extra([])) == [True] * 4
    assert torch.equal(pages_kv(b, dst), edit)
    # SGLang's continuation (computed over the loaded edit), backed up after the prefix's keys
    cont = pool.alloc(2 * PAGE)
    g = torch.Generator().manual_seed(9)
    for i in cont[::PAGE]:
        page = b.pages.page(int(i))  # type: ignore[union-attr]
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
    assert b.batch_set_v1(keys[4:], cont, extra(keys[:4])) == [True, True]
    assert b.stats["set_over_loaded"] == 1 and b.stats["pages_diverged"] == 0
    assert b.stats["get_vouched"] == 1  # (the edit's tips: a single rank reads with them only for an edit)
    plain = sglang_page_hashes(prompt(2, seed=12, tail=3), PAGE)  # SGLang's own pages: no edit, the plain read
    assert b.batch_set_v1(plain, cont, extra([])) == [True, True]
    assert b.batch_exists(plain, extra([])) == 2
    assert b.batch_get_v1(plain, pool.alloc(2 * PAGE), extra([])) == [True, True]
    assert b.stats["get_vouched"] == 1 and len(b.loaded) == 1
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        kv = kvd.retrieve(ctx, tokens)
        assert kv is not None and kv.shape[2] == 6 * PAGE
        assert torch.equal(kv[:, :, : 4 * PAGE], edit)
        assert torch.equal(kv[:, :, 4 * PAGE :], pages_kv(b, cont))

    # another engine that computed an edited prefix itself (never loaded it): its continuation is dropped
    other = prompt(6, seed=10, tail=3)
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.store(ctx, kv_of(11, 4), other[: 4 * PAGE], overwrite=True)
    b2 = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), host_pool(False, "page_first"))
    okeys = sglang_page_hashes(other, PAGE)
    assert b2.batch_set_v1(okeys[4:], b2.mem_pool_host.alloc(2 * PAGE), extra(okeys[:4])) == [False, False]
    assert b2.stats["pages_diverged"] == 2 and b2.stats["set_over_loaded"] == 0
    # and a rank that loaded it, then set those pages itself (SGLang computed them): forgotten, dropped
    assert b.batch_exists(okeys, extra([])) == 4
    assert b.batch_get_v1(okeys[:4], pool.alloc(4 * PAGE), extra([])) == [True] * 4
    assert b.batch_set_v1(okeys[3:4], pool.alloc(PAGE), extra(okeys[:3])) == [True]  # (deduped)
    assert b.batch_set_v1(okeys[4:], pool.alloc(2 * PAGE), extra(okeys[:4])) == [False, False]
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.lookup(ctx, other) == 4 * PAGE


def test_the_records_are_bounded_and_match_only_their_own_operation() -> None:
    seen = Seen(limit=4)
    keys = sglang_page_hashes(prompt(3, seed=12, tail=3), PAGE)
    seen.note([], keys, 3, (7,))
    assert seen.vouch([], keys) is not None and seen.vouch([], keys).tips == (7,)  # type: ignore[union-attr]
    assert seen.vouch([], keys[:1]).extra == keys[1:]  # type: ignore[union-attr]
    assert seen.vouch(keys[:1], keys[1:2]).extra == keys[2:]  # type: ignore[union-attr]
    assert seen.vouch([], [str(k[:10]) + str(k[10:]) for k in keys]) is None  # equal, not the same objects
    assert seen.vouch(keys[:1], keys[:2]) is None  # another place in the chain
    more = sglang_page_hashes(prompt(2, seed=13, tail=3), PAGE)
    seen.note(["x" * 64], more, 2, (8,))
    assert len(seen) == 4  # the oldest keys dropped: their gets miss
    assert seen.vouch([], keys[:1]) is None and seen.vouch([], keys) is not None
    assert seen.vouch(["y" * 64], more) is None and seen.vouch(["x" * 64], more).tips == (8,)  # type: ignore[union-attr]
    loaded = Loaded(limit=2)
    loaded.note(keys[0], (1,))
    loaded.note(keys[1], (2,))
    assert loaded.over(keys[:2], more) == [2] and loaded.over(keys[:1], more) == [1]
    assert loaded.over(keys[:1], keys[1:2]) == [1]  # a set of keys[1] forgets it
    assert loaded.over(keys[:2], more) == [1]
    loaded.note(more[0], (3,))
    loaded.note(more[1], (4,))
    assert len(loaded) == 2 and loaded.over(keys[:1], more[1:]) is None


def test_an_exists_noted_again_makes_its_keys_the_newest() -> None:
    """Keys an exists notes again (the same objects: SGLang asks again) hold the new record and
    are dropped last; a key twice in one call keeps its last place."""
    seen = Seen(limit=4)
    old = sglang_page_hashes(prompt(2, seed=14, tail=3), PAGE)
    new = sglang_page_hashes(prompt(2, seed=15, tail=3), PAGE)
    seen.note([], old, 2, (1,))
    seen.note([], new, 2, (2,))
    seen.note([], old, 2, (3,))  # (already there: moved last, with tips 3)
    assert seen.vouch([], old).tips == (3,)  # type: ignore[union-attr]
    seen.note(["z" * 64], [new[0], new[0]], 2, (4,))  # one key twice: one entry, at its second place
    assert len(seen) == 4
    assert seen.vouch(["z" * 64, new[0]], [new[0]]).tips == (4,)  # type: ignore[union-attr]
    more = sglang_page_hashes(prompt(2, seed=16, tail=3), PAGE)
    seen.note([], more, 2, (5,))  # drops the two oldest: new[1], then old[0]
    assert seen.vouch([], new) is None and seen.vouch([], old[:1]) is None
    assert seen.vouch(old[:1], old[1:]).tips == (3,) and seen.vouch([], more).tips == (5,)  # type: ignore[union-attr]

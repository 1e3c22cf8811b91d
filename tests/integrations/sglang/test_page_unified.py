"""SGLang's ``page_unified`` host layout (MHA with one or more head groups, MLA) against SGLang
0.5.23's own host pools: byte-exact round trips through a real kvdock server, the SDK reading the
pages as ``[planes, L, T, D]``, another layout reading what ``page_unified`` stored (and back),
the generic path, and the refusal of a page block whose byte order SGLang has renamed.

The expected bytes come from SGLang's own ``PageUnifiedLayout.chunk_span`` (where one layer of
one head group sits in a page block), never from kvdock's views."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvdock.sdk as kvd
from conftest import DTYPE, HEAD_DIM, HEADS, LAYERS, PAGE, extra, fill, host_pool, prompt, storage_config
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.keying import sglang_page_hashes
from kvdock.testing import ServerProcess

Make = Callable[..., KvdockHiCacheStorage]
CASES = [(False, 1), (False, 2), (False, 4), (True, 1)]  # (mla, head groups)
IDS = ["mha-g1", "mha-g2", "mha-g4", "mla"]


def sglang_page(pool: Any, start: int) -> torch.Tensor:
    """The page at host index ``start`` of a ``page_unified`` pool as ``[planes, L, P, D]``, cut
    out of its page block by SGLang's own ``chunk_span`` (one layer of one head group a cell:
    MHA ``[2, P, H/G, head_dim]``, MLA ``[P, C]``)."""
    lay = pool.page_unified_layout
    block = pool.kv_buffer[start // PAGE].reshape(-1).view(torch.uint8)
    planes, hg = lay.components, lay.heads_per_group
    out = torch.empty(planes, lay.layer_num, PAGE, lay.head_num * lay.head_dim, dtype=pool.dtype)
    for g in range(lay.head_group_num):
        for layer in range(lay.layer_num):
            off, n = lay.chunk_span((layer, layer + 1), g)
            cell = block[off : off + n].view(pool.dtype).view(planes, PAGE, hg * lay.head_dim)
            out[:, layer, :, g * hg * lay.head_dim : (g + 1) * hg * lay.head_dim] = cell
    return out


def sglang_pages(pool: Any, idx: torch.Tensor) -> torch.Tensor:
    return torch.cat([sglang_page(pool, int(i)) for i in idx[::PAGE]], dim=2)


@pytest.mark.parametrize(("mla", "groups"), CASES, ids=IDS)
def test_sglang_stores_a_page_unified_pool_the_sdk_reads_edits_and_sglang_loads_the_edit(
    sgl_server: ServerProcess, backend: Make, mla: bool, groups: int
) -> None:
    name = f"pu-{'mla' if mla else 'mha'}-g{groups}"
    pool = host_pool(mla, "page_unified", groups=groups)
    assert pool.page_unified_layout.head_group_num == groups
    b = backend(storage_config(sgl_server, mla=mla, **{"kvdock.model_name": name}), pool)
    assert b.off == "" and b.pages is not None and b.pages.layout == "page_unified"
    fill(pool, seed=1)
    tokens = prompt(4, seed=2, tail=3)
    keys = sglang_page_hashes(tokens, PAGE)
    idx = pool.alloc(4 * PAGE)
    assert b.batch_set_v1(keys[:1], idx[:PAGE], extra([])) == [True]
    assert b.batch_set_v1(keys[1:], idx[PAGE:], extra(keys[:1])) == [True] * 3
    assert b.batch_exists(keys, extra([])) == 4

    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.layout.engine.attention_backend == "hicache/page_unified"
        kv = kvd.retrieve(ctx, tokens)
        assert kv is not None and kv.dtype == DTYPE
        assert kv.shape == ((1, LAYERS, 4 * PAGE, 80) if mla else (2, LAYERS, 4 * PAGE, HEADS * HEAD_DIM))
        assert torch.equal(kv, sglang_pages(pool, idx))
        edited = kv.clone()
        edited[:, :, :PAGE] *= -1
        edited[..., :HEAD_DIM] += 1  # (the first head of every head group moves differently)
        other = prompt(4, seed=3, tail=3)
        assert kvd.store(ctx, edited, other)

    other_keys = sglang_page_hashes(other, PAGE)
    assert b.batch_exists(other_keys, extra([])) == 4
    before = pool.kv_buffer.clone()
    dst = pool.alloc(4 * PAGE)
    assert b.batch_get_v1(other_keys, dst, extra([])) == [True] * 4
    assert torch.equal(sglang_pages(pool, dst), edited)
    # nothing but the loaded page blocks changed
    touched = torch.zeros(pool.kv_buffer.shape[0], dtype=torch.bool)
    touched[dst[::PAGE] // PAGE] = True
    assert torch.equal(pool.kv_buffer[~touched], before[~touched])
    # from a prefix on, only the call's pages are copied
    dst2 = pool.alloc(2 * PAGE)
    assert b.batch_get_v1(other_keys[2:], dst2, extra(other_keys[:2])) == [True, True]
    assert torch.equal(sglang_pages(pool, dst2), edited[:, :, 2 * PAGE :])


@pytest.mark.parametrize(("mla", "other"), [(False, "page_first"), (False, "page_head"), (True, "layer_first")])
def test_another_layout_loads_what_page_unified_stored_and_back(
    sgl_server: ServerProcess, backend: Make, mla: bool, other: str
) -> None:
    """A chunk is the model's KV whatever the host layout: an engine on ``page_unified`` (two head
    groups for MHA) and one on another layout share a model's pages byte for byte."""
    name = f"pu-x-{'mla' if mla else 'mha'}-{other}"
    unified = host_pool(mla, "page_unified", groups=1 if mla else 2)
    plain = host_pool(mla, other)
    bu = backend(storage_config(sgl_server, mla=mla, **{"kvdock.model_name": name}), unified)
    bp = backend(storage_config(sgl_server, mla=mla, **{"kvdock.model_name": name}), plain)
    fill(unified, seed=4)
    fill(plain, seed=5)
    keys = sglang_page_hashes(prompt(3, seed=6, tail=3), PAGE)
    src = unified.alloc(3 * PAGE)
    assert bu.batch_set_v1(keys, src, extra([])) == [True] * 3
    assert bp.batch_exists(keys, extra([])) == 3
    dst = plain.alloc(3 * PAGE)
    assert bp.batch_get_v1(keys, dst, extra([])) == [True] * 3
    assert bp.pages is not None
    got = torch.cat([bp.pages.page(int(i)).flatten(3) for i in dst[::PAGE]], dim=2)
    assert torch.equal(got, sglang_pages(unified, src))
    # and back: the other layout stores, page_unified loads
    keys2 = sglang_page_hashes(prompt(2, seed=7, tail=3), PAGE)
    src2 = plain.alloc(2 * PAGE)
    assert bp.batch_set_v1(keys2, src2, extra([])) == [True] * 2
    assert bu.batch_exists(keys2, extra([])) == 2
    dst2 = unified.alloc(2 * PAGE)
    assert bu.batch_get_v1(keys2, dst2, extra([])) == [True] * 2
    want = torch.cat([bp.pages.page(int(i)).flatten(3) for i in src2[::PAGE]], dim=2)
    assert torch.equal(sglang_pages(unified, dst2), want)


@pytest.mark.parametrize(("mla", "groups"), [(False, 2), (True, 1)], ids=["mha-g2", "mla"])
def test_the_generic_path_moves_a_page_unified_page_block(
    sgl_server: ServerProcess, backend: Make, mla: bool, groups: int
) -> None:
    """A ``page_unified`` flat data page is its page block's bytes (SGLang's ``page-unified-v1``
    object). SGLang 0.5.23's own ``get_data_page`` refuses the layout, so the engine never takes
    this path; a backend handed such a page stores and loads it byte for byte."""
    pool = host_pool(mla, "page_unified", groups=groups)
    with pytest.raises(ValueError, match="Unsupported layout"):
        pool.get_data_page(0)
    name = f"pu-gen-{'mla' if mla else 'mha'}"
    b = backend(storage_config(sgl_server, mla=mla, v1=False, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=8)
    keys = sglang_page_hashes(prompt(2, seed=9, tail=3), PAGE)
    src = pool.alloc(2 * PAGE)
    flats = [pool.kv_buffer[int(i) // PAGE].flatten() for i in src[::PAGE]]
    assert b.batch_set(keys, flats)
    assert b.exists(keys[0]) and b.batch_exists(keys) == 2
    got = b.batch_get(keys, [torch.zeros_like(f) for f in flats])
    assert all(g is not None and torch.equal(g, f) for g, f in zip(got, flats, strict=True))
    # the zero-copy get of what the generic set stored (each generic page: a chain of one)
    dst = pool.alloc(PAGE)
    assert b.batch_get_v1(keys[:1], dst, extra([])) == [True]
    assert torch.equal(sglang_pages(pool, dst), sglang_pages(pool, src[:PAGE]))
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        kv = kvd.retrieve(ctx, prompt(2, seed=9, tail=3)[:PAGE])
        assert kv is not None and torch.equal(kv, sglang_pages(pool, src[:PAGE]))


def test_a_page_unified_pool_of_another_byte_order_is_refused(
    sgl_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang renames the page block's byte order when it changes it; kvdock reads
    ``page-unified-v1`` only, and refuses any other at engine start (no page stored or loaded)."""
    import sglang.srt.mem_cache.pool_host.page_unified as unified

    assert unified.PAGE_UNIFIED_OBJECT_LAYOUT == "page-unified-v1"
    pool = host_pool(False, "page_unified")
    monkeypatch.setattr(unified, "PAGE_UNIFIED_OBJECT_LAYOUT", "page-unified-v2")
    b = KvdockHiCacheStorage(storage_config(sgl_server, **{"kvdock.model_name": "pu-v2"}), {})
    try:
        with pytest.raises(UnsupportedLayoutError, match="page_unified byte order 'page-unified-v2'"):
            b.register_mem_pool_host(pool)
    finally:
        b.close()


def test_a_page_unified_page_reduces_to_runs_unless_its_head_groups_are_narrow() -> None:
    """One head group: a page is 2 x L runs (MHA) or one run (MLA), copied as one planned step;
    several groups cut a token's heads into short runs, copied page by page (same bytes)."""
    from kvdock.integrations.sglang.pools import HostPages

    for mla, groups, runs in ((False, 1, 2 * LAYERS), (True, 1, 1), (False, 4, None)):
        pages = HostPages(host_pool(mla, "page_unified", groups=groups))
        plan = pages.plan(torch.empty(pages.shape, dtype=DTYPE))
        assert (plan is None) if runs is None else (plan is not None and len(plan.in_slot) == runs)

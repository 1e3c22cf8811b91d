"""The backend's data path, against SGLang 0.5.23's real host pools: a batch's pages move between
kvdock's slots and the pool in one planned copy (no per-slot view), a set reads each page in its
own order, and a single page (SGLang's generic ``get`` / ``set``) goes the one way a batch does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from conftest import LAYOUTS, PAGE, extra, fill, host_pool, pages_kv, prompt, storage_config
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.integrations.sglang.ends import Pages
from kvdock.integrations.sglang.pools import HostPages
from kvdock.keying import sglang_page_hashes
from kvdock.testing import ServerProcess

Make = Callable[..., KvdockHiCacheStorage]


@pytest.mark.parametrize(("mla", "layout"), [(False, x) for x in LAYOUTS] + [(True, "layer_first")])
def test_a_batch_moves_in_one_planned_copy_without_a_view_per_slot(
    sgl_server: ServerProcess, backend: Make, monkeypatch: pytest.MonkeyPatch, mla: bool, layout: str
) -> None:
    """Over shared memory the transfer hands the pages every slot's address at once
    (``Pages.add_slots``): a put or take per slot would raise here. Bytes exact both ways, after
    a prefix too."""

    def per_slot(*_: object) -> None:
        raise AssertionError("a slot went through put/take one by one")

    monkeypatch.setattr(Pages, "put", per_slot)
    monkeypatch.setattr(Pages, "take", per_slot)
    name = f"sgl-direct-{'mla' if mla else 'mha'}-{layout}"
    pool = host_pool(mla, layout)
    b = backend(storage_config(sgl_server, mla=mla, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=40)
    tokens = prompt(5, seed=41, tail=1)
    keys = sglang_page_hashes(tokens, PAGE)
    src = pool.alloc(5 * PAGE)
    assert b.batch_set_v1(keys[:2], src[: 2 * PAGE], extra([])) == [True, True]
    assert b.batch_set_v1(keys[2:], src[2 * PAGE :], extra(keys[:2])) == [True] * 3
    dst = pool.alloc(5 * PAGE)
    assert b.batch_exists(keys, extra([])) == 5
    assert b.batch_get_v1(keys[:1], dst[:PAGE], extra([])) == [True]
    assert b.batch_get_v1(keys[1:], dst[PAGE:], extra(keys[:1])) == [True] * 4
    assert torch.equal(pages_kv(b, dst), pages_kv(b, src))
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        kv = kvd.retrieve(ctx, tokens)
        assert kv is not None and torch.equal(kv, pages_kv(b, src))
    assert b.stats["get_failed"] == b.stats["set_failed"] == 0


def test_a_set_reads_each_page_in_its_own_order() -> None:
    """page_first: a page's runs (one token of one layer) in the page's order, paired with the
    same slot offsets as in the slot's order; the slot's order is not the page's (else this tests
    nothing)."""
    pages = HostPages(host_pool(False, "page_first"))
    plan = pages.slot_plan()
    assert plan is not None and plan is pages.slot_plan()
    assert (np.diff(plan.page_page) > 0).all()
    assert not (np.diff(plan.in_page) > 0).all()
    assert sorted(zip(plan.page_slot.tolist(), plan.page_page.tolist(), strict=True)) == sorted(
        zip(plan.in_slot.tolist(), plan.in_page.tolist(), strict=True)
    )


def test_pages_refuse_host_indices_outside_the_pool_before_any_copy() -> None:
    pages = HostPages(host_pool(False, "layer_first"))
    with pytest.raises(ValueError, match="not the start of a page"):
        Pages(pages, [pages.capacity], first=0)
    with pytest.raises(ValueError, match="not the start of a page"):
        pages.starts(1, torch.arange(PAGE) + 3)
    with pytest.raises(ValueError, match="not whole pages"):
        pages.starts(2, torch.cat([torch.arange(PAGE), torch.arange(PAGE).flip(0) + PAGE]))
    assert pages.starts(2, torch.cat([torch.arange(PAGE) + 2 * PAGE, torch.arange(PAGE)])).tolist() == [2 * PAGE, 0]
    twice = torch.cat([torch.arange(PAGE) + PAGE, torch.arange(PAGE) + PAGE])
    assert pages.starts(2, twice).tolist() == [PAGE, PAGE]  # (a store may read one page twice)
    with pytest.raises(ValueError, match="name a page twice"):
        pages.starts(2, twice, distinct=True)  # (a load may not write one twice)


def test_host_indices_of_any_integer_dtype_or_layout_give_the_same_starts() -> None:
    """SGLang's int64 CPU indices are read as they are (no torch op); others are converted
    first: the same pages, the same refusals."""
    pages = HostPages(host_pool(False, "layer_first"))
    idx = torch.cat([torch.arange(PAGE) + 3 * PAGE, torch.arange(PAGE) + PAGE])
    strided = torch.stack([idx, idx], dim=1)[:, 0]  # (int64, not contiguous)
    assert not strided.is_contiguous()
    for given in (idx, idx.to(torch.int32), strided, idx.view(2, PAGE)):
        got = pages.starts(2, given)
        assert got.dtype == np.int64 and got.tolist() == [3 * PAGE, PAGE]
    with pytest.raises(ValueError, match="not whole pages"):
        pages.starts(2, idx.flip(0).to(torch.int32))
    with pytest.raises(ValueError, match="host indices for 2 pages"):
        pages.starts(2, idx[1:])


@pytest.mark.parametrize("single", [True, False], ids=["single-page-calls", "batch-of-one"])
def test_a_single_page_is_a_batch_of_one(sgl_server: ServerProcess, backend: Make, single: bool) -> None:
    """SGLang's generic ``exists`` / ``get`` / ``set`` of one page and the zero-copy calls of a
    batch of one go the same way: an SDK edit loaded with the tips exists saw (counted, and
    recorded for the ``over`` of the sets after it), a set of that page by SGLang forgets it,
    the same counters, the same bytes."""
    name = f"sgl-one-{single}"
    pool = host_pool(False, "page_first")
    b = backend(storage_config(sgl_server, v1=not single, **{"kvdock.model_name": name}), pool)
    tokens = prompt(1, seed=42, tail=1)
    (key,) = sglang_page_hashes(tokens, PAGE)
    edit = torch.randn(2, *pages_kv(b, pool.alloc(PAGE)).shape[1:], generator=torch.Generator().manual_seed(43))
    edit = edit.to(pool.dtype)
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.store(ctx, edit, tokens, overwrite=True)  # an edit (its version has the EDITED bit)
    dst = pool.alloc(PAGE)
    if single:
        assert b.exists(key)
        flat = b.get(key, pool.get_dummy_flat_data_page())
        assert flat is not None
        pool.set_from_flat_data_page(int(dst[0]), flat)
    else:
        assert b.batch_exists([key], extra([])) == 1
        assert b.batch_get_v1([key], dst, extra([])) == [True]
    assert torch.equal(pages_kv(b, dst), edit)
    assert b.stats["get_vouched"] == 1 and b.stats["pages_loaded"] == 1
    assert len(b.loaded) == 1  # what the sets after it extend the edit over
    # SGLang sets the page itself: kvdock keeps the edit (deduped), the record is forgotten
    if single:
        assert b.set(key, pool.get_data_page(int(dst[0]), flat=True))
    else:
        assert b.batch_set_v1([key], dst, extra([])) == [True]
    assert len(b.loaded) == 0 and b.stats["pages_stored"] == 0 and b.stats["set_over_loaded"] == 0
    # a page of its own: stored, the same way
    other = pool.alloc(PAGE)
    fill(pool, seed=44)
    (new,) = sglang_page_hashes(prompt(1, seed=45, tail=1), PAGE)
    if single:
        assert b.set(new, pool.get_data_page(int(other[0]), flat=True))
    else:
        assert b.batch_set_v1([new], other, extra([])) == [True]
    assert b.stats["pages_stored"] == 1
    dst2 = pool.alloc(PAGE)
    assert b.batch_get_v1([new], dst2, extra([])) == [True]
    assert torch.equal(pages_kv(b, dst2), pages_kv(b, other))


def test_every_call_before_the_pool_is_registered_is_a_miss(sgl_server: ServerProcess) -> None:
    """SGLang's threads die on any exception: before ``register_mem_pool_host`` every call of the
    one path is a counted miss."""
    b = KvdockHiCacheStorage(storage_config(sgl_server, **{"kvdock.model_name": "sgl-unregistered"}), {})
    try:
        (key,) = sglang_page_hashes(prompt(1, seed=46, tail=1), PAGE)
        idx = torch.arange(PAGE)
        assert b.get(key) is None and b.batch_get([key]) == [None]
        assert b.set(key, torch.zeros(8)) is False and b.batch_set([key], [torch.zeros(8)]) is False
        assert b.batch_exists([key], extra([])) == 0 and not b.exists(key)
        assert b.batch_get_v1([key], idx, extra([])) == [False]
        assert b.batch_set_v1([key], idx, extra([])) == [False]
        assert b.stats["get_unavailable"] == 3 and b.stats["set_unavailable"] == 3
    finally:
        b.close()


def test_the_inline_transport_moves_the_same_pages_slot_by_slot(backend: Make, tmp_path: Any) -> None:
    """A server that shares no memory: the pages go slot by slot (``put`` / ``take``), the same
    bytes, batch and single page alike, after a prefix too."""
    from kvdock.testing import start_server

    srv = start_server("--no-disk", "--no-shm", chunk_size=PAGE, l1_size="64MiB", log_path=tmp_path / "s.log")
    try:
        pool = host_pool(False, "page_first")
        b = backend(storage_config(srv, **{"kvdock.model_name": "sgl-inline"}), pool)
        assert b._ctx is not None and b._ctx.transport == "inline"
        fill(pool, seed=47)
        keys = sglang_page_hashes(prompt(3, seed=48, tail=1), PAGE)
        src = pool.alloc(3 * PAGE)
        assert b.batch_set_v1(keys[:1], src[:PAGE], extra([])) == [True]
        assert b.batch_set_v1(keys[1:], src[PAGE:], extra(keys[:1])) == [True, True]
        dst = pool.alloc(3 * PAGE)
        assert b.batch_exists(keys, extra([])) == 3
        assert b.batch_get_v1(keys[1:], dst[PAGE:], extra(keys[:1])) == [True, True]
        assert torch.equal(pages_kv(b, dst[PAGE:]), pages_kv(b, src[PAGE:]))
        (one,) = sglang_page_hashes(prompt(1, seed=49, tail=1), PAGE)
        assert b.set(one, pool.get_data_page(int(src[0]), flat=True))
        flat = b.get(one)
        assert flat is not None and torch.equal(flat, pool.get_data_page(int(src[0]), flat=True))
    finally:
        srv.stop()

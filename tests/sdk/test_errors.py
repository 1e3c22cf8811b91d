"""Every failure a user can cause or meet is a KVCacheSDKError with a message that says what to do."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, free_port, make_kv, make_tokens
from kvdock.errors import KVCacheSDKError
from kvdock.layout import KVGeometry
from kvdock.protocol import messages as m
from kvdock.sdk._handshake import find_model


def test_unreachable_http_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(kvd.ServerUnavailableError, match=f"127.0.0.1:{url.rsplit(':', 1)[1]}/config"):
        kvd.server_config(url, timeout=2)


def test_connect_needs_no_http(server) -> None:
    """The handshake runs over the control plane (Describe): http_url may be left out (None).
    Issue 27: a dead one given is refused (tests/sdk/test_first_call.py)."""
    with kvd.connect(server.url, None, MODEL, timeout=5) as ctx:
        assert ctx.chunk_size == server.get("/config")["chunk_size"] and ctx.http_url is None


def test_silent_zmq_endpoint_times_out_naming_the_url(server) -> None:
    """A socket that takes the connection but never answers: the whole timeout, then an error
    naming it (nothing listening at all fails at once: tests/sdk/test_first_call.py)."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        dead = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(kvd.ServerUnavailableError, match=f"{dead}.*no reply.*1.0s"):
            kvd.connect(dead, server.http_url, MODEL, timeout=1.0)


def test_unknown_model_lists_registered_ones(server) -> None:
    kvd.register_model(server.url, server.http_url, "other", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    with pytest.raises(kvd.UnknownModelError, match=r"'nope' is not registered.*registered models: other, tiny"):
        kvd.connect(server.url, server.http_url, "nope", timeout=5)
    assert issubclass(kvd.UnknownModelError, KVCacheSDKError)


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        (make_kv(CHUNK)[0], r"KV_2LTD \[2, num_layers=3, tokens, D=16\].*got \[3, 16, 16\]"),
        (make_kv(CHUNK).transpose(1, 2), r"got \[2, 16, 3, 16\]"),
        (torch.zeros(3, 3, CHUNK, 16, dtype=torch.bfloat16), r"got \[3, 3, 16, 16\]"),
        (make_kv(CHUNK, torch.float32), r"dtype torch.float32 does not match 'tiny''s torch.bfloat16"),
        (make_kv(CHUNK + 1), r"kv has 17 tokens but 16 token ids"),
        ("not a tensor", r"kv must be a torch.Tensor, got str"),
    ],
)
def test_bad_kv_is_refused_and_nothing_is_stored(ctx, kv, match: str) -> None:
    tokens = make_tokens(CHUNK)
    with pytest.raises(kvd.InvalidInputError, match=match):
        kvd.store(ctx, kv, tokens)
    assert kvd.lookup(ctx, tokens) == 0


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1.0] * CHUNK, "must be integers, got float"),
        ([True] * CHUNK, "must be integers, got bool"),
        (["a"] * CHUNK, "must be integers, got str"),
        ([-1] + [0] * (CHUNK - 1), "out of range"),
        ([2**32] + [0] * (CHUNK - 1), "out of range"),
        (np.zeros((2, CHUNK // 2), dtype=np.int64), "one-dimensional"),
        (torch.zeros(CHUNK, dtype=torch.float32), "must be integers"),
        (42, "must be a sequence of integers, got int"),
    ],
)
def test_bad_token_ids_are_refused(ctx, tokens, match: str) -> None:
    with pytest.raises(kvd.InvalidInputError, match=match):
        kvd.store(ctx, make_kv(CHUNK), tokens)
    with pytest.raises(kvd.InvalidInputError, match=match):
        kvd.retrieve(ctx, tokens)
    with pytest.raises(kvd.InvalidInputError, match=match):
        kvd.lookup(ctx, tokens)


def test_closed_context_raises_and_double_close_is_harmless(server) -> None:
    ctx = kvd.connect(server.url, server.http_url, MODEL, timeout=5)
    assert server.get("/status")["clients"] == 1
    kvd.close(ctx)
    deadline = time.monotonic() + 5  # CloseClient is sent without waiting for its reply
    while server.get("/status")["clients"] != 0:
        assert time.monotonic() < deadline, "the server did not forget the closed client"
        time.sleep(0.02)
    kvd.close(ctx)
    assert ctx.closed
    with pytest.raises(KVCacheSDKError, match="closed"):
        kvd.retrieve(ctx, make_tokens(CHUNK))
    with pytest.raises(KVCacheSDKError, match="closed"):
        kvd.store(ctx, make_kv(CHUNK), make_tokens(CHUNK))
    with kvd.connect(server.url, server.http_url, MODEL, timeout=5) as c2:
        assert not c2.closed
    assert c2.closed


def test_pool_full_is_a_clear_error(make_server) -> None:
    srv = make_server(l1_size="8KiB")  # two slots of 4 KiB
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        # hold both slots pinned by an open retrieve session
        kv = make_kv(2 * CHUNK, seed=1)
        assert kvd.store(c, kv, make_tokens(2 * CHUNK))
        from kvdock.keys import normalize_tokens

        pinned = c.call(m.PrepareRetrieve(c.client_id, "hold", normalize_tokens(make_tokens(2 * CHUNK)).tobytes()))
        assert len(pinned.reply.slots) == 2
        with pytest.raises(kvd.PoolFullError, match="no room for 1 chunk"):
            kvd.store(c, make_kv(CHUNK, seed=2), make_tokens(CHUNK, start=500))
        c.call(m.CommitRetrieve(c.client_id, "hold"))
        assert kvd.store(c, make_kv(CHUNK, seed=2), make_tokens(CHUNK, start=500)) is True
        assert kvd.check_server_integrity(c) == []


def test_registration_same_geometry_is_harmless_different_is_refused(server) -> None:
    again = kvd.register_model(server.url, server.http_url, MODEL, dtype=torch.bfloat16, **GEOMETRY)
    assert again.created is False and again.chunk_nbytes == 2 * 3 * CHUNK * 16 * 2
    # another engine, format and block size with the same geometry: the first registration stays
    engine = m.EngineInfo("other-engine", "1.0", "FLASH_ATTN")
    lay = kvd.make_layout(MODEL, dtype="bfloat16", **GEOMETRY, tokens_per_block=8, kv_format="HND", engine=engine)
    assert lay.engine == m.EngineInfo("other-engine", "1.0", "FLASH_ATTN", "HND", [2, 1, 2, 8, 8])
    assert kvd.register_layout(server.url, server.http_url, lay).created is False
    with kvd.connect(server.url, server.http_url, MODEL, timeout=5) as c:
        assert c.layout.tokens_per_block == 16 and c.layout.engine == m.EngineInfo(view_shape=[2, 1, 16, 2, 8])
        assert c.geometry == lay.geometry == KVGeometry(3, 2, 8, "bfloat16")
    with pytest.raises(kvd.ServerError, match=r"already registered with a different geometry.*layers=3"):
        kvd.register_model(server.url, server.http_url, MODEL, dtype="float32", **GEOMETRY)
    with pytest.raises(kvd.ServerError, match="chunk_size 16 is not a multiple of tokens_per_block 32"):
        kvd.register_model(server.url, server.http_url, "big-block", dtype="float32", **GEOMETRY, tokens_per_block=32)
    with pytest.raises(kvd.InvalidInputError, match="unsupported KV dtype 'int8'"):
        kvd.register_model(server.url, server.http_url, "x", dtype="int8", **GEOMETRY)
    with pytest.raises(kvd.InvalidInputError, match="num_layers must be between 1 and 4096, got 0"):
        kvd.register_model(server.url, server.http_url, "x", dtype="float32", num_layers=0, num_kv_heads=1, head_dim=4)
    with pytest.raises(kvd.InvalidInputError, match="unknown KV format 'XYZ'"):
        kvd.register_model(server.url, server.http_url, "x", dtype="float32", **GEOMETRY, kv_format="XYZ")
    # the model that was there is unchanged
    with kvd.connect(server.url, server.http_url, MODEL, timeout=5) as c:
        assert c.dtype == torch.bfloat16


def test_the_layout_is_read_from_status() -> None:
    lay = kvd.make_layout("a", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16")
    entry = {"model_name": "a", "layout": msgspec.to_builtins(lay)}
    assert find_model({"cache_context_meta": [entry]}, "a") == lay
    with pytest.raises(kvd.UnknownModelError, match="registered models: a"):
        find_model({"cache_context_meta": [entry]}, "b")
    old = {"model_name": "a", "world_size": 1, "kv_cache_layout": {}}  # a server of protocol 2
    older = rf"no layout for 'a' \(a server older than protocol {m.PROTOCOL_VERSION}\?\)"
    with pytest.raises(KVCacheSDKError, match=older):
        find_model({"cache_context_meta": [old]}, "a")
    bad: list[tuple[dict, str]] = [
        ({**entry["layout"], "block_size": 16}, "unknown field `block_size`"),
        ({**entry["layout"], "geometry": {**entry["layout"]["geometry"], "dtype": "int8"}}, "unsupported KV dtype"),
        ({**entry["layout"], "geometry": {**entry["layout"]["geometry"], "head_dim": 0}}, "head_dim must be between"),
        ({**entry["layout"], "model_name": "b"}, "holds the layout of 'b'"),
    ]
    for layout, match in bad:
        with pytest.raises(KVCacheSDKError, match=match):
            find_model({"cache_context_meta": [{"model_name": "a", "layout": layout}]}, "a")


def test_hnd_registration_decodes_the_same_geometry(server) -> None:
    kvd.register_model(
        server.url,
        server.http_url,
        "hnd",
        dtype="float16",
        num_layers=2,
        num_kv_heads=4,
        head_dim=8,
        kv_format="HND",
        tokens_per_block=8,
    )
    entry = next(e for e in server.get("/status")["cache_context_meta"] if e["model_name"] == "hnd")
    assert entry["kv_cache_layout"]["engine_kv_concrete_shape"] == [2, 1, 4, 8, 8]
    with kvd.connect(server.url, server.http_url, "hnd", timeout=5) as c:
        assert (c.geometry.num_kv_heads, c.geometry.head_dim, c.geometry.hidden_dim) == (4, 8, 32)
        kv = torch.randn(2, 2, CHUNK, 32).to(torch.float16)
        assert kvd.store(c, kv, make_tokens(CHUNK))
        assert torch.equal(kvd.retrieve(c, make_tokens(CHUNK)), kv)


def test_context_survives_a_server_restart(make_server, tmp_path) -> None:
    from helpers import ALWAYS_PROCESS, start_inprocess, start_server

    start_any = start_server if ALWAYS_PROCESS else start_inprocess  # (make_server's kind)
    disk = str(tmp_path / "l2")
    srv = make_server("--disk-dir", disk)
    kv, tokens = make_kv(2 * CHUNK, seed=9), make_tokens(2 * CHUNK, start=9)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, tokens)
        old_id = c.client_id
        deadline = time.monotonic() + 10
        while srv.get("/status")["tiers"]["l2"]["objects"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.stop()
        again = start_any(tmp_path, "--disk-dir", disk, chunk_size=CHUNK, port=srv.port, http_port=srv.http_port)
        try:
            out = kvd.retrieve(c, tokens)  # registers again, maps the new pool, loads from L2
            assert out is not None and torch.equal(out, kv)
            assert c.client_id != old_id and c.transport == "shm"
            assert kvd.store(c, make_kv(CHUNK, seed=10), make_tokens(CHUNK, start=500))
            assert kvd.check_server_integrity(c) == []
        finally:
            assert again.stop() == 0


# --------------------------------------------------------------------------------------------------
# Bad arguments that used to escape as bare exceptions (NotImplementedError, zmq.error.ZMQError) or
# be accepted (a dict's keys used as tokens, a non-str salt refused by the server as "malformed"):
# each is an InvalidInputError, raised before anything is sent, that says what is expected.


def _raises_exactly(message: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(kvd.InvalidInputError) as info:
        fn(*args, **kwargs)
    assert info.type is kvd.InvalidInputError
    assert str(info.value) == message


def test_kv_on_the_meta_device_is_refused(ctx) -> None:
    kv = torch.empty(2, 3, CHUNK, 16, dtype=torch.bfloat16, device="meta")
    _raises_exactly(
        "kv is on the meta device, which holds no data; pass a tensor with values (CPU or GPU)",
        kvd.store,
        ctx,
        kv,
        make_tokens(CHUNK),
    )
    assert kvd.lookup(ctx, make_tokens(CHUNK)) == 0


def test_tokens_on_the_meta_device_are_refused(ctx) -> None:
    tokens = torch.zeros(CHUNK, dtype=torch.long, device="meta")
    msg = "token ids are on the meta device, which holds no values; pass a CPU or GPU tensor"
    _raises_exactly(msg, kvd.store, ctx, make_kv(CHUNK), tokens)
    _raises_exactly(msg, kvd.retrieve, ctx, tokens)
    _raises_exactly(msg, kvd.lookup, ctx, tokens)


@pytest.mark.parametrize(
    ("tokens", "kind"),
    [({i: 0 for i in range(CHUNK)}, "dict"), (set(range(CHUNK)), "set"), (frozenset(range(CHUNK)), "frozenset")],
)
def test_mappings_and_sets_are_not_token_ids(ctx, tokens, kind: str) -> None:
    msg = f"token ids must be a sequence of integers, got a {kind} (its order is not a token order; pass a list)"
    _raises_exactly(msg, kvd.store, ctx, make_kv(CHUNK), tokens)
    _raises_exactly(msg, kvd.retrieve, ctx, tokens)
    _raises_exactly(msg, kvd.lookup, ctx, tokens)
    assert kvd.lookup(ctx, list(range(CHUNK))) == 0  # the keys were not stored either


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        (5, 'cache_salt must be a str ("" for none), got int 5'),
        (None, 'cache_salt must be a str ("" for none), got NoneType None'),
        (b"salt", "cache_salt must be a str (\"\" for none), got bytes b'salt'"),
        ("\udc80", "cache_salt must be valid text (it is sent as UTF-8): surrogates not allowed"),
    ],
)
def test_a_cache_salt_that_is_not_text_is_refused(ctx, salt, message: str) -> None:
    tokens = make_tokens(CHUNK)
    _raises_exactly(message, kvd.store, ctx, make_kv(CHUNK), tokens, salt)
    _raises_exactly(message, kvd.retrieve, ctx, tokens, salt)
    _raises_exactly(message, kvd.lookup, ctx, tokens, salt)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (1, "overwrite must be True or False, got int 1"),
        ("yes", "overwrite must be True or False, got str 'yes'"),
        (None, "overwrite must be True or False, got NoneType None"),
    ],
)
def test_overwrite_must_be_a_bool(ctx, flag, message: str) -> None:
    _raises_exactly(message, kvd.store, ctx, make_kv(CHUNK), make_tokens(CHUNK), overwrite=flag)
    assert kvd.lookup(ctx, make_tokens(CHUNK)) == 0
    assert kvd.store(ctx, make_kv(CHUNK), make_tokens(CHUNK), overwrite=np.bool_(True)) is True


EXPECTED_URL = "expected 'tcp://HOST:PORT' (e.g. 'tcp://127.0.0.1:5555') or 'ipc://PATH'"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "127.0.0.1:5555",
            f"url '127.0.0.1:5555' has no supported scheme: {EXPECTED_URL}; did you mean 'tcp://127.0.0.1:5555'?",
        ),
        ("http://127.0.0.1:5555", f"url 'http://127.0.0.1:5555' has no supported scheme: {EXPECTED_URL}"),
        ("inproc://kvdock", f"url 'inproc://kvdock' has no supported scheme: {EXPECTED_URL}"),
        ("tcp://127.0.0.1", f"url 'tcp://127.0.0.1' needs a host and a port 1..65535: {EXPECTED_URL}"),
        ("tcp://:5555", f"url 'tcp://:5555' needs a host and a port 1..65535: {EXPECTED_URL}"),
        ("tcp://127.0.0.1:99999", f"url 'tcp://127.0.0.1:99999' needs a host and a port 1..65535: {EXPECTED_URL}"),
        ("ipc://", f"url 'ipc://' names no path: {EXPECTED_URL}"),
        (5555, f"url must be a str, {EXPECTED_URL}; got int"),
    ],
)
def test_a_url_zmq_cannot_use_is_refused_saying_what_is_expected(server, url, message: str) -> None:
    _raises_exactly(message, kvd.connect, url, server.http_url, MODEL, timeout=2)
    _raises_exactly(
        message,
        kvd.register_model,
        url,
        server.http_url,
        "x",
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
    )


def test_an_http_url_without_a_scheme_is_refused(server) -> None:
    bare = server.http_url.removeprefix("http://")
    _raises_exactly(
        f"http_url {bare!r} is not an HTTP URL: expected 'http://HOST:PORT' (e.g. 'http://127.0.0.1:9000'); "
        f"did you mean 'http://{bare}'?",
        kvd.connect,
        server.url,
        bare,
        MODEL,
    )


@pytest.mark.parametrize(
    ("timeout", "message"),
    [
        ("10", "timeout must be a number of seconds, got str '10'"),
        (None, "timeout must be a number of seconds, got NoneType None"),
        (True, "timeout must be a number of seconds, got bool True"),
        (0, "timeout must be a number of seconds in (0, 86400], got 0"),
        (-1.5, "timeout must be a number of seconds in (0, 86400], got -1.5"),
        (float("nan"), "timeout must be a number of seconds in (0, 86400], got nan"),
        (float("inf"), "timeout must be a number of seconds in (0, 86400], got inf"),
        (10**9, "timeout must be a number of seconds in (0, 86400], got 1000000000"),
    ],
)
def test_a_timeout_that_is_not_a_sane_number_of_seconds_is_refused(server, timeout, message: str) -> None:
    _raises_exactly(message, kvd.connect, server.url, server.http_url, MODEL, timeout=timeout)


def test_a_model_name_that_is_not_a_str_is_refused(server) -> None:
    _raises_exactly("model_name must be a non-empty str, got int 7", kvd.connect, server.url, server.http_url, 7)
    _raises_exactly("model_name must be a non-empty str, got str ''", kvd.connect, server.url, server.http_url, "")


def test_something_else_than_a_context_is_refused(server) -> None:
    msg = "ctx must be a KVCacheContext from kvdock.sdk.connect(), got str"
    _raises_exactly(msg, kvd.lookup, "ctx", make_tokens(CHUNK))
    _raises_exactly(msg, kvd.retrieve, "ctx", make_tokens(CHUNK))
    _raises_exactly(msg, kvd.store, "ctx", make_kv(CHUNK), make_tokens(CHUNK))
    _raises_exactly(msg, kvd.check_server_integrity, "ctx")
    _raises_exactly(msg, kvd.close, "ctx")


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_kv_that_requires_grad_is_stored_as_its_values(make_server, transport: str) -> None:
    srv = make_server(*(["--no-shm"] if transport == "inline" else []))
    kv = make_kv(CHUNK, torch.float32).to(torch.bfloat16).requires_grad_()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, make_tokens(CHUNK))
        assert torch.equal(kvd.retrieve(c, make_tokens(CHUNK)), kv.detach())


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize("kind", ["expanded", "overlapping layers", "requires_grad"])
def test_retrieve_out_unusable_buffer_is_an_invalid_input_error(ctx: kvd.KVCacheContext, kind: str) -> None:
    """Regression: retrieve(..., out=buf) only checked shape, dtype and device: a buffer whose
    elements overlap (an expand()ed tensor) or that requires grad failed inside copy_ with a bare
    RuntimeError instead of the promised InvalidInputError. And an as_strided view whose layers
    share memory (adversarial test) was written into, returning what the last writes left."""
    n = 2 * CHUNK
    tokens = make_tokens(n)
    assert kvd.store(ctx, make_kv(n), tokens)
    layers, d = ctx.geometry.num_layers, ctx.geometry.hidden_dim
    backing = torch.full((2 * layers * n * d,), 3.0, dtype=ctx.dtype)
    if kind == "expanded":
        out = torch.zeros(2, layers, 1, d, dtype=ctx.dtype).expand(-1, -1, n, -1)
    elif kind == "overlapping layers":  # a layer's stride is half a layer
        out = backing.as_strided((2, layers, n, d), (layers * n * d, n * d // 2, d, 1))
    else:
        out = torch.zeros(2, layers, n, d, dtype=ctx.dtype, requires_grad=True)
    match = "must not require grad" if kind == "requires_grad" else "overlapping elements"
    for fast in (True, False):
        ctx.fast_reads = fast
        with pytest.raises(kvd.InvalidInputError, match=match):
            kvd.retrieve(ctx, tokens, out=out)
    assert (backing == 3.0).all()  # nothing written


def test_failed_reregistration_leaks_no_server_side_clients(make_server, tmp_path) -> None:
    """Regression: after a server restart the context registered a new client BEFORE it checked
    that the layout and chunk size still matched; on a mismatch it raised but never told the
    server to forget that registration, so every later call leaked one more server-side client."""
    from kvdock.testing import start_server

    srv = make_server()
    kv, tokens = make_kv(4 * CHUNK), make_tokens(4 * CHUNK)
    c = kvd.connect(srv.url, srv.http_url, MODEL, timeout=5)
    try:
        assert kvd.store(c, kv, tokens)
        assert srv.stop() == 0
        again = start_server(
            "--no-disk",
            l1_size="64MiB",
            chunk_size=2 * CHUNK,  # restarted with another chunk size
            port=srv.port,
            http_port=srv.http_port,
            log_path=tmp_path / "again.log",
            timeout=30,
        )
        try:
            kvd.register_model(again.url, again.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            for _ in range(3):
                with pytest.raises(kvd.KVCacheSDKError, match="another layout"):
                    kvd.lookup(c, tokens)
            c.close()
            time.sleep(0.5)
            assert again.get("/status")["clients"] == 0, "failed re-registrations stay registered on the server"
        finally:
            assert again.stop() == 0
    finally:
        c.close()

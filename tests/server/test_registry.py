"""The model and client registry: client leases, bounded registrations, the admin token, request
limits and the file the registrations persist to. Unit tests drive a Registry with a fake clock;
the others run real servers (defects 7, 8 and 9 of issue 7, and models.msgpack's mode)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, GEOMETRY, MODEL, make_kv, make_tokens
from kvdock.config import MAX_CLIENTS, ServerConfig
from kvdock.errors import RegistrationError
from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.protocol import decode_reply, encode
from kvdock.protocol import messages as m
from kvdock.sdk.registration import make_layout
from kvdock.server.registry import ALL_RANKS, Registry

LAYOUT = make_layout(MODEL, dtype="bfloat16", **GEOMETRY)
DEAD_URL, DEAD_HTTP = "tcp://127.0.0.1:9", "http://127.0.0.1:9"  # nothing listens there


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LAYOUT_FIELDS = ("model_name", "tokens_per_block", "engine")


def _layout(name: str = MODEL, **changes: object) -> m.ModelLayout:
    """LAYOUT named ``name``; ``changes`` of model_name, tokens_per_block and engine apply to the
    layout, the others to its geometry."""
    geo = {k: v for k, v in changes.items() if k not in LAYOUT_FIELDS}
    lay = {"model_name": name, **{k: v for k, v in changes.items() if k in LAYOUT_FIELDS}}
    return msgspec.structs.replace(LAYOUT, geometry=msgspec.structs.replace(LAYOUT.geometry, **geo), **lay)


def _huge_layout(name: str = "huge") -> m.ModelLayout:
    """The geometry of defect 8: 2**40 layers, 2**20 KV heads of 2**20 dims (built by hand: the
    SDK's make_layout refuses it before it reaches a server)."""
    return m.ModelLayout(name, KVGeometry(2**40, 2**20, 2**20, "bfloat16"), 16)


# ---------------------------------------------------------------- unit: client leases


def test_silent_clients_expire_after_client_ttl_and_requests_renew_the_lease() -> None:
    clock = Clock()
    reg = Registry(CHUNK, config=ServerConfig(client_ttl=10.0), clock=clock)
    reg.register_model(_layout())
    a, b, c = (reg.register_client(f"i{n}", MODEL, 0, "shm") for n in range(3))
    clock.now += 6
    assert reg.touch(a.client_id) is a
    assert reg.touch("nobody") is None
    clock.now += 3.5  # b and c silent for 9.5 s
    ended: list[str] = []
    assert reg.expire(ended.append) == 0
    clock.now += 0.5  # b and c silent for exactly client_ttl
    assert reg.expire(ended.append) == 2
    assert ended == [b.client_id, c.client_id]
    assert list(reg.clients) == [a.client_id]
    clock.now += 5.5  # a silent for 9.5 s
    assert reg.expire(ended.append) == 0
    clock.now += 0.5
    assert reg.expire(ended.append) == 1
    assert ended == [b.client_id, c.client_id, a.client_id]
    assert reg.clients == {} and reg.expired_clients == 3


def test_a_failing_end_client_still_forgets_the_client() -> None:
    clock = Clock()
    reg = Registry(CHUNK, config=ServerConfig(client_ttl=1.0), clock=clock)
    reg.register_model(_layout())
    reg.register_client("i", MODEL, 0, "inline")
    clock.now += 1

    def boom(client_id: str) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        reg.expire(boom)
    assert reg.clients == {}


def test_live_clients_are_capped() -> None:
    clock = Clock()
    reg = Registry(CHUNK, config=ServerConfig(client_ttl=5.0), clock=clock, max_clients=3)
    reg.register_model(_layout())
    for n in range(3):
        reg.register_client(f"i{n}", MODEL, 0, "shm")
    with pytest.raises(RegistrationError) as err:
        reg.register_client("one-too-many", MODEL, 0, "shm")
    assert err.value.code == "limit"
    assert str(err.value) == (
        "the server already holds 3 client registrations, its limit; a client silent for client_ttl (5 s) is forgotten"
    )
    clock.now += 5
    assert reg.expire(lambda client_id: None) == 3
    assert reg.register_client("again", MODEL, 0, "shm").instance_id == "again"
    assert MAX_CLIENTS == 10_000 and Registry(CHUNK).max_clients == MAX_CLIENTS


# ---------------------------------------------------------------- unit: model registrations


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_name": ""}, "model_name must not be empty"),
        ({"model_name": "m" * 201}, "model_name has 201 characters, more than 200"),
        (
            {"model_name": "a\x001\x00b"},
            "model_name 'a\\x001\\x00b' holds control characters",
        ),  # (review: it would blur object names)
        ({"engine": m.EngineInfo(name="e" * 201)}, "engine.name has 201 characters, more than 200"),
        ({"engine": m.EngineInfo(version="v" * 300)}, "engine.version has 300 characters, more than 200"),
        (
            {"engine": m.EngineInfo(attention_backend="a" * 201)},
            "engine.attention_backend has 201 characters, more than 200",
        ),
        ({"num_layers": 2**40}, "num_layers must be between 1 and 4096, got 1099511627776"),
        ({"num_layers": 0}, "num_layers must be between 1 and 4096, got 0"),
        ({"world_size": 1025}, "world_size must be between 1 and 1024, got 1025"),
        ({"world_size": -1}, "world_size must be between 1 and 1024, got -1"),
        ({"tokens_per_block": 0}, "tokens_per_block must be positive, got 0"),
        ({"num_kv_heads": 4097}, "num_kv_heads must be between 1 and 4096, got 4097"),
        ({"head_dim": 16385}, "head_dim must be between 1 and 16384, got 16385"),
        ({"num_kv_heads": 2**20, "head_dim": 2**20}, "num_kv_heads must be between 1 and 4096, got 1048576"),
        (
            {"dtype": "int8"},
            "unsupported KV dtype 'int8'; supported: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2",
        ),
        ({"kv_kind": "mla"}, "unknown kv_kind 'mla'; known: pair, latent"),
        ({"rank": 1}, "rank must be between 0 and world_size - 1 = 0, got 1"),
        (
            {"kv_kind": "latent", "num_kv_heads": 2},
            "an MLA latent cache has one latent per token (num_kv_heads 1), got num_kv_heads 2 and total_kv_heads 0",
        ),
        ({"world_size": 2, "rank": 2}, "rank must be between 0 and world_size - 1 = 1, got 2"),
        ({"world_size": 2, "rank": -1}, "rank must be between 0 and world_size - 1 = 1, got -1"),
        (
            {"world_size": 4, "num_kv_heads": 1, "total_kv_heads": 3},
            "total_kv_heads 3 does not fit world_size 4 ranks of 1 KV head(s): it must be num_kv_heads * "
            "world_size, or, with one KV head per rank, divide world_size (heads replicated over ranks)",
        ),
        (
            {"world_size": 2, "num_kv_heads": 2, "total_kv_heads": 2},
            "total_kv_heads 2 does not fit world_size 2 ranks of 2 KV head(s): it must be num_kv_heads * "
            "world_size, or, with one KV head per rank, divide world_size (heads replicated over ranks)",
        ),
        ({"total_kv_heads": -1}, "total_kv_heads must be between 0 and 4096, got -1"),
        (
            {"engine": m.EngineInfo(kv_cache_layout="L" * 201)},
            "engine.kv_cache_layout has 201 characters, more than 200",
        ),
        ({"engine": m.EngineInfo(view_shape=[1] * 17)}, "engine.view_shape has 17 entries, more than 16"),
        ({"engine": m.EngineInfo(view_strides=[1] * 17)}, "engine.view_strides has 17 entries, more than 16"),
        ({"engine": m.EngineInfo(pp_rank=1)}, "engine.pp_rank 1 out of range for pp_size 1"),
        ({"engine": m.EngineInfo(pp_rank=0, pp_size=0)}, "engine.pp_rank 0 out of range for pp_size 0"),
    ],
)
def test_impossible_layouts_are_refused_and_not_persisted(tmp_path: Path, changes: dict, message: str) -> None:
    path = tmp_path / "models.msgpack"
    reg = Registry(CHUNK, path)
    with pytest.raises(RegistrationError) as err:
        reg.register_model(_layout(**changes))
    assert str(err.value) == message and err.value.code == "registration"
    assert reg.models == {} and not path.exists()


def test_a_chunk_larger_than_the_pool_is_refused() -> None:
    reg = Registry(CHUNK, pool_capacity=64 * 2**20)
    big = _layout("big", num_layers=4096, num_kv_heads=4096, head_dim=16384)
    with pytest.raises(RegistrationError) as err:
        reg.register_model(big)
    assert (
        str(err.value)
        == "one chunk of 'big' (16 tokens) is 16384.00 GiB, more than the whole L1 pool (64.00 MiB; see --l1-size)"
    )
    fits = _layout("fits", num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB a chunk
    assert reg.register_model(fits)[0].slot_nbytes == 2**20
    with pytest.raises(RegistrationError) as err:
        Registry(CHUNK, pool_capacity=2**20 - 2**10).register_model(fits)
    assert (
        str(err.value)
        == "one chunk of 'fits' (16 tokens) is 1.00 MiB, more than the whole L1 pool (1023.00 KiB; see --l1-size)"
    )


def test_same_geometry_with_other_engine_info_and_block_size_shares_the_first_registration(tmp_path: Path) -> None:
    """A vLLM engine (blocks of 32, NHD) and a transformers one (16, HND) of the same model share one
    registration: the stored object is the canonical chunk, the block size does not enter it."""
    path = tmp_path / "models.msgpack"
    reg = Registry(64, path)
    geo = KVGeometry(3, 2, 8, "bfloat16")
    vllm = m.ModelLayout(
        MODEL,
        geo,
        32,
        m.EngineInfo(
            "vllm", "0.29", "FLASH_ATTN", "NHD", [2, 100, 32, 2, 8], [51200, 512, 16, 8, 1], pp_rank=0, pp_size=1
        ),
    )
    hf = make_layout(MODEL, dtype="bfloat16", **GEOMETRY, kv_format="HND", engine=m.EngineInfo("transformers", "5.0"))
    assert hf.geometry == geo and hf.tokens_per_block == 16 and hf.engine.view_shape == [2, 1, 2, 16, 8]
    first, created = reg.register_model(vllm)
    assert created is True and first.slot_nbytes == geo.chunk_nbytes(64)
    again, created = reg.register_model(hf)
    assert created is False and again is first and again.layout == vllm  # the first layout is kept
    assert reg.register_model(vllm)[1] is False
    assert reg.register_model(msgspec.structs.replace(hf, tokens_per_block=64))[1] is False
    assert reg.models[MODEL].layout == vllm and reg.geometry_of(MODEL) == geo and reg.geometry_of("x") is None
    assert msgspec.msgpack.decode(path.read_bytes(), type=list[m.ModelLayout]) == [vllm]
    assert Registry(64, path).models[MODEL].layout == vllm
    # each registration is still checked on its own: a block size that does not divide the chunk
    with pytest.raises(RegistrationError, match="chunk_size 64 is not a multiple of tokens_per_block 48"):
        reg.register_model(msgspec.structs.replace(hf, tokens_per_block=48))
    # a different geometry under the name is refused, naming both
    with pytest.raises(RegistrationError) as err:
        reg.register_model(msgspec.structs.replace(hf, geometry=msgspec.structs.replace(geo, dtype="float16")))
    assert str(err.value) == (
        "model 'tiny' is already registered with a different geometry: layers=3 kv_heads=2 head_dim=8 "
        "dtype=bfloat16 kv_kind=pair world_size=1 rank=0 kv_heads_total=2 (new: layers=3 kv_heads=2 head_dim=8 "
        "dtype=float16 kv_kind=pair world_size=1 rank=0 kv_heads_total=2)"
    )
    assert reg.models[MODEL].layout == vllm


def test_the_ranks_of_a_tensor_parallel_engine_share_one_registration_of_rank_0() -> None:
    reg = Registry(CHUNK)
    rank1 = m.ModelLayout("tp", KVGeometry(3, 2, 8, "bfloat16", world_size=2, rank=1), 16)
    entry, created = reg.register_model(rank1)  # whichever rank comes first
    assert created is True
    assert entry.geometry == KVGeometry(3, 2, 8, "bfloat16", world_size=2, rank=0)  # the shards, not a rank
    assert entry.slot_nbytes == 2 * 3 * CHUNK * 2 * 8 * 2  # one shard's chunk: its 2 heads
    assert reg.register_model(msgspec.structs.replace(rank1, geometry=entry.geometry))[1] is False
    # an engine sharded otherwise (TP=1, TP=4) has the same model's KV: accepted, stored as first registered
    for world, heads in ((1, 4), (4, 1)):
        other = m.ModelLayout("tp", KVGeometry(3, heads, 8, "bfloat16", world_size=world, rank=world - 1), 16)
        assert reg.register_model(other) == (entry, False)
    assert reg.models["tp"].geometry.world_size == 2
    # ranks that disagree on the model are refused, naming both geometries
    for change in ({"dtype": "float16"}, {"num_layers": 4}, {"head_dim": 16}, {"num_kv_heads": 1}):
        bad = m.ModelLayout("tp", msgspec.structs.replace(rank1.geometry, **change), 16)
        with pytest.raises(RegistrationError, match=r"^model 'tp' is already registered with a different geometry"):
            reg.register_model(bad)
    assert reg.models["tp"].geometry == entry.geometry


def test_shards_of_clients() -> None:
    """Which shard a client's requests name: its rank's (ranks holding the same heads share one),
    and every shard for an all-rank client of a model stored in several."""
    reg = Registry(CHUNK)
    models = {
        "tp2": KVGeometry(3, 2, 8, "bfloat16", world_size=2),
        "gqa": KVGeometry(3, 1, 8, "bfloat16", world_size=4, total_kv_heads=2),  # each head on two ranks
        "mla": KVGeometry(3, 1, 576, "bfloat16", kv_kind=KV_LATENT, world_size=2),  # the same latent everywhere
        "one": KVGeometry(3, 2, 8, "bfloat16"),
    }
    for name, geo in models.items():
        reg.register_model(m.ModelLayout(name, geo, 16))
    shards = {
        name: [reg.register_client("i", name, r, "shm").shard for r in range(geo.world_size)]
        for name, geo in models.items()
    }
    assert shards == {"tp2": [0, 1], "gqa": [0, 0, 1, 1], "mla": [0, 0], "one": [0]}
    everyone = {name: reg.register_client("i", name, ALL_RANKS, "shm") for name in models}
    assert {name: (c.sharded, c.shard) for name, c in everyone.items()} == {
        "tp2": (True, 0),
        "gqa": (True, 0),
        "mla": (False, 0),
        "one": (False, 0),
    }
    assert [models[n].shards for n in models] == [2, 2, 1, 1]
    with pytest.raises(RegistrationError) as err:
        reg.register_client("i", "gqa", 4, "shm")
    assert str(err.value) == "kv_rank 4 out of range for 'gqa', stored for 4 ranks (0..3, or -1: every rank)"
    with pytest.raises(RegistrationError, match="kv_rank -2 out of range"):
        reg.register_client("i", "gqa", -2, "shm")


def test_model_registrations_are_bounded_by_max_models(tmp_path: Path) -> None:
    path = tmp_path / "models.msgpack"
    reg = Registry(CHUNK, path, config=ServerConfig(max_models=3))
    for n in range(3):
        assert reg.register_model(_layout(f"m{n}"))[1] is True
    with pytest.raises(RegistrationError) as err:
        reg.register_model(_layout("m3"))
    assert err.value.code == "limit"
    assert str(err.value) == (
        "the server already holds 3 model registrations, its limit (max_models; raise it with --max-models)"
    )
    assert reg.register_model(_layout("m1"))[1] is False  # a known model again is fine
    assert sorted(reg.models) == ["m0", "m1", "m2"]
    # a restart with a smaller limit restores only that many
    assert sorted(Registry(CHUNK, path, config=ServerConfig(max_models=2)).models) == ["m0", "m1"]
    assert sorted(Registry(CHUNK, path).models) == ["m0", "m1", "m2"]


def test_register_model_needs_the_admin_token_when_one_is_set() -> None:
    reg = Registry(CHUNK, config=ServerConfig(admin_token="s3cret"))
    for token in ("", "wrong", "s3cret "):
        with pytest.raises(RegistrationError) as err:
            reg.register_model(_layout(), token)
        assert err.value.code == "unauthorized"
        assert str(err.value) == (
            "registering a model needs the server's admin token (admin_token= in the SDK, --admin-token or "
            "KVDOCK_ADMIN_TOKEN for kvdock register)"
        )
    assert reg.models == {}
    assert reg.register_model(_layout(), "s3cret")[1] is True
    assert Registry(CHUNK).register_model(_layout(), "anything")[1] is True  # no token set: no check


def test_models_file_is_written_0600_whatever_the_umask_and_old_files(tmp_path: Path) -> None:
    path = tmp_path / "models.msgpack"
    path.write_bytes(b"")
    path.chmod(0o644)
    (tmp_path / "models.msgpack.tmp").write_bytes(b"stale")
    (tmp_path / "models.msgpack.tmp").chmod(0o666)
    old = os.umask(0)
    try:
        Registry(CHUNK, path).register_model(_layout())
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not (tmp_path / "models.msgpack.tmp").exists()
    assert msgspec.msgpack.decode(path.read_bytes(), type=list[m.ModelLayout]) == [_layout()]
    assert list(Registry(CHUNK, path).models) == [MODEL]
    path.chmod(0o644)  # as an older server wrote it: made private when loaded
    assert list(Registry(CHUNK, path).models) == [MODEL]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_fingerprints_the_first_non_empty_one_sticks() -> None:
    reg = Registry(CHUNK)
    plain = _layout()
    entry, created = reg.register_model(plain)
    assert created and entry.layout.fingerprint == ""
    fp = msgspec.structs.replace(plain, fingerprint="hf-v1:aa")
    assert reg.check_layout(fp).fingerprint == "hf-v1:aa" and reg.models[MODEL].layout.fingerprint == ""  # no change
    client = reg.register_client("i", MODEL, 0, "inline")
    entry, created = reg.register_model(fp)
    assert not created and entry.layout.fingerprint == "hf-v1:aa" and reg.models[MODEL] is entry
    assert client.model is entry  # its clients see the model as it is now
    assert reg.register_model(plain)[0].layout.fingerprint == "hf-v1:aa"  # "" asserts nothing
    other = msgspec.structs.replace(plain, fingerprint="hf-v1:bb")
    for call in (reg.register_model, reg.check_layout):
        with pytest.raises(RegistrationError) as err:
            call(other)
        assert str(err.value) == (
            f"model {MODEL!r} is already registered as another model of the same geometry: fingerprint hf-v1:aa "
            "(new: hf-v1:bb); its KV would be wrong for this one (register it under another name)"
        )
        assert err.value.code == "registration"
    assert reg.models[MODEL].layout.fingerprint == "hf-v1:aa"
    with pytest.raises(RegistrationError, match="fingerprint must be printable"):
        reg.register_model(msgspec.structs.replace(plain, model_name="x", fingerprint="a\nb"))
    with pytest.raises(RegistrationError, match="at most 200 characters"):
        reg.register_model(msgspec.structs.replace(plain, model_name="x", fingerprint="f" * 201))


def test_the_identity_of_a_model_is_its_stored_geometrys_digest_with_the_chunk_size() -> None:
    reg = Registry(CHUNK)
    assert reg.identity_of(MODEL) is None
    reg.register_model(_layout(world_size=2, rank=1))  # rank 1 registers first: rank 0's is kept
    stored = reg.geometry_of(MODEL)
    assert stored is not None and stored.rank == 0
    assert reg.identity_of(MODEL) == stored.digest(CHUNK) == _layout(world_size=2).geometry.digest(CHUNK)
    assert Registry(2 * CHUNK).register_model(_layout(world_size=2))[0].identity != reg.identity_of(MODEL)
    # an engine sharded otherwise shares the first registration, and its digest
    reg.register_model(_layout(num_kv_heads=4))
    assert reg.identity_of(MODEL) == stored.digest(CHUNK)


def test_a_registration_that_could_not_be_saved_is_retried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "models.msgpack"
    squat = tmp_path / "models.msgpack.tmp"  # a directory there fails every save, as a full disk would
    (squat / "x").mkdir(parents=True)
    clock = Clock()
    reg = Registry(CHUNK, path, clock=clock)
    with caplog.at_level("WARNING", "kvdock.server.registry"):
        assert reg.register_model(_layout())[1]  # registered all the same
        assert reg.unsaved and not path.exists()
        assert "could not save model registrations" in caplog.text
        assert reg.expire(lambda cid: None) == 0 and reg.unsaved  # the reaper's tick: too early to retry
        (squat / "x").rmdir()
        squat.rmdir()
        assert reg.expire(lambda cid: None) == 0 and reg.unsaved and not path.exists()
        clock.now += 5.0  # SAVE_RETRY_S later, the reaper's tick saves
        reg.expire(lambda cid: None)
        assert not reg.unsaved and list(Registry(CHUNK, path).models) == [MODEL]
        assert "model registrations saved to" in caplog.text
        (squat / "x").mkdir(parents=True)
        reg.register_model(_layout("second"))
        assert reg.unsaved and list(Registry(CHUNK, path).models) == [MODEL]
        (squat / "x").rmdir()
        squat.rmdir()
        reg.register_model(_layout())  # any later registration saves at once, even a known name's
        assert not reg.unsaved and list(Registry(CHUNK, path).models) == [MODEL, "second"]


# ---------------------------------------------------------------- real servers


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _dealer(zctx: zmq.Context, url: str) -> zmq.Socket:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(url)
    return sock


def _flood(sock: zmq.Socket, msgs: list[bytes], window: int = 500) -> list[object]:
    """Send every encoded request (at most ``window`` unanswered, so no reply is dropped at a high
    water mark) and return the decoded replies in order."""
    replies: list[object] = []
    for start in range(0, len(msgs), window):
        batch = msgs[start : start + window]
        for i, msg in enumerate(batch):
            sock.send_multipart([(start + i).to_bytes(8, "little"), msg])
        for i in range(len(batch)):
            frames = sock.recv_multipart()
            assert int.from_bytes(frames[0], "little") == start + i
            replies.append(decode_reply(frames[1]))
    return replies


def _wait_for(what, predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r} after {timeout} s"
        time.sleep(0.05)


def test_100k_register_client_messages_stop_at_the_cap(server, zctx) -> None:
    sock = _dealer(zctx, server.url)
    msg = encode(m.RegisterClient(m.PROTOCOL_VERSION, "flood", MODEL))
    replies = _flood(sock, [msg] * 100_000)
    ok = [r for r in replies if isinstance(r, m.ClientRegistered)]
    refused = [r for r in replies if isinstance(r, m.Error)]
    assert (len(ok), len(refused)) == (10_000, 90_000)
    assert refused[0] == m.Error(
        "limit",
        "the server already holds 10000 client registrations, its limit; a client silent for client_ttl (300 s) is "
        "forgotten",
    )
    assert {r.message for r in refused} == {refused[0].message}
    assert server.get("/status")["clients"] == 10_000
    assert "kvdock_clients 10000.0" in server.text("/metrics").splitlines()
    with pytest.raises(kvd.InvalidInputError, match=r"^the server already holds 10000 client registrations"):
        kvd.connect(server.url, server.http_url, MODEL, timeout=10)
    # the flood's clients still work; closing one makes room for the next
    sock.send_multipart([b"c", encode(m.CloseClient(ok[0].client_id))])
    assert decode_reply(sock.recv_multipart()[1]) == m.Done()
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK))
    assert server.get("/status")["clients"] == 9_999


def test_silent_clients_are_forgotten_and_their_sessions_released(make_server, zctx) -> None:
    srv = make_server("--client-ttl", "1")
    sock = _dealer(zctx, srv.url)
    regs = _flood(sock, [encode(m.RegisterClient(m.PROTOCOL_VERSION, f"raw{n}", MODEL)) for n in range(50)])
    silent = regs[0]
    assert isinstance(silent, m.ClientRegistered)
    tokens = np.arange(2 * CHUNK, dtype=np.uint32).tobytes()
    prep = _flood(sock, [encode(m.PrepareStore(silent.client_id, "s", tokens))])[0]
    assert isinstance(prep, m.StorePrepared) and len(prep.slots) == 2
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        me = c.client_id
        status = srv.get("/status")
        assert (status["clients"], status["sessions"]) == (51, 1)
        assert all(r.client_id not in srv.text("/status") for r in regs)  # ids are never shown
        stop = threading.Event()

        def keep_asking() -> None:  # an active client renews its lease with every request
            while not stop.is_set():
                kvd.lookup(c, make_tokens(CHUNK))
                time.sleep(0.1)

        t = threading.Thread(target=keep_asking)
        t.start()
        try:
            status = _wait_for(lambda: srv.get("/status"), lambda s: s["clients"] == 1, timeout=15)
        finally:
            stop.set()
            t.join()
        assert status["sessions"] == 0 and status["l1"]["used_bytes"] == 0  # the silent one's reservation
        assert c.client_id == me  # never forgotten, never re-registered
        assert kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK))
    reply = _flood(sock, [encode(m.Lookup(silent.client_id, tokens))])[0]
    assert reply == m.Error(
        "unknown_client", f"client {silent.client_id!r} is not registered (call RegisterClient first)"
    )
    assert "kvdock_expired_clients_total 50.0" in srv.text("/metrics").splitlines()


def test_3000_register_model_calls_stop_at_max_models(make_server, zctx, tmp_path) -> None:
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))  # MODEL is registered: 63 more fit
    sock = _dealer(zctx, srv.url)
    msgs = [encode(m.RegisterModel(m.PROTOCOL_VERSION, _layout(f"model-{n}"))) for n in range(3000)]
    replies = _flood(sock, msgs, window=100)
    assert all(isinstance(r, m.ModelRegistered) and r.created for r in replies[:63])
    limit = m.Error(
        "limit", "the server already holds 64 model registrations, its limit (max_models; raise it with --max-models)"
    )
    assert replies[63:] == [limit] * (3000 - 63)
    assert len(srv.get("/status")["cache_context_meta"]) == 64
    saved = msgspec.msgpack.decode((disk / "models.msgpack").read_bytes(), type=list[m.ModelLayout])
    assert [lay.model_name for lay in saved] == [MODEL] + [f"model-{n}" for n in range(63)]
    with pytest.raises(kvd.InvalidInputError, match=r"^the server already holds 64 model registrations"):
        kvd.register_model(srv.url, srv.http_url, "one-more", dtype="bfloat16", **GEOMETRY, timeout=10)
    assert kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10).created is False


def test_register_model_needs_the_admin_token(make_server, zctx) -> None:
    srv = make_server("--admin-token", "s3cret", register=None)
    for token in ("", "wrong"):
        with pytest.raises(kvd.PermissionDeniedError) as err:
            kvd.register_model(
                srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=token
            )
        assert str(err.value) == (
            "registering a model needs the server's admin token (admin_token= in the SDK, --admin-token or "
            "KVDOCK_ADMIN_TOKEN for kvdock register)"
        )
        assert err.value.code == "unauthorized"
    sock = _dealer(zctx, srv.url)
    reply = _flood(sock, [encode(m.RegisterModel(m.PROTOCOL_VERSION, _layout("raw")))])[0]
    assert isinstance(reply, m.Error) and reply.code == "unauthorized"
    assert srv.get("/status")["cache_context_meta"] == []
    reg = kvd.register_model(
        srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token="s3cret"
    )
    assert reg.created is True
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:  # using a model needs no token
        assert kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK))


def test_absurd_geometry_is_refused_in_milliseconds_and_never_persisted(make_server, tmp_path) -> None:
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    t0 = time.monotonic()
    with pytest.raises(kvd.ServerError) as err:
        kvd.register_layout(srv.url, srv.http_url, _huge_layout(), timeout=10)
    assert time.monotonic() - t0 < 1.0
    assert err.value.code == "registration"
    assert err.value.message == "num_layers must be between 1 and 4096, got 1099511627776"
    big = _layout("big", num_layers=4096, num_kv_heads=4096, head_dim=16384)
    with pytest.raises(kvd.ServerError) as err:
        kvd.register_layout(srv.url, srv.http_url, big, timeout=10)
    assert err.value.message == (
        "one chunk of 'big' (16 tokens) is 16384.00 GiB, more than the whole L1 pool (8.00 MiB; see --l1-size)"
    )
    # the SDK refuses it before it reaches any server
    with pytest.raises(kvd.InvalidInputError, match=r"^num_layers must be between 1 and 4096, got 1099511627776$"):
        kvd.register_model(
            DEAD_URL, DEAD_HTTP, "huge", num_layers=2**40, num_kv_heads=2**20, head_dim=2**20, dtype="bfloat16"
        )
    # the server keeps serving, and knows only the models it accepted, before and after a restart
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        kv = make_kv(2 * CHUNK)
        assert kvd.store(c, kv, make_tokens(2 * CHUNK))
        assert torch.equal(kvd.retrieve(c, make_tokens(2 * CHUNK)), kv)
    assert [e["model_name"] for e in srv.get("/status")["cache_context_meta"]] == [MODEL]
    saved = msgspec.msgpack.decode((disk / "models.msgpack").read_bytes(), type=list[m.ModelLayout])
    assert [lay.model_name for lay in saved] == [MODEL]
    assert stat.S_IMODE((disk / "models.msgpack").stat().st_mode) == 0o600
    assert srv.stop() == 0
    again = make_server("--disk-dir", str(disk), register=None)
    t0 = time.monotonic()
    with pytest.raises(kvd.UnknownModelError, match="'huge' is not registered"):
        kvd.connect(again.url, again.http_url, "huge", timeout=10)
    assert time.monotonic() - t0 < 1.0
    with kvd.connect(again.url, again.http_url, MODEL, timeout=10) as c:
        assert torch.equal(kvd.retrieve(c, make_tokens(2 * CHUNK)), kv)


# Another client, in its own process (so this process's GIL does not count): lookups until the
# stop file appears, then their latencies as JSON on stdout.
OTHER_CLIENT = """
import json, sys, time
from pathlib import Path
import kvdock.sdk as kvd
url, http_url, model, n, stop = sys.argv[1:]
lat = []
with kvd.connect(url, http_url, model, timeout=10) as c:
    Path(stop + ".ready").touch()
    while not Path(stop).exists():
        t = time.monotonic()
        assert kvd.lookup(c, list(range(int(n)))) == int(n)
        lat.append(time.monotonic() - t)
        time.sleep(0.005)
print(json.dumps(lat))
"""


def test_a_100m_token_request_is_refused_quickly_while_others_keep_their_latency(server, ctx, zctx, tmp_path) -> None:
    kv = make_kv(4 * CHUNK)
    assert kvd.store(ctx, kv, make_tokens(4 * CHUNK))
    stop = tmp_path / "stop"
    other = zygote.Popen(
        [sys.executable, "-c", OTHER_CLIENT, server.url, server.http_url, MODEL, str(4 * CHUNK), str(stop)],
        stdout=subprocess.PIPE,
    )
    try:
        _wait_for(lambda: Path(f"{stop}.ready").exists() or other.poll() is not None, bool)
        time.sleep(0.2)
        huge = np.zeros(100_000_000, dtype=np.uint32)
        message = (
            "request of 100000000 tokens is over the server's limit of 1048576 tokens "
            "(max_request_tokens; raise it with --max-request-tokens)"
        )
        t0 = time.monotonic()
        with pytest.raises(kvd.InvalidInputError) as err:
            kvd.lookup(ctx, huge)
        assert time.monotonic() - t0 < 5.0
        assert str(err.value) == message and err.value.code == "limit"
        # a PrepareStore over the limit from a raw peer: refused before it reserves (or evicts)
        # anything (frames larger than any request are dropped by zmq itself, see test_robustness)
        over = np.zeros(2**20 + CHUNK, dtype=np.uint32)
        sock = _dealer(zctx, server.url)
        reply = _flood(sock, [encode(m.PrepareStore(ctx.client_id, "big", over.tobytes()))])[0]
        assert reply == m.Error("limit", message.replace("100000000", str(2**20 + CHUNK)))
        del huge
        time.sleep(0.2)
    finally:
        stop.touch()
        out, _ = other.communicate(timeout=30)
    assert other.returncode == 0
    latencies = json.loads(out)
    assert len(latencies) > 20
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    status = server.get("/status")
    assert (status["sessions"], status["l1"]["objects"], status["l1"]["evictions"]) == (0, 4, 0)
    assert torch.equal(kvd.retrieve(ctx, make_tokens(4 * CHUNK)), kv)
    # exactly at the limit is fine
    assert kvd.lookup(ctx, np.zeros(2**20, dtype=np.uint32)) == 0


def test_max_request_tokens_is_configurable(make_server) -> None:
    srv = make_server("--max-request-tokens", str(4 * CHUNK))
    assert srv.get("/config")["max_request_tokens"] == 4 * CHUNK
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.lookup(c, make_tokens(4 * CHUNK)) == 0
        with pytest.raises(
            kvd.InvalidInputError,
            match=r"^request of 80 tokens is over the server's limit of 64 tokens \(max_request_tokens; raise it "
            r"with --max-request-tokens\)$",
        ):
            kvd.store(c, make_kv(5 * CHUNK), make_tokens(5 * CHUNK))
        assert srv.get("/status")["l1"]["objects"] == 0


def test_hf_connect_passes_the_admin_token_through(make_server) -> None:
    import transformers as tf

    from kvdock.integrations import hf

    srv = make_server("--admin-token", "s3cret", register=None)
    cfg = tf.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=64,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(cfg).eval()
    with pytest.raises(kvd.PermissionDeniedError, match="needs the server's admin token"):
        hf.connect(model, srv.url, srv.http_url, model_name="llama", timeout=10)
    with hf.connect(model, srv.url, srv.http_url, model_name="llama", timeout=10, admin_token="s3cret") as ctx:
        assert ctx.model_name == "llama"
    assert [e["model_name"] for e in srv.get("/status")["cache_context_meta"]] == ["llama"]


def test_a_clients_touch_budget_refills_at_its_rate_up_to_its_burst() -> None:
    from kvdock.server.registry import TOUCH_BURST, TOUCH_RATE, ClientEntry

    client = ClientEntry("id", "inst", None, 0, "shm")  # type: ignore[arg-type]
    assert client.allow_touches(TOUCH_BURST + 5) == TOUCH_BURST  # a burst, then nothing
    assert client.allow_touches(1) == 0
    client.last_seen = 0.001  # a millisecond later (the request's time)
    assert client.allow_touches(10**6) == int(0.001 * TOUCH_RATE)
    client.last_seen = 3600.0  # an hour idle refills the burst, not more
    assert client.allow_touches(10**9) == TOUCH_BURST
    client.last_seen = 1.0  # a clock that went back gives nothing
    assert client.allow_touches(10) == 0

"""A model name is one model, on one server and across the servers that share an L3: its geometry
(digest in every stored object and in the L3 namespace) and its fingerprint (the model beyond its
shapes). Real servers, real redis-server: another model's KV is a refusal or a miss, never bytes."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import redis as redis_py
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, InProcessServer, RedisProc, ServerProc, make_tokens, wait_for, wait_written
from kvdock.errors import KVCacheSDKError, ServerError, UnknownModelError

NAME = "m"
DTYPE = torch.bfloat16
SPLIT_A = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32}  # chunks [2, 2, T, 64]
SPLIT_B = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64}  # the same chunk shape, other KV
DESC_A = "layers=2 kv_heads=2 head_dim=32 dtype=bfloat16"
DESC_B = "layers=2 kv_heads=1 head_dim=64 dtype=bfloat16"


def register(srv: ServerProc, split: dict[str, int], name: str = NAME, **kw: object) -> kvd.ModelRegistration:
    return kvd.register_model(srv.url, srv.http_url, name, dtype=DTYPE, timeout=10, **split, **kw)  # type: ignore[arg-type]


def kv_of(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 64, generator=g).to(DTYPE)


def store(srv: ServerProc, tokens: list[int], seed: int, name: str = NAME) -> torch.Tensor:
    kv = kv_of(len(tokens), seed)
    with kvd.connect(srv.url, srv.http_url, name, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
    return kv


def reads(srv: ServerProc, tokens: list[int], name: str = NAME) -> tuple[int, torch.Tensor | None]:
    """(lookup, retrieve) of ``tokens`` through ``srv``."""
    with kvd.connect(srv.url, srv.http_url, name, timeout=10) as c:
        return kvd.lookup(c, tokens), kvd.retrieve(c, tokens)


def refused(fn: object, *args: object, **kw: object) -> str:
    """The message of the registration refusal ``fn(*args, **kw)`` raises."""
    with pytest.raises(ServerError) as err:
        fn(*args, **kw)  # type: ignore[operator]
    assert err.value.code == "registration", err.value
    return str(err.value)


# ------------------------------------------------------------------ geometry, across servers


def test_a_server_sharing_the_l3_refuses_another_split_of_a_name(make_server, redis_server: RedisProc) -> None:
    """Issue 29 (1): B once registered `m` as another split of the same chunk shape, and its
    client read A's bytes. Now the L3's record refuses it, naming both geometries."""
    a = make_server("--redis-url", redis_server.url, register=None)
    b = make_server("--redis-url", redis_server.url, register=None)
    assert register(a, SPLIT_A).created
    tokens = make_tokens(3 * CHUNK, start=5)
    store(a, tokens, seed=1)
    wait_written(a, "l3", 3)
    msg = refused(register, b, SPLIT_B)
    where = redis_server.url
    assert f"model 'm' is already registered with a different geometry by a server sharing the L3 {where}: " in msg
    assert DESC_A in msg and f"(new: {DESC_B}" in msg
    with pytest.raises(UnknownModelError):
        kvd.connect(b.url, b.http_url, NAME, timeout=10)
    record = redis_py.Redis.from_url(redis_server.url).hgetall(b"kvdock:v2:model:m")
    assert record[b"logical"] == b"layers=2 kv_heads=2 head_dim=32 dtype=bfloat16 kind=pair"
    assert record[b"fingerprint"] == b"" and len(record[b"digest"]) == 32
    # the same model on B is welcome, and B reads A's KV
    assert register(b, SPLIT_A).created
    hit, got = reads(b, tokens)
    assert hit == 3 * CHUNK and got is not None and torch.equal(got, kv_of(3 * CHUNK, 1))


def test_objects_of_another_geometry_in_the_shared_l3_are_never_read(make_server, redis_server: RedisProc) -> None:
    """Servers that registered a name differently without seeing each other's record (L3 down at
    the time, a record evicted: here deleted) still never read each other's objects: the geometry's
    digest names them in L3."""
    a = make_server("--redis-url", redis_server.url, register=None)
    b = make_server("--redis-url", redis_server.url, register=None)
    register(a, SPLIT_A)
    tokens = make_tokens(2 * CHUNK, start=9)
    store(a, tokens, seed=2)
    wait_written(a, "l3", 2)
    raw = redis_py.Redis.from_url(redis_server.url)
    raw.delete(b"kvdock:v2:model:m")
    assert register(b, SPLIT_B).created  # no record: B's split is the fleet's now
    assert reads(b, tokens) == (0, None)
    mine = store(b, tokens, seed=3)  # B's own KV under the same tokens: its own objects
    wait_written(b, "l3", 2)
    hit, got = reads(b, tokens)
    assert hit == 2 * CHUNK and got is not None and torch.equal(got, mine)
    hit, got = reads(a, tokens)  # A still has its own, from its L1 and its namespace in L3
    assert hit == 2 * CHUNK and got is not None and torch.equal(got, kv_of(2 * CHUNK, 2))
    objects = [k for k in raw.keys(b"kvdock:v2:{*") if b"{invalidations}" not in k]
    assert len(objects) == 4  # two namespaces of two chunks (beside the fleet's invalidations)


def test_engines_sharded_otherwise_on_another_server_share_the_fleets_shards(
    make_server, redis_server: RedisProc
) -> None:
    """A registers `m` for tensor parallelism (2 ranks, a head each); B's engine is TP=1. B adopts
    the fleet's shards (as one server keeps its first registration's), so its whole-model client
    reads what A's ranks stored."""
    a = make_server("--redis-url", redis_server.url, register=None)
    b = make_server("--redis-url", redis_server.url, register=None)
    register(a, {"num_layers": 2, "num_kv_heads": 1, "head_dim": 32}, world_size=2)
    tokens = make_tokens(2 * CHUNK, start=11)
    kv = store(a, tokens, seed=4)  # the whole-model client stores both shards
    wait_written(a, "l3", 4)
    register(b, SPLIT_A)  # TP=1: both heads
    desc = kvd.describe_server(b.url, NAME, timeout=10)
    assert desc.layout is not None and desc.layout.geometry.world_size == 2
    hit, got = reads(b, tokens)
    assert hit == 2 * CHUNK and got is not None and torch.equal(got, kv)


# ------------------------------------------------------------------ geometry, one server


def test_a_lost_registry_never_serves_the_old_split_from_l2(make_server, tmp_path: Path) -> None:
    """Issue 29 (1), on one server: models.msgpack lost (e.g. never saved on a full disk), the
    name registered again with the other split. The L2 objects name A's geometry: a miss."""
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk), register=None)
    register(srv, SPLIT_A)
    tokens = make_tokens(3 * CHUNK, start=13)
    store(srv, tokens, seed=5)
    wait_written(srv, "l2", 3)
    srv.stop(signal.SIGKILL)
    (disk / "models.msgpack").unlink()
    again = make_server("--disk-dir", str(disk), register=None)
    assert "3 object(s) found" in again.log()
    assert register(again, SPLIT_B).created
    assert reads(again, tokens) == (0, None)
    mine = store(again, tokens, seed=6)  # written anew, not deduped against A's files
    wait_written(again, "l2", 3)
    again.stop(signal.SIGKILL)
    third = make_server("--disk-dir", str(disk), register=None)  # B's registration was saved
    hit, got = reads(third, tokens)
    assert hit == 3 * CHUNK and got is not None and torch.equal(got, mine)


# ------------------------------------------------------------------ fingerprints


def test_fingerprints_on_one_server(make_server) -> None:
    srv = make_server(register=None)
    assert register(srv, SPLIT_A, fingerprint="").created
    tokens = make_tokens(2 * CHUNK, start=17)
    kv = store(srv, tokens, seed=7)
    # the first fingerprint of a name registered without one is kept, and its KV stays
    assert register(srv, SPLIT_A, fingerprint="hf-v1:aaaa").created is False
    assert kvd.describe_server(srv.url, NAME, timeout=10).layout.fingerprint == "hf-v1:aaaa"  # type: ignore[union-attr]
    hit, got = reads(srv, tokens)
    assert hit == 2 * CHUNK and got is not None and torch.equal(got, kv)
    msg = refused(register, srv, SPLIT_A, fingerprint="hf-v1:bbbb")
    assert msg == (
        "registration: model 'm' is already registered as another model of the same geometry: fingerprint "
        "hf-v1:aaaa (new: hf-v1:bbbb); its KV would be wrong for this one (register it under another name)"
    )
    assert register(srv, SPLIT_A, fingerprint="").created is False  # "" asserts nothing
    assert register(srv, SPLIT_A, fingerprint="hf-v1:aaaa").created is False
    assert kvd.describe_server(srv.url, NAME, timeout=10).layout.fingerprint == "hf-v1:aaaa"  # type: ignore[union-attr]


def test_fingerprints_across_servers_sharing_the_l3(make_server, redis_server: RedisProc) -> None:
    a = make_server("--redis-url", redis_server.url, register=None)
    b = make_server("--redis-url", redis_server.url, register=None)
    register(a, SPLIT_A)  # no fingerprint yet
    tokens = make_tokens(2 * CHUNK, start=19)
    kv = store(a, tokens, seed=8)
    wait_written(a, "l3", 2)
    assert register(a, SPLIT_A, fingerprint="vllm-v1:1111").created is False  # set fleet-wide too
    msg = refused(register, b, SPLIT_A, fingerprint="vllm-v1:2222")
    assert "model 'm' is already registered as another model of the same geometry by a server sharing the L3" in msg
    assert "fingerprint vllm-v1:1111 (new: vllm-v1:2222)" in msg
    # B registering without one gets the fleet's, and then refuses another on its own
    assert register(b, SPLIT_A).created
    assert kvd.describe_server(b.url, NAME, timeout=10).layout.fingerprint == "vllm-v1:1111"  # type: ignore[union-attr]
    hit, got = reads(b, tokens)
    assert hit == 2 * CHUNK and got is not None and torch.equal(got, kv)
    redis_server.stop()  # B's own registration refuses it as well, without the L3
    msg = refused(register, b, SPLIT_A, fingerprint="vllm-v1:3333")
    assert "fingerprint vllm-v1:1111 (new: vllm-v1:3333)" in msg


def test_two_servers_registering_the_same_model_with_a_fingerprint_agree(make_server, redis_server) -> None:
    a = make_server("--redis-url", redis_server.url, register=None)
    b = make_server("--redis-url", redis_server.url, register=None)
    assert register(a, SPLIT_A, fingerprint="x:1").created
    assert register(b, SPLIT_A, fingerprint="x:1").created
    assert register(b, SPLIT_A, fingerprint="").created is False
    msg = refused(register, a, SPLIT_B, fingerprint="x:1")  # the same fingerprint cannot change the shapes
    assert "different geometry" in msg


# ------------------------------------------------------------------ saving the registry


def test_a_registration_that_could_not_be_saved_is_saved_later(make_server, tmp_path: Path) -> None:
    """models.msgpack could not be written (here: a directory squats its temporary name, as a full
    disk would fail it): logged, then retried at the next registration and by the reaper. (In this
    process, its retries every 0.2 s instead of SAVE_RETRY_S; the server saves its registry only
    then, never at a stop, so the server started after the stop reads what a crash would leave.)"""
    disk = tmp_path / "l2"
    squat = disk / "models.msgpack.tmp"
    (squat / "x").mkdir(parents=True)
    srv = make_server("--disk-dir", str(disk), register=None)
    assert isinstance(srv, InProcessServer)

    def retry_soon() -> None:
        assert srv.state is not None
        srv.state.registry._file.retry_s = 0.2

    srv.call(retry_soon)
    assert register(srv, SPLIT_A).created
    assert not (disk / "models.msgpack").exists()
    assert "could not save model registrations" in srv.log()
    shutil.rmtree(squat)  # room again: the reaper's next retry saves it, no registration needed
    # (the log line comes just after the file is in place: CI once read the log in between)
    wait_for(
        lambda: (disk / "models.msgpack").exists() and "model registrations saved to" in srv.log(),
        "the registry saved by a retry, and logged",
        timeout=30,
    )
    (squat / "x").mkdir(parents=True)
    assert register(srv, SPLIT_A, name="second").created  # fails again ...
    shutil.rmtree(squat)
    assert register(srv, SPLIT_A, name="third").created  # ... and the next registration saves all
    assert srv.stop() == 0
    again = make_server("--disk-dir", str(disk), register=None)
    for name in (NAME, "second", "third"):
        assert kvd.describe_server(again.url, name, timeout=10).layout is not None, name


def test_a_context_never_follows_its_name_to_another_model_after_a_restart(make_server, tmp_path: Path) -> None:
    """A context registers again by itself after a server restart; if the name is another model's
    by then (same shapes, another fingerprint), it refuses instead of reading that model's KV."""
    srv = make_server(register=None)
    register(srv, SPLIT_A, fingerprint="x:first")
    tokens = make_tokens(2 * CHUNK, start=23)
    with kvd.connect(srv.url, srv.http_url, NAME, timeout=10) as ctx:
        assert kvd.store(ctx, kv_of(2 * CHUNK, 9), tokens)
        srv.stop()
        again = make_server(register=None, port=srv.port, http_port=srv.http_port)
        register(again, SPLIT_A, fingerprint="x:second")
        store(again, tokens, seed=10)  # the other model's KV under the same tokens
        with pytest.raises(KVCacheSDKError, match=r"restarted with another model under 'm': fingerprint x:second"):
            kvd.retrieve(ctx, tokens)
    with kvd.connect(again.url, again.http_url, NAME, timeout=10) as ctx:  # a new context is the new model's
        assert ctx.layout.fingerprint == "x:second"

"""Shared memory per tenant with a real server: a tenant with an L1 quota has a pool of its own
(a memfd handed over at the pool door for a ticket), its clients map that pool and no other, and
it holds that tenant's objects only; tickets open one pool once; other users get their pools too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, GEOMETRY, MODEL, assert_fast_reads_refused, make_kv, make_tokens, start_server
from kvdock.protocol import encode
from kvdock.protocol import messages as m
from kvdock.protocol.door import OpenPool, PoolOpened, decode_door_reply
from kvdock.shm import PoolSegment
from kvdock.shm.segment import proc_start_time
from kvdock.testing import ServerProcess
from kvdock.transport.client import ControlClient
from kvdock.transport.door import knock

ACME, BETA, GAMMA, ADMIN = "acme-token-0123456789", "beta-token-0123456789", "gamma-token-012345678", "admin-0123456789"
SLOT = 4096  # one chunk of the test model in its page


def serve(tmp_path: Path) -> ServerProcess:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[tenants.acme]
tokens = ["{ACME}"]
models = ["{MODEL}"]
salts = ["acme"]
l1 = {16 * SLOT}

[tenants.beta]
tokens = ["{BETA}"]
models = ["{MODEL}"]
salts = ["beta"]
l1 = {16 * SLOT}

[tenants.gamma]
tokens = ["{GAMMA}"]
models = ["{MODEL}"]
salts = ["gamma"]
"""
    )
    srv = start_server(tmp_path, "--tenants", str(path), "--admin-token", ADMIN, "--no-disk")
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=ADMIN)
    return srv


@pytest.fixture
def srv(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = serve(tmp_path)
    yield s
    assert s.stop() == 0, s.log()


def _kvdock_maps(pid: int) -> list[str]:
    """The kvdock shared memory process ``pid`` maps: memfd labels and /dev/shm names."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if "memfd:kvdock-" in path:
            out.add(path.split("memfd:", 1)[1].split()[0])
        elif path.startswith("/dev/shm/kvdock-"):
            out.add(path)
    return sorted(out)


def _slot_bytes(kv: torch.Tensor, chunk: int) -> bytes:
    return kv[:, :, chunk * CHUNK : (chunk + 1) * CHUNK].contiguous().view(torch.uint8).numpy().tobytes()


def test_each_quotad_tenant_maps_its_own_pool_which_holds_only_its_objects(srv: ServerProcess) -> None:
    tokens = make_tokens(3 * CHUNK)
    kv_a, kv_b, kv_g = (make_kv(3 * CHUNK, seed=s) for s in (1, 2, 3))
    # the server has no named segment at all: the shared rest is private memory, the tenants'
    # pools are memfds
    assert _kvdock_maps(srv.proc.pid) == [f"kvdock-{t}-{part}" for t in ("acme", "beta") for part in ("meta", "slots")]
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=BETA) as b,
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=GAMMA) as g,
    ):
        assert (a.transport, b.transport, g.transport) == ("shm", "shm", "inline")  # gamma: no quota, no pool
        assert kvd.store(a, kv_a, tokens, "acme") and kvd.store(b, kv_b, tokens, "beta")
        assert kvd.store(g, kv_g, tokens, "gamma")
        got_a, got_b = kvd.retrieve(a, tokens, "acme"), kvd.retrieve(b, tokens, "beta")
        assert got_a is not None and torch.equal(got_a, kv_a) and got_b is not None and torch.equal(got_b, kv_b)
        with kvd.view(a, tokens, "acme") as v:  # zero-copy, mapped read-only from acme's pool
            for i in range(3):
                assert torch.equal(v.chunk(i), kv_a[:, :, i * CHUNK : (i + 1) * CHUNK])
        # what each tenant's client maps holds its own tenant's KV and nobody else's
        seg_a = a._transfer.segment  # type: ignore[attr-defined]
        seg_b = b._transfer.segment  # type: ignore[attr-defined]
        pool_a, pool_b = bytes(seg_a.data), bytes(seg_b.data)
        for i in range(3):
            assert _slot_bytes(kv_a, i) in pool_a and _slot_bytes(kv_a, i) not in pool_b
            assert _slot_bytes(kv_b, i) in pool_b and _slot_bytes(kv_b, i) not in pool_a
            assert _slot_bytes(kv_g, i) not in pool_a and _slot_bytes(kv_g, i) not in pool_b
        assert seg_a.private and seg_b.private and seg_a.nonce != seg_b.nonce
        assert seg_a.meta.readonly and not seg_a.data.readonly  # its slots are the client's, nothing else
        assert kvd.check_server_integrity(a, ADMIN) == []


def test_a_client_process_maps_its_tenants_pool_and_nothing_else(srv: ServerProcess, tmp_path: Path) -> None:
    code = f"""
import sys
sys.path[:0] = {sys.path!r}
import torch
import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_tenant_pools import _kvdock_maps
import os
with kvd.connect({srv.url!r}, {srv.http_url!r}, MODEL, 10, token={ACME!r}) as a:
    kv = make_kv(2 * CHUNK, seed=9)
    assert kvd.store(a, kv, make_tokens(2 * CHUNK), "acme")
    assert torch.equal(kvd.retrieve(a, make_tokens(2 * CHUNK), "acme"), kv)
    print(a.transport, ",".join(_kvdock_maps(os.getpid())))
"""
    out = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["shm", "kvdock-acme-meta,kvdock-acme-slots"]


def _ticket(srv: ServerProcess, token: str, pid: int | None = None) -> m.Described:
    """Describe, as the handshake asks it: for this process (or ``pid``, started when it did)."""
    pid = os.getpid() if pid is None else pid
    client = ControlClient(srv.url, 10)
    try:
        desc = m.Describe(m.PROTOCOL_VERSION, MODEL, token, pid=pid, pid_start=proc_start_time(pid) or 0)
        reply: m.Described = client.call(desc).reply
        return reply
    finally:
        client.close()


def test_a_ticket_opens_its_own_tenants_pool_once(srv: ServerProcess) -> None:
    da, db, dg = _ticket(srv, ACME), _ticket(srv, BETA), _ticket(srv, GAMMA)
    assert da.pool_ticket and db.pool_ticket and da.pool_ticket != db.pool_ticket and da.pool_url == db.pool_url
    assert (dg.pool_url, dg.pool_ticket, da.shm_name) == ("", "", "")  # no pool for gamma; no name for anyone
    # a Describe that names no process (describe_server: information only), or one the server
    # cannot see, gets no ticket
    assert kvd.describe_server(srv.url, MODEL, 10, token=ACME).pool_ticket == ""
    assert _ticket(srv, ACME, pid=2**22 + 7).pool_ticket == ""

    def door(ticket: str) -> tuple[PoolOpened | m.Error, list[int]]:
        reply, fds = knock(da.pool_url, encode(OpenPool(m.PROTOCOL_VERSION, ticket)), 10)
        return decode_door_reply(reply), fds

    answer, fds = door(db.pool_ticket)
    assert isinstance(answer, PoolOpened) and len(fds) == 2
    beta_pool = PoolSegment.from_fds(*fds)
    try:
        for ticket in (db.pool_ticket, "0" * 32, ""):  # used, never issued
            answer, fds = door(ticket)
            assert isinstance(answer, m.Error) and answer.code == "unauthorized" and fds == []
        # acme holding beta's pool proves nothing to the server: acme's client stays inline
        client = ControlClient(srv.url, 10)
        try:
            reg = m.RegisterClient(
                m.PROTOCOL_VERSION, "x", MODEL, 0, beta_pool.nonce, pid=os.getpid(),
                pid_start=proc_start_time(os.getpid()) or 0, token=ACME,
            )  # fmt: skip
            reply = client.call(reg).reply
            assert isinstance(reply, m.ClientRegistered) and (reply.transport, reply.local_url) == ("inline", "")
            reg = m.RegisterClient(
                m.PROTOCOL_VERSION, "y", MODEL, 0, beta_pool.nonce, pid=os.getpid(),
                pid_start=proc_start_time(os.getpid()) or 0, token=BETA,
            )  # fmt: skip
            assert client.call(reg).reply.transport == "shm"  # beta's own proof is good
        finally:
            client.close()
    finally:
        beta_pool.close()


def test_a_ticket_is_its_own_process_s_only(srv: ServerProcess) -> None:
    """(review) A client that sent its ticket to a socket squatting on the door's path (another
    mount namespace) handed it to whoever listens there: a ticket now opens the pool only for the
    process Describe named, and the door checks who knocks."""
    da = _ticket(srv, ACME)
    code = f"""
import sys
sys.path[:0] = {sys.path!r}
from kvdock.protocol import encode
from kvdock.protocol import messages as m
from kvdock.protocol.door import OpenPool, decode_door_reply
from kvdock.transport.door import knock
reply, fds = knock({da.pool_url!r}, encode(OpenPool(m.PROTOCOL_VERSION, {da.pool_ticket!r})), 10)
print(len(fds), decode_door_reply(reply).code)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "unauthorized"]  # the thief gets nothing
    reply, fds = knock(da.pool_url, encode(OpenPool(m.PROTOCOL_VERSION, da.pool_ticket)), 10)
    assert isinstance(decode_door_reply(reply), PoolOpened) and len(fds) == 2  # its own process still can
    PoolSegment.from_fds(*fds).close()


def test_a_quota_under_a_page_or_no_fast_reads_change_what_a_tenant_gets(tmp_path: Path) -> None:
    """A tenant whose quota holds no slot is offered no pool (inline); with --no-fast-reads a
    tenant's shared-memory client reads no directory, so its FastReads reports are refused
    (review: they forged the server-wide counters)."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.acme]\ntokens = ["{ACME}"]\nmodels = ["{MODEL}"]\nsalts = ["acme"]\nl1 = {16 * SLOT}\n\n'
        f'[tenants.beta]\ntokens = ["{BETA}"]\nmodels = ["{MODEL}"]\nsalts = ["beta"]\nl1 = 4095\n'
    )
    srv = start_server(tmp_path, "--tenants", str(path), "--admin-token", ADMIN, "--no-disk", "--no-fast-reads")
    try:
        kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=ADMIN)
        assert _ticket(srv, BETA).pool_ticket == ""
        with (
            kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as a,
            kvd.connect(srv.url, srv.http_url, MODEL, 10, token=BETA) as b,
        ):
            assert (a.transport, b.transport) == ("shm", "inline")
            assert a._transfer.directory() is None  # type: ignore[attr-defined]
            assert_fast_reads_refused(srv, a.client_id)
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_tenant_running_as_another_user_gets_its_pool(srv: ServerProcess) -> None:
    """Tenants may be other users: the door hands them their pool (the local control socket is
    the server's own user's only, so their requests stay on zmq)."""
    code = f"""
import os, sys
sys.path[:0] = {sys.path!r}
import torch
import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
os.setgroups([]); os.setgid(65534); os.setuid(65534)
with kvd.connect({srv.url!r}, {srv.http_url!r}, MODEL, 10, token={ACME!r}) as a:
    kv = make_kv(2 * CHUNK, seed=4)
    assert kvd.store(a, kv, make_tokens(2 * CHUNK), "acme")
    got = kvd.retrieve(a, make_tokens(2 * CHUNK), "acme")
    print(os.getuid(), a.transport, a._conn.channel, torch.equal(got, kv))
"""
    out = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["65534", "shm", "zmq", "True"]
    with kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as a:
        got = kvd.retrieve(a, make_tokens(2 * CHUNK), "acme")
        assert got is not None and torch.equal(got, make_kv(2 * CHUNK, seed=4))


def _requests(srv: ServerProcess, op: str) -> float:
    return srv.metric(f'kvdock_requests_total{{op="{op}"}}', 0.0)


def test_a_tenants_pool_directory_lists_its_own_objects_and_answers_its_fast_reads(srv: ServerProcess) -> None:
    from kvdock.keys import namespace_digest

    tokens = make_tokens(3 * CHUNK)
    kv_a, kv_b, kv_a2 = make_kv(3 * CHUNK, seed=1), make_kv(3 * CHUNK, seed=2), make_kv(3 * CHUNK, seed=5)
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=BETA) as b,
    ):
        assert kvd.store(a, kv_a, tokens, "acme") and kvd.store(b, kv_b, tokens, "beta")
        for ctx, salt in ((a, "acme"), (b, "beta")):
            transfer = ctx._transfer  # type: ignore[attr-defined]
            seg, directory = transfer.segment, transfer.directory()
            assert directory is not None, "a same-user tenant client reads its pool's directory"
            entries = [e for i in range(directory.entries) if (e := directory.read(i)) is not None]
            assert len(entries) == 3  # its own three chunks, nobody else's
            assert {e.ns for e in entries} == {namespace_digest(MODEL, 0, salt)}
            assert all(seg.first <= e.offset < seg.first + seg.data_size for e in entries)
        before = (_requests(srv, "Lookup"), _requests(srv, "PrepareRetrieve"))
        assert kvd.lookup(a, tokens, "acme") == 3 * CHUNK
        got = kvd.retrieve(a, tokens, "acme")
        assert got is not None and torch.equal(got, kv_a)
        assert (_requests(srv, "Lookup"), _requests(srv, "PrepareRetrieve")) == before  # not asked
        # an overwrite is seen by the next fast read (the entry names the new version)
        assert kvd.store_chunks(a, kv_a2, tokens, "acme", overwrite=True).stored_chunks == 3
        got = kvd.retrieve(a, tokens, "acme")
        assert got is not None and torch.equal(got, kv_a2)
        got = kvd.retrieve(b, tokens, "beta")
        assert got is not None and torch.equal(got, kv_b)
        assert kvd.check_server_integrity(a, ADMIN) == []
    deadline = time.monotonic() + 10
    while srv.metric('kvdock_fast_reads_total{op="retrieve"}', 0.0) < 3:  # reported at close
        assert time.monotonic() < deadline, "the fast reads were never reported"
        time.sleep(0.02)


def test_fast_reads_refuse_another_tenants_salt_as_the_server_does(srv: ServerProcess, tmp_path: Path) -> None:
    """Issue 29 (5): a tenant's shared-memory client of a server without L2/L3 (a complete pool
    directory, where an absent key is a final miss) read another tenant's salt as a miss (0,
    None) from its directory, where the server refuses it: the tenant policy must hold, and every
    answer must be the same whether fast reads are on or off. The directory answers a salt only
    once the server accepted it from this registration (its first read asks the server)."""
    tokens = make_tokens(2 * CHUNK, start=4000)
    kv_a, kv_b = make_kv(2 * CHUNK, seed=11), make_kv(2 * CHUNK, seed=12)
    bundle = tmp_path / "x.kvb"
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, 10, token=BETA) as b,
    ):
        assert kvd.store(b, kv_b, tokens, "beta") and kvd.store(a, kv_a, tokens, "acme")
        directory = a._transfer.directory()  # type: ignore[attr-defined]
        assert directory is not None and directory.complete  # no lower tier: a miss there is final
        calls = {
            "lookup": lambda salt: kvd.lookup(a, tokens, salt),
            "retrieve": lambda salt: kvd.retrieve(a, tokens, salt),
            "retrieve out=": lambda salt: kvd.retrieve(a, tokens, salt, out=torch.zeros_like(kv_a)),
            "retrieve layers=": lambda salt: kvd.retrieve(a, tokens, salt, layers=range(1), start=CHUNK),
            "lookup_many": lambda salt: kvd.lookup_many(a, [tokens, tokens], ["acme", salt]),
            "retrieve_many": lambda salt: kvd.retrieve_many(a, [tokens], salt),
            "export_bundle": lambda salt: kvd.export_bundle(a, tokens, bundle, salt),
        }
        refusals: dict[bool, dict[tuple[str, str], str]] = {True: {}, False: {}}
        for fast in (True, False):
            a.fast_reads = fast
            for name, call in calls.items():
                for salt in ("beta", "gamma", "", "nobody"):  # another tenant's (stored or not), the default, none's
                    with pytest.raises(kvd.PermissionDeniedError) as e:
                        call(salt)
                    refusals[fast][(name, salt)] = str(e.value)
        assert refusals[True] == refusals[False]
        assert refusals[True][("lookup", "beta")].endswith("cache_salt 'beta' is not a namespace of tenant 'acme'")
        assert not bundle.exists()
        a.fast_reads = True
        before = (_requests(srv, "Lookup"), _requests(srv, "PrepareRetrieve"))
        assert kvd.lookup(a, tokens, "acme") == 2 * CHUNK  # its own salt, which the server accepted: no round trip
        assert torch.equal(kvd.retrieve(a, tokens, "acme"), kv_a)  # type: ignore[arg-type]
        assert (_requests(srv, "Lookup"), _requests(srv, "PrepareRetrieve")) == before
    with kvd.connect(srv.url, srv.http_url, MODEL, 10, token=ACME) as fresh:  # a new registration
        assert fresh._transfer.directory() is not None  # type: ignore[attr-defined]
        lookups = _requests(srv, "Lookup")
        assert kvd.lookup(fresh, tokens, "acme") == 2 * CHUNK  # asks the server: is "acme" ours?
        assert _requests(srv, "Lookup") == lookups + 1
        assert kvd.lookup(fresh, tokens, "acme") == 2 * CHUNK  # it was: from the directory now
        assert torch.equal(kvd.retrieve(fresh, tokens, "acme"), kv_a)  # type: ignore[arg-type]
        assert (_requests(srv, "Lookup"), _requests(srv, "PrepareRetrieve")) == (lookups + 1, before[1])
        with pytest.raises(kvd.PermissionDeniedError, match="is not a namespace of tenant 'acme'"):
            kvd.lookup(fresh, tokens, "beta")

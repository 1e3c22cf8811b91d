"""CURVE with a real server (``--curve-secret-key``, ``--curve-authorized-dir``): authorized SDK
clients, engines and CLI commands work over both transports and get every byte back; a client
without an authorized key, with the wrong server key or without CURVE is refused with a clear
error and reaches nothing; KV events reach authorized subscribers only; CURVE lets the server
bind a non-loopback address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.cli.test_cli import kvdock  # kvdock ARGS in this process, output captured

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, GEOMETRY, MODEL, InProcessServer, free_port, make_kv, make_tokens, start_inprocess
from kvdock.errors import PermissionDeniedError
from kvdock.transport import curve
from kvdock.transport.events import EventSubscriber


class Keys:
    """A server keypair, two authorized clients and a stranger, as ``kvdock keygen`` writes them
    (the command run in this process: tests/cli/test_cli.py's ``kvdock``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.authorized = root / "authorized"
        self.authorized.mkdir(parents=True)
        for name in ("server", "alice", "bob", "stranger"):
            r = kvdock("keygen", str(root), "--name", name)
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout) == {
                "public": str(root / f"{name}.key"),
                "secret": str(root / f"{name}.key_secret"),
            }
        for name in ("alice", "bob"):
            (self.authorized / f"{name}.key").write_bytes((root / f"{name}.key").read_bytes())

    def server_flags(self) -> tuple[str, ...]:
        return (
            "--curve-secret-key",
            str(self.root / "server.key_secret"),
            "--curve-authorized-dir",
            str(self.authorized),
        )

    def client(self, name: str, server: str = "server") -> dict[str, str]:
        return {"server_key": str(self.root / f"{server}.key"), "client_key": str(self.root / f"{name}.key_secret")}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """One set of keys for the module (the tests only read them)."""
    return Keys(tmp_path_factory.mktemp("curve") / "keys")


def _curve_server(tmp_path: Path, keys: Keys, *extra: str) -> InProcessServer:
    """A CURVE server in this process (the keys are flags: no process boundary needed)."""
    srv = start_inprocess(tmp_path, *keys.server_flags(), *extra, chunk_size=CHUNK)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, **keys.client("alice"))
    return srv


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_authorized_clients_store_and_retrieve_every_byte(tmp_path: Path, keys: Keys, transport: str) -> None:
    srv = _curve_server(tmp_path, keys, *(["--no-shm"] if transport == "inline" else []))
    try:
        kv, tokens = make_kv(4 * CHUNK, seed=3), make_tokens(4 * CHUNK)
        with kvd.connect(srv.url, srv.http_url, MODEL, 10, **keys.client("alice")) as a:
            assert a.transport == transport
            assert kvd.store(a, kv, tokens)
        with kvd.connect(srv.url, srv.http_url, MODEL, 10, **keys.client("bob")) as b:
            got = kvd.retrieve(b, tokens)
            assert got is not None and torch.equal(got, kv)
        assert "CURVE, 2 client key(s)" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(
    "who, message",
    [
        ("stranger", "refused this client's CURVE key"),
        ("wrong-server-key", "handshake failed"),
        ("no-keys", "handshake failed"),
    ],
)
def test_a_client_without_the_right_keys_is_refused_and_reaches_nothing(
    tmp_path: Path, keys: Keys, who: str, message: str
) -> None:
    srv = _curve_server(tmp_path, keys)
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, 10, **keys.client("alice")) as a:
            kvd.store(a, make_kv(2 * CHUNK), make_tokens(2 * CHUNK))
        requests = srv.metric('kvdock_requests_total{op="Lookup"}', 0)
        settings = {"stranger": keys.client("stranger"), "wrong-server-key": keys.client("alice", server="bob")}
        start = time.monotonic()
        with pytest.raises(PermissionDeniedError, match=message):
            kvd.connect(srv.url, srv.http_url, MODEL, 30, **settings.get(who, {}))
        assert time.monotonic() - start < 10  # at once, not after the 30 s timeout
        with pytest.raises(PermissionDeniedError, match=message):  # nor can it register a model
            kvd.register_model(
                srv.url, srv.http_url, "other", dtype="bfloat16", **GEOMETRY, timeout=30, **settings.get(who, {})
            )
        assert srv.metric('kvdock_requests_total{op="Lookup"}', 0) == requests
        assert srv.metric('kvdock_requests_total{op="RegisterModel"}') == 1  # alice's only
        assert "other" not in json.dumps(srv.get("/status")["cache_context_meta"])
        if who == "stranger":
            assert "refused a CURVE client whose key" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_keys_from_the_environment_and_the_cli(tmp_path: Path, keys: Keys) -> None:
    srv = _curve_server(tmp_path, keys)
    try:
        kv, tokens = make_kv(2 * CHUNK, seed=5), make_tokens(2 * CHUNK, start=7)
        env = {
            **os.environ,
            curve.SERVER_KEY_ENV: str(keys.root / "server.key"),
            curve.CLIENT_KEY_ENV: str(keys.root / "bob.key_secret"),
        }
        code = (
            "import sys, torch, kvdock.sdk as kvd\n"
            "kv = torch.load(sys.argv[3], weights_only=True)\n"
            "with kvd.connect(sys.argv[1], sys.argv[2], 'tiny', 10) as c:\n"
            f"    assert kvd.store(c, kv, list(range(7, 7 + {2 * CHUNK})))\n"
        )
        torch.save(kv, tmp_path / "kv.pt")
        r = zygote.run(
            [sys.executable, "-c", code, srv.url, srv.http_url, str(tmp_path / "kv.pt")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        cli = [
            sys.executable,
            "-m",
            "kvdock.cli.main",
            "lookup",
            "--url",
            srv.url,
            "--http-url",
            srv.http_url,
            "--model",
            MODEL,
        ]
        flags = ["--server-key", str(keys.root / "server.key"), "--client-key", str(keys.root / "alice.key_secret")]
        ids = ",".join(map(str, tokens))
        r = subprocess.run([*cli, *flags, ids], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"hit_tokens": 2 * CHUNK, "tokens": 2 * CHUNK}
        r = subprocess.run([*cli, ids], capture_output=True, text=True, timeout=60)  # no keys
        assert r.returncode == 2 and "handshake failed" in r.stderr
    finally:
        assert srv.stop() == 0, srv.log()


def test_kv_events_reach_authorized_subscribers_only(tmp_path: Path, keys: Keys) -> None:
    events_port = free_port()
    srv = _curve_server(tmp_path, keys, "--kv-events-port", str(events_port))
    url = f"tcp://127.0.0.1:{events_port}"
    alice = EventSubscriber(url, curve.ClientCurve.load(keys.root / "server.key", keys.root / "alice.key_secret"))
    stranger = EventSubscriber(url, curve.ClientCurve.load(keys.root / "server.key", keys.root / "stranger.key_secret"))
    plain = EventSubscriber(url)
    try:
        time.sleep(0.5)  # (subscriptions travel after the handshake: a PUB drops what comes first)
        with kvd.connect(srv.url, srv.http_url, MODEL, 10, **keys.client("alice")) as a:
            kvd.store(a, make_kv(CHUNK), make_tokens(CHUNK))
        got = alice.receive(10)
        assert got is not None and any(type(e).__name__ == "ChunkStored" for e in got[1].events)
        assert stranger.receive(1) is None and plain.receive(0.2) is None
    finally:
        for s in (alice, stranger, plain):
            s.close()
        assert srv.stop() == 0, srv.log()


def _own_address() -> str | None:
    """A non-loopback address of this host (None if it has none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # (no packet is sent)
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_curve_lets_the_server_bind_a_non_loopback_address(tmp_path: Path, keys: Keys) -> None:
    import socket

    srv = _curve_server(tmp_path, keys, "--host", "0.0.0.0")
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, 10, **keys.client("alice")) as a:
            kvd.store(a, make_kv(CHUNK), make_tokens(CHUNK))
            assert kvd.lookup(a, make_tokens(CHUNK)) == CHUNK
        assert f"http http://127.0.0.1:{srv.http_port}" in srv.log()  # (review) plain HTTP stays local
        addr = _own_address()
        if addr is not None:  # zmq answers on the host's address, HTTP does not
            with kvd.connect(f"tcp://{addr}:{srv.port}", srv.http_url, MODEL, 10, **keys.client("bob")) as b:
                assert kvd.lookup(b, make_tokens(CHUNK)) == CHUNK
            with pytest.raises(OSError):
                socket.create_connection((addr, srv.http_port), timeout=5).close()
    finally:
        assert srv.stop() == 0, srv.log()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdock.cli.main",
            "serve",
            "--host",
            "0.0.0.0",
            "--curve-authorized-dir",
            str(keys.authorized),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "curve_authorized_dir needs curve_secret_key" in r.stderr

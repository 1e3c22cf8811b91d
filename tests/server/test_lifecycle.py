"""Start-up and shutdown: the shared-memory segment is private, unlinked on SIGINT/SIGTERM, and a
dead server's segment is cleaned up by the next start."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, free_ports, start_server
from kvdock.shm.directory import entries_for
from kvdock.shm.segment import _V1, HEADER_SIZE, MAGIC, PREFIX, directory_bytes, table_bytes

SHM = Path("/dev/shm")


def segments_created_by(pid: int) -> set[str]:
    """kvdock segments in /dev/shm whose header names ``pid`` as their creator (other servers'
    segments -- other tests may run in parallel -- do not count). Reads each segment's header
    only: it once read whole segments, and another process's pool of 9 GiB in /dev/shm got the
    test process killed for running out of memory."""
    found = set()
    for name in os.listdir(SHM):
        if not name.startswith(PREFIX):
            continue
        try:
            with open(SHM / name, "rb") as f:
                head = f.read(_V1.size)
        except OSError:
            continue  # removed meanwhile
        if len(head) == _V1.size and _V1.unpack(head)[0] == MAGIC and _V1.unpack(head)[2] == pid:
            found.add(name)
    return found


def test_segments_created_by_reads_headers_only(tmp_path) -> None:
    """segments_created_by once read every kvdock segment in /dev/shm whole: another process's 9 GiB
    pool took the test process past the machine's memory. A 256 MiB segment (sparse: no memory
    until read) naming a pid of its own is found, and reading it costs no more than its header."""
    import secrets
    import tracemalloc

    name = f"{PREFIX}{secrets.token_hex(16)}"
    fake_pid = 2**31 - 7  # above pid_max: no real server's
    with open(SHM / name, "wb") as f:
        f.write(_V1.pack(MAGIC, 1, fake_pid, 0, bytes(32), 0))
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        found = segments_created_by(fake_pid)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        (SHM / name).unlink()
    assert found == {name}
    assert peak < 1 << 20, peak


def _segment(srv) -> Path:
    name = srv.get("/config")["l1"]["shm_name"]
    assert name.startswith("kvdock-") and len(name) == len("kvdock-") + 32
    return SHM / name


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_segment_is_private_prefaulted_and_unlinked_on_signal(tmp_path, sig) -> None:
    srv = start_server(tmp_path, l1_size="32MiB")
    try:
        path = _segment(srv)
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        # header, generations, directory, slots
        size = HEADER_SIZE + table_bytes(32 * 2**20) + directory_bytes(entries_for(32 * 2**20)) + 32 * 2**20
        assert st.st_size == size
        assert st.st_blocks * 512 >= st.st_size  # allocated up front, not sparse
    finally:
        code = srv.stop(sig)  # (a failed check above must not leave the server running)
    assert code == 0
    assert not path.exists()
    assert "shutting down" in srv.log()


def test_stale_segment_of_killed_server_is_removed_at_next_start(tmp_path) -> None:
    dead = start_server(tmp_path, l1_size="8MiB")
    path = _segment(dead)
    dead.stop(signal.SIGKILL)
    assert path.exists()
    srv = start_server(tmp_path, l1_size="8MiB")
    try:
        assert not path.exists()
        # under xdist another worker's server may start in between and be the one that removes it
        # (and logs it); when this one did, it says so
        mentions = [line for line in srv.log().splitlines() if path.name in line]
        assert all("stale shared-memory segment(s) of dead servers: " in line for line in mentions)
    finally:
        srv.stop()


def test_live_servers_segments_are_left_alone(tmp_path) -> None:
    a = start_server(tmp_path, l1_size="8MiB")
    b = start_server(tmp_path, l1_size="8MiB")
    try:
        assert _segment(a).exists() and _segment(b).exists() and _segment(a) != _segment(b)
    finally:
        a.stop()
        b.stop()


def test_busy_port_fails_cleanly_without_leaking_memory(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdock.cli.main",
                "serve",
                "--l1-size",
                "8MiB",
                "--port",
                str(free_port()),
                "--http-port",
                str(busy),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "address already in use" in err
    assert segments_created_by(proc.pid) == set()


def test_no_shm_server_shares_no_memory(tmp_path) -> None:
    srv = start_server(tmp_path, "--no-shm", l1_size="8MiB")
    try:
        cfg = srv.get("/config")
        assert cfg["transports"] == ["inline"]
        assert cfg["l1"] == {"shm_enabled": False, "shm_name": None, "size_bytes": 8 * 2**20}
        assert segments_created_by(srv.proc.pid) == set()
    finally:
        srv.stop()


def test_default_l1_size_is_printed(tmp_path) -> None:
    port, http_port = free_ports(2)
    env = {**os.environ, "KVDOCK_L1_SIZE": "0"}
    p = subprocess.Popen(
        [sys.executable, "-m", "kvdock.cli.main", "serve", "--port", str(port), "--http-port", str(http_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert p.stdout is not None
        lines: list[str] = []
        while not lines or "L1 size:" not in lines[-1]:  # a stale-segment note may come first
            lines.append(p.stdout.readline())
            assert lines[-1], f"server exited: {lines}"
        assert "auto: 25% of available memory" in lines[-1], lines
    finally:
        # at once: no need to wait while it pre-faults a quarter of the machine's memory (an
        # interrupted start unwinds and exits 130, as after Ctrl-C)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) in (0, 130)


def test_a_control_port_in_use_is_a_clear_error(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=r"exited with 2:[\s\S]*cannot listen on tcp://127.0.0.1:\d+: Address already in use"
        ):
            start_server(tmp_path, port=port)


def _local_path(srv) -> str:  # type: ignore[no-untyped-def]
    line = next(line for line in srv.log().splitlines() if "kvdock serving" in line)
    return line.split("unix://")[1].split(",")[0]


def test_the_local_socket_is_private_and_removed_at_exit(tmp_path) -> None:
    srv = start_server(tmp_path)
    path = Path(_local_path(srv))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert srv.stop() == 0
    assert not path.parent.exists()


def test_a_shutdown_while_clients_keep_asking_logs_no_traceback(tmp_path) -> None:
    import threading

    import kvdock.sdk as kvd
    from helpers import GEOMETRY, MODEL

    srv = start_server(tmp_path)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", timeout=10, **GEOMETRY)
    stop = threading.Event()
    done: list[str] = []
    asked = [0, 0, 0]

    def ask(i: int, channel: str) -> None:
        # (a call that finds the server gone fails within the timeout: 1 s)
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=1) as c:
            if channel == "zmq":
                c._conn.use_local("")
            n = 0
            while not stop.is_set():
                try:
                    kvd.lookup(c, list(range(64)))
                    n += 1
                    asked[i] = n
                except kvd.KVCacheSDKError:
                    break
            done.append(f"{channel}:{n}")

    threads = [threading.Thread(target=ask, args=(i, ch)) for i, ch in enumerate(("local", "zmq", "local"))]
    for t in threads:
        t.start()
    import time

    deadline = time.monotonic() + 30
    while min(asked) < 20:  # every client keeps asking
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), (asked, done)
        time.sleep(0.01)
    assert srv.stop() == 0
    stop.set()
    for t in threads:
        t.join(30)
    assert len(done) == 3 and all(int(d.split(":")[1]) > 0 for d in done), done
    log = srv.log()
    assert "shutting down" in log
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]


def test_a_socket_path_too_long_leaves_the_server_on_zmq_with_a_warning(tmp_path) -> None:
    import kvdock.sdk as kvd
    from helpers import GEOMETRY, MODEL

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    srv = start_server(tmp_path, env={"TMPDIR": str(deep)})
    try:
        assert "no local control socket" in srv.log() and "unix://" not in srv.log()
        kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", timeout=10, **GEOMETRY)
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            assert c.transport == "shm" and c._conn.channel == "zmq"
            assert kvd.lookup(c, list(range(64))) == 0
        assert list(deep.iterdir()) == []  # nothing left behind
    finally:
        assert srv.stop() == 0


def test_a_local_message_over_the_request_cap_drops_its_connection(tmp_path) -> None:
    from kvdock.config import MAX_BATCH, MAX_SALT_LEN
    from kvdock.transport.local import HEAD

    srv = start_server(tmp_path, "--max-request-tokens", "1000")
    cap = 4 * 1000 + MAX_BATCH * (4 * MAX_SALT_LEN + 128) + (1 << 20)  # token ids, a batch's salts
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(_local_path(srv))
        s.sendall(HEAD.pack(cap + 1, 2))
        s.settimeout(10)
        assert s.recv(100) == b""
        assert f"dropped: not a message: body of {cap + 1} bytes, 2 frames (at most {cap} bytes)" in srv.log()
        assert srv.text("/healthz")
    finally:
        assert srv.stop() == 0


def test_a_killed_servers_socket_directory_is_removed_at_the_next_start(tmp_path) -> None:
    import tempfile

    dead = start_server(tmp_path)
    path = Path(_local_path(dead))
    dead.stop(signal.SIGKILL)
    assert path.exists()  # nobody removed it
    other = Path(tempfile.mkdtemp(prefix="kvdock-"))  # not a socket directory: left alone
    try:
        srv = start_server(tmp_path)
        assert not path.parent.exists() and other.exists()
        assert Path(_local_path(srv)).exists()  # a live server's own is kept
        assert srv.stop() == 0
    finally:
        other.rmdir()


def test_the_server_raises_its_descriptor_limit(tmp_path) -> None:
    import resource

    srv = start_server(tmp_path)
    try:
        line = next(x for x in Path(f"/proc/{srv.proc.pid}/limits").read_text().splitlines() if "open files" in x)
        soft, hard = line.split()[3:5]
        expected = 1 << 16 if hard == "unlimited" else min(int(hard), 1 << 16)
        assert int(soft) >= min(expected, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        assert int(soft) >= 4096 or int(soft) == int(hard)
    finally:
        assert srv.stop() == 0

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cpu_table
import kvdock.sdk as kvd
from helpers import (
    CHUNK,
    GEOMETRY,
    L1_SIZE,
    MODEL,
    AnyServer,
    InProcessServer,
    RedisProc,
    free_port,
    needs_process,
    running,
    serving,
    start_inprocess,
    start_server,
)
from kvdock.testing import SERVER_KINDS, RedisCluster, cluster_ports, server_binary

# tests/integrations/vllm needs vLLM, which lives in its own virtual environment (.ci/run makes it and runs
# them there; README "Tests"); a python without vLLM collects everything else.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# tests/integrations/sglang likewise needs SGLang (scripts/sglang-venv; .ci/run runs them there)
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
collect_ignore = ([] if HAVE_VLLM else ["integrations/vllm"]) + ([] if HAVE_SGLANG else ["integrations/sglang"])


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [
        "vLLM: installed, tests/integrations/vllm collected"
        if HAVE_VLLM
        else "vLLM: not installed here, tests/integrations/vllm not collected (.ci/run runs them in their own venv)"
    ]
    if not HAVE_SGLANG:
        lines.append("SGLang: not installed here, tests/integrations/sglang not collected (.ci/run: its own venv)")
    for kind in SERVER_KINDS:
        try:
            lines.append(f"L3 server {kind}: {server_binary(kind)}")
        except RuntimeError as e:  # the tests that need it fail (their fixture raises the same), never skip
            lines.append(f"L3 server {kind}: MISSING, its tests will fail: {e}")
    return lines


def pytest_configure(config: pytest.Config) -> None:
    cpu_table.register(config)  # KVDOCK_TEST_CPU=DIR: a table of each test's CPU (tests/cpu_table.py)
    config.addinivalue_line(
        "markers",
        "subprocess_server: make_server / server start a `kvdock serve` process for this test, not an in-process "
        "server (signals, kills, restarts, the process's own memory, descriptors or environment)",
    )
    config.addinivalue_line(
        "markers",
        "valkey: run the test once per L3 server, redis-server and valkey-server (ids [redis], [valkey]): "
        "its redis_server / redis_cluster fixtures (and l3_server) follow the parameter",
    )


# Tests whose make_server / server must be a `kvdock serve` process (marked subprocess_server
# here, to keep the test files as they are; a new test may carry the marker itself): node id
# under tests/, without parameters -> what needs the process boundary
PROCESS_TESTS: dict[str, str] = {
    "sdk/test_connection.py::test_a_server_killed_while_a_call_waits_fails_it_at_once_not_at_the_timeout": "SIGKILL",
    "sdk/test_fastpath.py::test_a_restarted_server_is_never_read_through_the_old_pool": "SIGKILL, restart",
    "sdk/test_fastpath.py::test_a_stopped_server_still_answers_from_its_directory": "SIGSTOP",
    "sdk/test_fastpath.py::test_only_the_process_that_made_the_pool_is_watched": "the pool creator's pid",
    "sdk/test_fastpath.py::test_a_killed_server_hangs_up_the_watch_at_once": "SIGKILL",
    "sdk/test_fastpath.py::test_a_report_never_cuts_the_local_channel_nor_waits_for_a_server_that_does_not_read": (
        "SIGSTOP"
    ),
    "sdk/test_fastpath.py::test_a_fast_read_spanning_a_server_restart_never_returns_the_replaced_version": "SIGKILL",
    "server/test_model_identity.py::test_a_lost_registry_never_serves_the_old_split_from_l2": "SIGKILL, restart",
    "server/test_robustness.py::test_a_frame_larger_than_any_request_is_not_buffered": "the server's peak RSS",
    "server/test_shutdown_drain.py::test_a_second_signal_aborts_the_drain_and_the_log_says_how_many_were_dropped": (
        "two signals"
    ),
    "server/test_tiered_server.py::test_disk_survives_sigkill_and_restart": "SIGKILL, restart",
    "server/test_tiered_server.py::test_corrupted_and_torn_files_are_detected_never_returned": "SIGKILL, restart",
    "server/test_tiered_server.py::test_lookup_prefetch_and_status_ops": "SIGKILL, restart",
    "server/test_tiered_server.py::test_running_out_of_file_descriptors_never_deletes_good_l2_files": (
        "the server's descriptor limit"
    ),
    "server/test_tiered_server.py::test_redis_going_away_degrades_to_l1_l2_and_comes_back": (
        "counts lines of one server's log while another runs (in one process their logs mix)"
    ),
    # timing-sensitive with an L3 (the coherence bound, failovers): they passed in process alone but
    # failed once each on a machine loaded 8x, where the server shares the test's GIL
    "server/test_overwrite.py::test_overwrite_is_refused_while_redis_is_down": "timing under load",
    "server/test_server_batch.py::test_locate_names_every_tier_holding_a_chunk": "timing under load",
    "server/test_cluster_server.py::test_the_whole_cluster_down_and_back": "timing under load",
    "fleet/test_fleet_coherence.py::test_a_server_restarted_on_its_l2_replays_the_overwrites_it_missed": (
        "timing under load"
    ),
    "fleet/test_fleet_coherence.py::test_an_overwrite_through_one_server_is_served_by_the_others_within_the_bound": (
        "timing: three servers (in process under coverage one applied 1 entry, not 2)"
    ),
    "integrations/vllm/": "vLLM's own venv: not measured in process",
}


# The longest tests (node id under tests/ without parameters, longest first; each takes >= ~10 s
# on 2 cores, mostly waiting: soaks, faults' delays, drains): under pytest-xdist each worker
# starts with its share of them (_longest_first), so none is left to run alone at the end
LONGEST: tuple[str, ...] = (
    "fleet/test_adversarial_r9_cluster.py::test_keeping_on_a_cluster_under_lru_evictions_a_master_failover_and_sigstop",
    "server/test_shutdown_drain.py::test_sigterm_writes_down_a_backlog_of_over_30_s_before_exit",
    "fleet/test_adversarial_r8_fleet.py::test_concurrent_overwrites_of_one_prefix_through_three_servers_with_sigstop_and_sigkill",
    "fleet/test_adversarial_r9_soak.py::test_keeping_under_real_lru_evictions_sigstop_past_the_lease_sigkill_and_flushall",
    "fleet/test_fleet_keep.py::test_an_overwrite_written_down_past_its_floors_ttl_never_lets_a_plain_store_elsewhere_make_a_second_truth",
    "server/test_overwrite.py::test_crash_consistency_under_concurrent_overwrites",
    "fleet/test_adversarial_r8_fleet.py::test_a_server_started_during_a_slow_overwrite_does_not_keep_a_plain_store_it_replaces",
    "integrations/test_examples.py::test_examples_with_a_local_model_directory",
    "fleet/test_adversarial_r8_fleet.py::test_concurrent_overwrites_while_redis_is_flushed_killed_and_restarted_empty",
    "integrations/test_examples.py::test_kv_edit_e2e",
    "server/test_overwrite.py::test_an_acknowledged_overwrite_survives_sigkill_never_stale",
    "fleet/test_adversarial_r8_fleet.py::test_an_overwrite_committed_past_recent_ms_after_its_entries_is_refused",
    "server/test_cluster_server.py::test_a_master_killed_under_load_costs_no_errors_no_wrong_bytes_and_l3_comes_back",
    "fleet/test_adversarial_r8_fleet.py::test_garbage_on_the_control_socket_while_overwrites_run_through_two_servers",
    "server/test_retrieval.py::test_a_batch_reply_buffer_is_not_reused_while_a_paused_client_has_not_read_it",
    "server/test_adversarial_r3.py::test_an_overwrite_under_write_pressure_answers_within_a_bound",
    "fleet/test_fleet_keep.py::test_an_overwrites_value_evicted_from_l3_is_kept_by_its_holders_until_they_drop_it",
    "fleet/test_adversarial_r9_fleet.py::test_a_server_with_a_slow_l2_serves_an_overwritten_key_from_l3_soon_after_the_overwrites_stop",
    "fleet/test_adversarial_r9_fleet.py::test_a_server_keeps_serving_its_l1_while_another_applications_keys_make_redis_evict",
    "server/test_sessions.py::test_store_never_claims_dedup_for_chunks_another_client_is_writing",
    "sdk/test_concurrency.py::test_server_restart_while_threads_copy_never_crashes",
    "fleet/test_adversarial_r8_fleet.py::test_a_plain_store_after_l3_was_flushed_during_a_slow_overwrite_is_not_kept_against_it",
)


def _longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n W``), reorder ``items`` so that each worker's first block starts
    with its share of LONGEST (round robin, longest first). xdist's worksteal and load schedulers
    hand the workers contiguous blocks of the collection at the start (block i: what is left //
    the workers left) and steal from a block's end: the long tests start at once, side by side,
    and the short ones fill in. Only the order changes (every worker computes the same one)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers < 2:
        return
    rank = {name: i for i, name in enumerate(LONGEST)}

    def key(item: pytest.Item) -> str:
        return item.nodeid.split("[", 1)[0].removeprefix("tests/")

    slow = sorted((it for it in items if key(it) in rank), key=lambda it: rank[key(it)])
    rest = [it for it in items if key(it) not in rank]
    if not slow or not rest:
        return
    heads = [slow[i::workers] for i in range(workers)]
    order: list[pytest.Item] = []
    left = len(items)
    for i in range(workers):
        size = left // (workers - i)
        left -= size
        fill = max(size - len(heads[i]), 0)
        order += heads[i] + rest[:fill]
        del rest[:fill]
    items[:] = order + rest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.nodeid.split("[", 1)[0].removeprefix("tests/")
        if name in PROCESS_TESTS or any(name.startswith(d) for d in PROCESS_TESTS if d.endswith("/")):
            item.add_marker(pytest.mark.subprocess_server)
    _longest_first(config, items)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``valkey`` that uses the L3 (``l3_server``, through ``redis_server`` /
    ``redis_cluster`` or by itself) runs on each of SERVER_KINDS; the others keep Redis only."""
    if "l3_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("valkey") is not None:
        metafunc.parametrize("l3_server", SERVER_KINDS, indirect=True)


@pytest.fixture
def l3_server(request: pytest.FixtureRequest) -> str:
    """Which server the test's L3 runs on (kvdock.testing.server_binary's ``kind``): "redis", or
    each of SERVER_KINDS in turn for a test marked ``valkey``."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers started without --disk-dir use $XDG_CACHE_HOME: keep the tests' L2 out of ~/.cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture
def make_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., AnyServer]]:
    """Factory: start a server (extra CLI flags as args), stopped and checked at teardown. In
    this process (kvdock.inprocess: real sockets and shared memory, a tenth of the start-up)
    unless the test is marked ``subprocess_server`` or ``env`` names more than faults
    (helpers.needs_process); KVDOCK_TEST_SUBPROCESS=1 starts every one as a process."""
    started: list[AnyServer] = []
    process = request.node.get_closest_marker("subprocess_server") is not None

    def make(
        *extra: str,
        l1_size: str = L1_SIZE,
        register: str | None = "bfloat16",
        env: dict[str, str] | None = None,
        **kw: object,
    ) -> AnyServer:
        srv: AnyServer
        if process or needs_process(env):
            srv = start_server(tmp_path, *extra, l1_size=l1_size, chunk_size=CHUNK, env=env, **kw)  # type: ignore[arg-type]
        else:
            srv = start_inprocess(tmp_path, *extra, l1_size=l1_size, chunk_size=CHUNK, env=env, **kw)  # type: ignore[arg-type]
        started.append(srv)
        if register:
            kvd.register_model(srv.url, srv.http_url, MODEL, dtype=register, **GEOMETRY, timeout=10)
        return srv

    yield make
    for srv in started:
        if running(srv):
            if isinstance(srv, InProcessServer):
                # (still writing down a slow disk's backlog: the rest is dropped after 0.5 s, as a
                # second SIGTERM would; test_shutdown_drain tests the drain itself)
                srv.stop(timeout=0.5)
            assert srv.stop() == 0, srv.log()


@pytest.fixture
def server(make_server: Callable[..., AnyServer]) -> AnyServer:
    """A fresh server: an L1_SIZE pool, chunk_size 16, model MODEL registered in bfloat16."""
    return make_server()


@pytest.fixture
def ctx(server: AnyServer) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        yield c


@pytest.fixture
def redis_server(l3_server: str) -> Iterator[RedisProc]:
    """A real redis-server (valkey-server for ``l3_server`` "valkey") on a free loopback port,
    killed at teardown (restartable)."""
    r = RedisProc(free_port(), server=l3_server).start()
    yield r
    r.stop()


@pytest.fixture(scope="module", params=["shm", "inline"])
def transport_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AnyServer]:
    """One server per transport for a whole test module (MODEL registered): its tests store under
    tokens of their own."""
    with serving(tmp_path_factory.mktemp("server"), request.param) as srv:
        yield srv


class _Spare:
    """A Redis Cluster made in a thread of its own while the test before runs (RedisCluster.start:
    its nodes need about two seconds to agree), for the next test that asks for one."""

    def __init__(self, make: Callable[[], RedisCluster]) -> None:
        self.cluster = make()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="spare-redis-cluster", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.cluster.start()
        except BaseException as e:  # (raised by take, in the test that wanted it)
            self.error = e

    def take(self) -> RedisCluster:
        self._thread.join(60)
        if self.error is not None or self._thread.is_alive():
            self.cluster.stop()
            raise RuntimeError(f"the Redis Cluster made ahead did not start: {self.error!r}")
        return self.cluster


@pytest.fixture(scope="session")
def _spare_clusters() -> Iterator[dict[str, _Spare]]:
    """Per L3 server kind, the next test's Redis Cluster, made while the test before runs. Killed
    at the end of the session."""
    spares: dict[str, _Spare] = {}
    yield spares
    for spare in spares.values():
        spare._thread.join(60)
        spare.cluster.stop()


@pytest.fixture
def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory, l3_server: str, _spare_clusters: dict[str, _Spare]
) -> Iterator[RedisCluster]:
    """A real local Redis Cluster (3 masters, 3 replicas; of valkey-server for ``l3_server``
    "valkey") on free loopback ports, of new nodes that no test used before (made ahead while
    the test before ran: _Spare), killed at teardown."""

    def make() -> RedisCluster:
        return RedisCluster(cluster_ports(6), tmp_path_factory.mktemp("cluster"), server=l3_server)

    spare = _spare_clusters.pop(l3_server, None)
    cluster = spare.take() if spare is not None else make().start()
    try:
        _spare_clusters[l3_server] = _Spare(make)  # for the next test
        yield cluster
    finally:
        cluster.stop()

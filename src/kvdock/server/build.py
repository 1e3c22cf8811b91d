"""Building a server's state from its configuration: the pool (and the tenants' own segments),
the tiers below it with the tenants' quotas, the KV events publisher, the CURVE keys. Nothing
here listens or serves: :mod:`kvdock.server.launch` does, on the state built here."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from kvdock.config import ServerConfig
from kvdock.errors import ConfigError, DiskInUseError
from kvdock.server.events import ChunkEvents, subscription_topic
from kvdock.server.metrics import Metrics
from kvdock.server.registry import Registry
from kvdock.server.state import ServerState, fault_retrieve_miss
from kvdock.server.tenants import Tenants
from kvdock.shm import cleanup_stale
from kvdock.shm.directory import Directory
from kvdock.shm.pool import Pool
from kvdock.sizes import L1_AUTO_FRACTION, auto_disk_size, auto_l1_size, default_disk_dir, format_size
from kvdock.storage import DiskTier, L1Store, StorageManager, TierLane
from kvdock.storage.coherence import Coherence
from kvdock.storage.following import follow, load_position
from kvdock.storage.policy import make_policy
from kvdock.storage.shares import Shares, check_fits
from kvdock.transport import listener
from kvdock.transport.curve import ServerCurve
from kvdock.transport.curve import available as curve_available
from kvdock.transport.events import EventPublisher

if TYPE_CHECKING:
    from kvdock.storage.redis import RedisTier

log = logging.getLogger("kvdock.server")


def server_curve(config: ServerConfig, tenants: Tenants | None = None) -> ServerCurve | None:
    """The CURVE keys of ``config`` (None without), the tenants' keys authorized too: ConfigError
    for unusable key files, or tenants' keys without CURVE."""
    if not config.curve:
        if tenants is not None and tenants.keys:
            raise ConfigError("the tenants file names CURVE keys, but the server has no --curve-secret-key")
        return None
    if not curve_available():
        raise ConfigError("this libzmq has no CURVE support (pyzmq's wheels have it: reinstall pyzmq)")
    extra = tenants.keys if tenants is not None else frozenset()
    return ServerCurve.load(config.curve_secret_key, config.curve_authorized_dir, extra)


def build_state(config: ServerConfig, curve: ServerCurve | None = None, tenants: Tenants | None = None) -> ServerState:
    """Create the pool (shared or private) and the storage stack for ``config`` (``curve``: the
    KV events' subscribers must speak CURVE; ``tenants``: every client is one's)."""
    stale = cleanup_stale()
    if stale:
        log.info("removed %d stale shared-memory segment(s) of dead servers: %s", len(stale), ", ".join(stale))
    stale = listener.cleanup_stale()
    if stale:
        log.info("removed %d stale local socket director(ies) of dead servers", len(stale))
    size = config.l1_size or auto_l1_size()
    if not config.l1_size:
        log.info(
            "L1 size: %s (auto: %d%% of available memory; set --l1-size to choose)",
            format_size(size),
            L1_AUTO_FRACTION * 100,
        )
    # a pool directory (fast reads) is read by clients that check the server is alive through its
    # local socket; the retrieve-miss fault must reach every retrieve
    fast_reads = not (config.no_shm or config.no_local_socket or config.no_fast_reads or fault_retrieve_miss())
    l1_shares = tier_shares(tenants, "l1", size)
    # a tenant's L1 quota is a region of the pool of its own, in a segment of its own (shm.pool)
    pool = Pool.create(
        size,
        l1_shares.quotas if l1_shares is not None else None,
        shm=not config.no_shm,
        tenants=tenants is not None,
        directories=fast_reads,
    )
    lanes: list[TierLane] = []
    publisher: EventPublisher | None = None
    try:
        metrics = Metrics()
        publisher = _open_events(config, curve, tenants)
        events = ChunkEvents(metrics, config.chunk_size, publisher, tenants)
        disk = _open_disk(config, tenants)
        registry = Registry(
            config.chunk_size,
            disk.root / "models.msgpack" if disk is not None else None,
            config=config,
            pool_capacity=pool.capacity,
        )
        metrics.watch_registry(registry)
        if disk is not None:  # lookups skip objects written under another geometry of a name
            disk.identity_of = registry.identity_of
        redis = _open_redis(config, tenants, registry)
        # without a lower tier, what a directory lacks is not cached at all (fast reads' misses)
        complete = disk is None and redis is None
        directories = {r: Directory(s, complete) for r, s in pool.shared_segments().items() if s.directory_entries}
        l1 = L1Store(
            pool.allocator,
            watcher=events,
            memory=pool,
            directories=directories,
            shares=l1_shares,
            policy=config.eviction_policy,
        )
        l1.writeback_wait_s = config.writeback_wait_s
        l1.dirty_limit = config.writeback_dirty_limit
        lanes = [TierLane(t, l1) for t in (disk, redis) if t is not None]
        coherence = _coherence(config, redis, disk, lanes)
        manager = StorageManager(
            l1, config.session_ttl, lanes, registry.geometry_of, registry.chunk_size, coherence=coherence
        )
        if coherence is not None:  # fast readers too wait for the first poll
            for segment in pool.shared_segments().values():
                segment.set_valid_until_ns(0)
    except BaseException:
        for lane in lanes:
            lane.close()
        if publisher is not None:
            publisher.close()
        pool.close()
        raise
    metrics.l1_capacity.set(size)
    state = ServerState(config.chunk_size, pool, manager, registry, metrics, events=events, tenants=tenants)
    metrics.watch_tiers(manager)
    return state


def _coherence(
    config: ServerConfig, redis: RedisTier | None, disk: DiskTier | None, lanes: list[TierLane]
) -> Coherence | None:
    """With an L3, the fleet's invalidation stream (storage.coherence), starting from the position
    kept beside L2; an L2 that kept none (it ran without that L3) cannot tell which of its objects
    an overwrite elsewhere replaced: it is cleared."""
    if redis is None:
        return None
    coherence = Coherence(lambda: redis._redis, config.l3_coherence_ms / 1000, floor_ttl_ms=config.l3_floor_ttl_ms)
    redis.coherence = coherence
    for lane in lanes:
        if lane.tier is redis:
            lane.fence = coherence.fence
    if disk is not None:
        saved = load_position(disk.root)
        if saved is not None:
            coherence.position, coherence.consumed, coherence.incarnation = saved
            coherence.resume = True
        elif len(disk):
            n = disk.clear()
            log.warning(
                "L2 %s: %d object(s) cleared: it kept no position in the L3's invalidations, so any of them "
                "may have been overwritten through another server",
                disk.root,
                n,
            )
    return coherence


async def follow_fleet(state: ServerState) -> None:
    """Apply the fleet's invalidations for as long as the server runs (nothing without an L3)."""
    manager, coherence = state.manager, state.manager.coherence
    if coherence is None:
        return
    redis = next(lane.tier for lane in manager.lanes if lane.name == "l3")
    disk = next((lane.tier for lane in manager.lanes if isinstance(lane.tier, DiskTier)), None)
    segments = list(state.pool.shared_segments().values())

    def vouch(until: float) -> None:
        for segment in segments:
            segment.set_valid_until_ns(int(until * 1e9))

    try:
        keep = disk.root if disk is not None else None
        keeper = manager.holdings.round if manager.holdings is not None else None
        await follow(coherence, manager.apply, redis.failed, vouch, keep, recovered=redis.probe_soon, keeper=keeper)
    except asyncio.CancelledError:
        raise
    except BaseException:  # never silently: without it the server answers misses for good
        log.exception("coherence: following the fleet's invalidations stopped; L1 and L2 are not served")
        raise


def _open_events(config: ServerConfig, curve: ServerCurve | None, tenants: Tenants | None) -> EventPublisher | None:
    if not config.kv_events_url:
        return None
    topics = None
    if tenants is not None:
        admin = config.admin_token
        topics = functools.partial(subscription_topic, tenants, admin)
    try:
        return EventPublisher(config.kv_events_url, curve=curve, topics=topics)
    except zmq.ZMQError as e:
        raise ConfigError(f"cannot publish KV events on {config.kv_events_url}: {e}") from None


def tier_shares(tenants: Tenants | None, tier: str, capacity: int) -> Shares | None:
    """The tenants' quotas of ``tier`` (None without tenants, or when none has one there);
    ConfigError when they do not fit in its ``capacity`` (0: not known, e.g. L3 without
    --redis-max-bytes)."""
    if tenants is None:
        return None
    quotas = {t.name: t.quota(tier) for t in tenants.all.values() if t.quota(tier)}
    if not quotas:
        return None
    if capacity:
        check_fits(tier, capacity, quotas)

    def owner_of(salt: str) -> str | None:
        tenant = tenants.owner(salt)
        return tenant.name if tenant is not None else None

    return Shares(owner_of, quotas)


def _open_disk(config: ServerConfig, tenants: Tenants | None) -> DiskTier | None:
    if config.no_disk:
        return None
    root = Path(config.disk_dir) if config.disk_dir else default_disk_dir()
    size = config.disk_size or auto_disk_size(root)
    try:
        disk = DiskTier(root, size, tier_shares(tenants, "l2", size), make_policy(config.eviction_policy))
    except DiskInUseError as e:
        raise ConfigError(f"{e}; give another --disk-dir, or --no-disk") from None
    report = disk.scan()
    log.info(
        "L2 disk %s: %s budget, %d object(s) found (%s used), %d torn file(s) and %d temp file(s) removed",
        root,
        format_size(size),
        report.loaded,
        format_size(disk.used_bytes),
        report.torn,
        report.temp_files,
    )
    return disk


def _open_redis(config: ServerConfig, tenants: Tenants | None, registry: Registry) -> RedisTier | None:
    if not config.redis_url:
        return None
    from kvdock.storage.redis import RedisTier  # imports redis-py: only a server with an L3 does

    shares = tier_shares(tenants, "l3", config.redis_max_bytes)
    store = RedisTier(
        config.redis_url,
        timeout=config.redis_timeout_s,
        max_bytes=config.redis_max_bytes,
        shares=shares,
        identity_of=registry.identity_of,
        policy=make_policy(config.eviction_policy),
    )
    store.probe()
    if store.up():
        if store.is_cluster_node():
            store.close()
            raise ConfigError(
                f"{store.display_url} is a Redis Cluster node: give the cluster as "
                f"redis+cluster://HOST:PORT,HOST:PORT/ (one node's URL reaches only its own shard)"
            )
        log.info("L3 redis %s: connected", store.display_url)
    return store

"""Where KV objects live: the L1 object store over the shm slot pool, sessions with leases,
the lower tiers (L2 disk, L3 Redis) behind one :class:`StorageTier` interface with a lane each
(their threads and their queue of writes and deletions), and the manager that owns an object's
life across all of them. Only the lanes' worker threads touch slot memory here; clients copy
their own bytes."""

from kvdock.storage.disk import DiskTier
from kvdock.storage.lane import TierLane
from kvdock.storage.manager import StorageManager, StorePlan
from kvdock.storage.memory import L1Object, L1Store, State
from kvdock.storage.sessions import Session, Writer
from kvdock.storage.tier import StorageTier, TierCounters

__all__ = [
    "DiskTier",
    "L1Object",
    "L1Store",
    "Session",
    "State",
    "StorageManager",
    "StorageTier",
    "StorePlan",
    "TierCounters",
    "TierLane",
    "Writer",
]
# RedisTier: from kvdock.storage.redis (not imported here: it imports redis-py, which only a server
# with an L3 needs)

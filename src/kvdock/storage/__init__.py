"""Where KV objects live: the L1 object store over the shm slot pool, sessions with leases, the
manager that runs store/retrieve bookkeeping on top of them, and the lower tiers (L2 disk, L3
Redis) with their write-down and prefetch. Only the tiers' worker threads touch slot memory here;
clients copy their own bytes."""

from kvdock.storage.manager import StorageManager, StorePlan
from kvdock.storage.memory import L1Object, L1Store, State

__all__ = ["L1Object", "L1Store", "State", "StorageManager", "StorePlan"]

"""Where KV objects live: the L1 object store over the shm slot pool, sessions with leases, and the
manager that runs store/retrieve bookkeeping on top of them. No memory copies happen here."""

from kvdock.storage.manager import StorageManager, StorePlan
from kvdock.storage.memory import L1Object, L1Store, State

__all__ = ["L1Object", "L1Store", "State", "StorageManager", "StorePlan"]

"""The L1 shared-memory segment (create/attach/unlink, stale clean-up) and its slot allocator."""

from kvdock.shm.segment import HEADER_SIZE, PoolSegment, cleanup_stale
from kvdock.shm.slots import SlotAllocator

__all__ = ["HEADER_SIZE", "PoolSegment", "SlotAllocator", "cleanup_stale"]

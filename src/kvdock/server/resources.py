"""The server process's own settings, made once at start: how many descriptors it may hold and how
its C library hands memory out and back."""

from __future__ import annotations

import contextlib
import ctypes
import resource

FD_LIMIT = 1 << 16  # descriptors the server asks for (its soft limit, within the hard one)


def raise_fd_limit() -> None:
    """Every client holds a socket (two for a local one): the common soft limit of 1024
    descriptors would run out before the connection caps do, so take what the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def keep_freed_memory() -> bool:
    """Have glibc serve every allocation of this process from its heaps and keep freed memory for
    reuse instead of handing it back to the kernel. The inline transport receives payloads into
    messages that libzmq mallocs (a chunk each: 32 MiB for a 32-layer model), which glibc maps
    fresh every time; on VMs that report free pages to their host, touching fresh memory costs
    up to 8 µs per 4 KiB, and a 1 GiB inline store spent 1-3 s of the server's CPU in page
    faults (0.3 s without them). The price: the resident size stays at the high-water mark of
    the payloads held at once (the chunks of the inline stores being committed, the unsent
    retrieve replies, which are capped) until the process ends. Blocks larger than a thread's
    heap (64 MiB) are still mapped fresh. False where the C library has no ``mallopt`` (not
    glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))

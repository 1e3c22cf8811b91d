"""Byte sizes: parsing and printing them (``--l1-size 2GiB``), and the automatic sizes of L1 and
L2 a server takes from the machine when it is given none (:func:`kvdock.config.with_sizes`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvdock.errors import ConfigError

L1_AUTO_FRACTION = 0.25  # of available memory, when --l1-size is not given ...
L1_AUTO_MAX = 2 * 2**30  # ... and at most this (it is pre-faulted: a laptop keeps its memory)
DISK_DEFAULT = 8 * 2**30  # the L2 budget when --disk-size is not given ...
DISK_AUTO_FRACTION = 0.5  # ... or this fraction of the free space there, when that is less

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"4096"`` into bytes; ConfigError otherwise."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (try 2GiB, 512MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def auto_l1_size() -> int:
    """The default L1 size: L1_AUTO_FRACTION of available memory, at most L1_AUTO_MAX, bounded by
    the free space in /dev/shm."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        meminfo = Path("/proc/meminfo").read_text()
        avail = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    st = os.statvfs("/dev/shm")
    size = min(int(avail * L1_AUTO_FRACTION), L1_AUTO_MAX, int(st.f_bavail * st.f_frsize * 0.9))
    return size // 2**20 * 2**20


def default_disk_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvdock" / "l2"


def auto_disk_size(directory: Path) -> int:
    """The default L2 budget: DISK_DEFAULT, or DISK_AUTO_FRACTION of the free space where
    ``directory`` lives when that is less (the same number at every start on a disk with room)."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return min(DISK_DEFAULT, int(st.f_bavail * st.f_frsize * DISK_AUTO_FRACTION)) // 2**20 * 2**20

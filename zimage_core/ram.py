"""The machine's RAM as the pack reads it, on Linux, Windows and other POSIX systems: what is
available and in all, the headroom ComfyUI's RAM cache keeps, and a file's pages read into the page
cache or found there."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

GiB = 1 << 30
MEMINFO = "/proc/meminfo"


def _meminfo(field) -> int | None:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _ram(meminfo_field, windows_field, sysconf_pages) -> int | None:
    """Linux: /proc/meminfo's field; Windows: GlobalMemoryStatusEx's; other POSIX systems:
    sysconf's page count; None where none of them can be read."""
    value = _meminfo(meminfo_field)
    if value is not None:
        return value
    if sys.platform == "win32":
        status = _windows_memory_status()
        return None if status is None else getattr(status, windows_field)
    try:
        return os.sysconf(sysconf_pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every POSIX system has these (macOS)
        return None


def available_ram() -> int | None:
    """Physical RAM available now, or None where it cannot be read (MemAvailable on Linux counts
    the page cache the kernel can drop)."""
    return _ram("MemAvailable", "ullAvailPhys", "SC_AVPHYS_PAGES")


def total_ram() -> int | None:
    return _ram("MemTotal", "ullTotalPhys", "SC_PHYS_PAGES")


def _windows_memory_status():
    import ctypes

    class MemoryStatusEx(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),
                    ("ullTotalPhys", ctypes.c_uint64), ("ullAvailPhys", ctypes.c_uint64),
                    ("ullTotalPageFile", ctypes.c_uint64), ("ullAvailPageFile", ctypes.c_uint64),
                    ("ullTotalVirtual", ctypes.c_uint64), ("ullAvailVirtual", ctypes.c_uint64),
                    ("ullAvailExtendedVirtual", ctypes.c_uint64)]

    status = MemoryStatusEx()
    status.dwLength = ctypes.sizeof(status)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return None
    return status


# The kernel's read-ahead hints (POSIX_FADV_WILLNEED, MADV_WILLNEED) read at most one read-ahead
# window a call (128 KiB to a few MiB), whatever range they are given: a layer of hundreds of MB is
# brought in only by reading it (``read_ahead``).
_MADV_POPULATE_READ = 22  # Linux 5.14 and later: fault a range's pages in (reading them), in one call
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _page_range(address: int, nbytes: int) -> tuple:
    page = mmap.PAGESIZE
    start = address // page * page
    return start, address + nbytes - start


def read_mapped(address: int, nbytes: int):
    """Read the file pages behind a mapped range into the page cache now (they are mapped too): on
    Linux 5.14 and later; elsewhere, and for a range past the file's end, nothing."""
    if _LIBC is not None and nbytes > 0:
        start, length = _page_range(address, nbytes)
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_READ)


def in_page_cache(address: int, nbytes: int) -> bool:
    """Every page of a range of a file's mapping is in the page cache (Linux; False elsewhere, or
    where it cannot be told). Reading the mapping is not needed for this: nothing is faulted in."""
    if _LIBC is None or nbytes <= 0:
        return False
    start, length = _page_range(address, nbytes)
    vec = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return False
    return 0 not in bytes(vec)  # bit 0 of each page's byte: resident


def cache_headroom(total: int | None) -> int:
    """The available RAM ComfyUI's RAM-pressure cache keeps by default on a machine with ``total``
    bytes of RAM: 10% of it, at least 2 GB, at most 10 GB (ComfyUI counts in binary units)."""
    if total is None:
        return 2 * GiB
    return int(min(10 * GiB, max(2 * GiB, total * 0.10)))

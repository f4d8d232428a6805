"""The machine's RAM as the pack reads it, on Linux, Windows and other POSIX systems: what is
available and in all, the headroom ComfyUI's RAM cache keeps, and the kernel asked to read a
mapped file's pages ahead."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

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


_MADV_WILLNEED = 3  # Linux
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def advise_mapped(t: torch.Tensor):
    """Ask Linux to start reading the pages behind host tensor ``t`` now, where they map a file that
    is not in the page cache (another model's weights, memory-mapped by their loader): the copy that
    follows then does not fault them in a few pages at a time. A no-op for ordinary memory and
    elsewhere."""
    if _LIBC is None or t.device.type != "cpu" or not t.numel():
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    stop = t.data_ptr() + t.numel() * t.element_size()
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_WILLNEED)


def cache_headroom(total: int | None) -> int:
    """The available RAM ComfyUI's RAM-pressure cache keeps by default on a machine with ``total``
    bytes of RAM: 10% of it, at least 2 GB, at most 10 GB (ComfyUI counts in binary units)."""
    if total is None:
        return 2 * GiB
    return int(min(10 * GiB, max(2 * GiB, total * 0.10)))

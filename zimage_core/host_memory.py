"""Pinned host buffers, counted against a cap and released as a whole.

Pinned (page-locked) memory is what lets uploads run at full bus speed and asynchronously,
but it cannot be swapped: taking too much of it starves the rest of the machine. Every
pinned byte the pack holds goes through a ``HostPool``; ``live_bytes()`` is the process-wide
total, which the tests use to check that failures leave nothing behind.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import weakref

import torch

from .errors import SettingError

_lock = threading.Lock()
_live = 0
MEMINFO = "/proc/meminfo"


def live_bytes() -> int:
    """Host buffer bytes currently held by every pool in this process."""
    return _live


def available_ram() -> int | None:
    """Physical RAM available now, or None where it cannot be read. Linux: MemAvailable from
    /proc/meminfo (it counts the page cache the kernel can drop); Windows: GlobalMemoryStatusEx;
    other systems: sysconf's available pages."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "win32":
        return _windows_available_ram()
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every POSIX system has SC_AVPHYS_PAGES (macOS)
        return None


def _windows_available_ram() -> int | None:
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
    return status.ullAvailPhys


def default_cap() -> int:
    """Half of the RAM that is available now: the rest of the machine (the text encoder's
    host copy, ComfyUI, the OS) keeps the other half. 8 GiB where the RAM cannot be read."""
    avail = available_ram()
    if avail is None:
        return 8 << 30
    return avail // 2


def _host_register(buf) -> bool:
    """Page-lock an ordinary allocation. Unlike ``pin_memory=True`` (PyTorch's caching host
    allocator keeps freed pinned blocks for reuse), registered pages go back to the OS as soon
    as they are unregistered and the tensor is freed."""
    return torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0) == 0


def _release(held: dict, pin: bool):
    """Unlock the pages of every buffer in ``held`` (data_ptr -> bytes) and uncount them. Runs
    from ``release_all`` or, when a pool is dropped without it, from the pool's finalizer:
    before the buffers' memory is freed, so no freed page stays registered with CUDA."""
    global _live
    total = sum(held.values())
    for ptr, nbytes in held.items():
        if pin:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        with _lock:
            _live -= nbytes
    held.clear()
    if total:
        logging.getLogger("zimage").info("Z-Image: released %.2f GiB of %s host memory", total / (1 << 30),
                                         "pinned" if pin else "reserved")


class HostPool:
    def __init__(self, cap_bytes: int | None = None, pin: bool | None = None):
        """``cap_bytes`` None: what ``ZIMAGE_PINNED_GIB`` leaves after the pools already alive (it
        caps the process), or else half of the RAM available now."""
        if cap_bytes is None:
            env = self.environment_cap()
            cap_bytes = default_cap() if env is None else max(0, env - live_bytes())
        self.cap = int(cap_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.used = 0
        self._held = {}     # data_ptr -> bytes, what is counted (and registered)
        self._buffers = []  # the tensors, kept alive until released
        weakref.finalize(self, _release, self._held, self.pin)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A flat host buffer, or None when it would pass the cap or the OS refuses to pin it."""
        global _live
        nbytes = numel * dtype.itemsize
        if self.used + nbytes > self.cap:
            return None
        try:
            buf = torch.empty(numel, dtype=dtype)
        except RuntimeError:  # no host memory left
            return None
        if self.pin and not _host_register(buf):  # the OS has no more lockable memory
            return None
        self._held[buf.data_ptr()] = nbytes
        self._buffers.append(buf)
        self.used += nbytes
        with _lock:
            _live += nbytes
        return buf

    def holds(self, buf) -> bool:
        return buf.data_ptr() in self._held

    def release_all(self):
        """Unlock every buffer; the memory itself goes when the last reference to it does."""
        _release(self._held, self.pin)
        self._buffers.clear()
        self.used = 0

    @staticmethod
    def environment_cap() -> int | None:
        """ZIMAGE_PINNED_GIB: the pinned bytes this process may hold in all (e.g. for a 16 GB RAM machine)."""
        text = os.environ.get("ZIMAGE_PINNED_GIB", "").strip()
        if not text:
            return None
        try:
            gib = float(text)
        except ValueError:
            gib = math.nan
        if not (math.isfinite(gib) and gib >= 0):
            raise SettingError(f"ZIMAGE_PINNED_GIB is {text!r}: set it to a number of GiB >= 0 (e.g. 4 or 10.5; "
                               "0 pins nothing), or unset it to pin up to half of the available RAM.")
        return int(gib * (1 << 30))

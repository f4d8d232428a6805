"""Pinned host buffers, counted against a cap and released as a whole.

Pinned (page-locked) memory is what lets uploads run at full bus speed and asynchronously,
but it cannot be swapped: taking too much of it starves the rest of the machine. Every
pinned byte the pack holds goes through a ``HostPool``; ``live_bytes()`` is the process-wide
total, which the tests use to check that failures leave nothing behind.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

_lock = threading.Lock()
_live = 0


def live_bytes() -> int:
    """Host buffer bytes currently held by every pool in this process."""
    return _live


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_cap() -> int:
    """Half of the RAM that is available now: the rest of the machine (the text encoder's
    host copy, ComfyUI, the OS) keeps the other half."""
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
        v = os.environ.get("ZIMAGE_PINNED_GIB")
        return int(float(v) * (1 << 30)) if v else None

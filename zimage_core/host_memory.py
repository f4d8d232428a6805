"""Host memory the pack holds: one budget for the whole process, and pools that draw on it.

Pinned (page-locked) memory is what lets uploads run at full bus speed and asynchronously,
but it cannot be swapped, and on the machines this pack is for (16-32 GB of RAM) it is the
first thing to run out. So host RAM is planned like GPU memory: ``BUDGET`` knows how much
available RAM must stay untouched (ComfyUI's RAM-cache headroom, below which ComfyUI starts
dropping cached models), which owner expects to need how much soon (the transformer's streamed
layers, claimed when it plans a split), and what every ``HostPool`` holds. A pool's allocation
succeeds only within what is left. Where a model's loader has memory-mapped its file (ComfyUI's
does), its weights are locked where they are instead (``pin_in_place``): pinned, and no copy.
``live_bytes()`` is the process-wide total, which the tests use to check that failures leave
nothing behind, and ``pin_calls()`` counts buffers pinned, which the benchmarks use to show that
nothing is pinned per image.
"""
from __future__ import annotations

import bisect
import logging
import math
import mmap
import os
import threading
import warnings
import weakref

import torch

from .environment import pinned_cap
from .ram import available_ram, cache_headroom, total_ram

GiB = 1 << 30
_lock = threading.RLock()  # the counters; pools allocate from the upload threads and the main one
_live = 0
_pins = 0
_in_place = {}  # start -> bytes of every page range locked where a file mapping keeps it
# working memory of a run beyond the headroom (latents, the decoded image, ComfyUI's temporaries)
WORKING_MARGIN = GiB
log = logging.getLogger("zimage")


def live_bytes() -> int:
    """Host buffer bytes currently held by every pool in this process."""
    return _live


def pin_calls() -> int:
    """Buffers pinned since the process started."""
    return _pins


class HostBudget:
    """What the pools of this process may still take. ``headroom``: the available RAM that must stay
    untouched (ComfyUI's RAM-cache headroom; the default is what ComfyUI keeps on this machine).
    ``claim(owner, nbytes)``: an owner expects to hold ``nbytes`` soon (the transformer's streamed
    layers, from its plan), so other owners leave that much to it however they come first."""

    def __init__(self, cap: int | None = None):
        """``cap``: the bytes the pools may hold in all (ZIMAGE_PINNED_GIB), None: no cap."""
        self.cap = cap
        self.headroom = cache_headroom(total_ram())
        self.claims = {}  # owner -> bytes it expects to hold
        self.held = {}    # owner -> bytes its pools hold

    def room(self, owner: str) -> int:
        """Bytes ``owner`` may still allocate: the RAM's room, within ZIMAGE_PINNED_GIB."""
        room = self.ram_room(owner)
        return room if self.cap is None else max(0, min(room, self.cap - _live))

    def ram_room(self, owner: str) -> int:
        """The RAM left to ``owner`` beside the headroom and the others' claims, whatever the cap
        (what a file's page cache can still keep: the cap limits the pack's copies, not the cache)."""
        avail = available_ram()
        others = sum(max(0, c - self.held.get(o, 0)) for o, c in self.claims.items() if o != owner)
        # MemAvailable still counts page-cache pages that are locked in place (the kernel cannot drop them)
        locked = sum(_in_place.values())
        return max(0, (1 << 62) if avail is None else avail - locked - self.headroom - WORKING_MARGIN - others)

    def claim(self, owner: str, nbytes: int):
        self.claims[owner] = int(nbytes)

    def _count(self, owner, nbytes):
        self.held[owner] = self.held.get(owner, 0) + nbytes


BUDGET = HostBudget(pinned_cap())


HUGE_PAGE = 2 << 20


def _empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 host buffer. On Linux a large one is a mapping of its own, aligned to and
    advised for transparent huge pages (``MADV_HUGEPAGE``: where the system's setting is
    ``madvise``, as Ubuntu's is, they come only where asked): faulting it in and page-locking it
    then handle 512 times fewer pages. On an H100's host
    21 compressed masters (5.6 GB) were zeroed and registered in 0.31-0.35 s against 0.76 s in 4
    KiB pages, with or without 97 GiB of the RAM held by another process; uploads from either ran
    at the same 54-55 GB/s. The kernel gives small pages where it has no huge ones: the same
    buffer, only slower to make."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without them: small pages
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive; unmapped with its last view
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _host_register(buf) -> bool:
    """Page-lock an ordinary allocation. Unlike ``pin_memory=True`` (PyTorch's caching host
    allocator keeps freed pinned blocks for reuse), registered pages go back to the OS as soon
    as they are unregistered and the tensor is freed."""
    return torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0) == 0


# cudaHostRegisterPortable | cudaHostRegisterReadOnly: the device only reads the pages, which is
# what lets a read-only file mapping be locked at all
_REGISTER_READ_ONLY = 1 | 8


def _discard_cuda_error():
    """A failed registration leaves its error for the next kernel launch to report: take it now."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def _page_spans(tensors) -> list:
    """The page ranges [(start, stop)] that hold ``tensors``' bytes, merged where they touch."""
    page = mmap.PAGESIZE
    spans = []
    for a, b in sorted((t.data_ptr() // page * page, -(-(t.data_ptr() + t.nbytes) // page) * page)
                       for t in tensors):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def _file_maps() -> list:
    """[(start, stop, file offset, path, inode)] of this process's mappings of files that hold the file's
    bytes (shared, or private and read-only), adjacent pieces of one mapping joined (Linux:
    /proc/self/maps; [] elsewhere)."""
    maps = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                    continue
                perms, path = fields[1], fields[5].rstrip("\n")
                if path.endswith(" (deleted)") or ("w" in perms and perms[3] == "p"):
                    continue  # gone from the disk, or private pages that may have been written
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                offset, inode = int(fields[2], 16), int(fields[4])
                last = maps[-1] if maps else None
                if last and last[1] == lo and last[3:] == [path, inode] and last[2] + (lo - last[0]) == offset:
                    last[1] = hi
                else:
                    maps.append([lo, hi, offset, path, inode])
    except OSError:
        return []
    return maps


def locks_files() -> bool:
    """Whether this process can lock a file's pages in place for the device (``pin_in_place``)."""
    return torch.cuda.is_available() and os.path.exists("/proc/self/maps")


def maps_file(t: torch.Tensor) -> bool:
    """Whether host tensor ``t``'s bytes lie in a mapping of a file: pages that may be read-only
    (locked in place, or a loader's read-only mapping) and are never written."""
    return t.device.type == "cpu" and _mapping_of(_file_maps(), t.data_ptr(), 1) is not None


def _mapping_of(maps, p, nbytes):
    """The mapping of ``maps`` (sorted by start, as /proc/self/maps lists them) that holds bytes
    [p, p + nbytes), or None."""
    k = bisect.bisect_right(maps, [p, math.inf]) - 1
    return maps[k] if k >= 0 and p + nbytes <= maps[k][1] else None


def _file_views(tensors) -> list | None:
    """``tensors`` as views of the same bytes in a shared read-only mapping of the files they map,
    or None where one of them does not map a file (ordinary memory is never locked in place: a
    heap page it shares with other objects could go back to the OS and be refilled while locked).
    The loader's own mapping may be private, and Linux cannot lock a private read-only mapping for
    the device (the registration never returns); a shared one of the same file is the same pages
    of the page cache, so it costs no RAM."""
    maps = _file_maps()
    where = []
    for t in tensors:
        p = t.data_ptr()
        m = _mapping_of(maps, p, t.nbytes)
        if m is None or t.is_meta or not t.is_contiguous():
            return None
        where.append((m[3], m[4], m[2] + p - m[0]))
    files, views = {}, []
    try:
        for t, (path, inode, offset) in zip(tensors, where):
            if path not in files:
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_ino != inode:
                        return None  # the path names another file now (a new download)
                    files[path] = torch.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=torch.uint8)
            views.append(files[path][offset:offset + t.nbytes].view(t.dtype).view(t.shape))
    except (OSError, ValueError, RuntimeError):  # unreadable now, or an offset the dtype cannot view
        return None
    return views


def _release(held: dict, pin: bool, owner: str):
    """Unlock the pages of every buffer in ``held`` (data_ptr -> bytes) and uncount them. Runs
    from ``release_all`` or, when a pool is dropped without it, from the pool's finalizer:
    before the buffers' memory is freed, so no freed page stays registered with CUDA."""
    global _live
    total = sum(held.values())
    with _lock:
        for ptr, nbytes in held.items():
            if pin:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            _in_place.pop(ptr, None)
            _live -= nbytes
        held.clear()
        BUDGET._count(owner, -total)
    if total:
        log.info("Z-Image: released %.2f GiB of %s host memory", total / GiB, "pinned" if pin else "reserved")


class HostPool:
    def __init__(self, owner: str = "other", pin: bool | None = None, cap_bytes: int | None = None):
        """Buffers of one owner (a model), within ``BUDGET`` and, where given, ``cap_bytes``
        (0: none at all, e.g. where the model's own tensors are the masters). ``pin``: page-lock
        them (default: where CUDA is)."""
        self.owner = owner
        self.cap = None if cap_bytes is None else int(cap_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.used = 0
        self._held = {}     # data_ptr -> bytes, what is counted (and registered)
        self._buffers = []  # the tensors, kept alive until released
        self._reported = (0, 0)
        weakref.finalize(self, _release, self._held, self.pin, owner)

    @property
    def in_place(self) -> int:
        """Bytes of this pool's that are locked where their owner keeps them (``pin_in_place``)."""
        return sum(nbytes for start, nbytes in self._held.items() if start in _in_place)

    def room(self) -> int:
        room = BUDGET.room(self.owner)
        return room if self.cap is None else min(room, self.cap - self.used)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A flat host buffer, or None when it would pass the budget or the OS refuses to pin it."""
        global _live, _pins
        nbytes = numel * dtype.itemsize
        with _lock:  # what room() saw is still there when the buffer is counted
            if nbytes > self.room():
                return None
            try:
                buf = _empty(nbytes).view(dtype)
            except (RuntimeError, OSError):  # no host memory left
                return None
            if self.pin:
                # the pages faulted in on every core first: the registration faults them in one at
                # a time (a 354 MB layer took 130 ms on the H200's host, 2.7 GB/s)
                buf.zero_()
                if not _host_register(buf):  # the OS has no more lockable memory
                    return None
                _pins += 1
            self._held[buf.data_ptr()] = nbytes
            self._buffers.append(buf)
            self.used += nbytes
            BUDGET._count(self.owner, nbytes)
            _live += nbytes
        return buf

    def pin_in_place(self, tensors) -> list | None:
        """``tensors`` page-locked where they are, when every one of them maps a file (a model its
        loader memory-mapped, as ComfyUI's does) and the budget has room: views of the same bytes
        (``_file_views``), from which uploads run at full bus speed and asynchronously, with no
        copy of them in host memory. The pool keeps them alive and unlocks them with its buffers.
        None, with nothing locked, otherwise."""
        global _live, _pins
        if not (self.pin and tensors) or any(t.device.type != "cpu" for t in tensors):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mapping is read-only by design
            views = _file_views(tensors)
        if views is None:
            return None
        spans = _page_spans(views)
        nbytes = sum(b - a for a, b in spans)
        with _lock:
            if nbytes > self.room():
                return None
            done = []
            for a, b in spans:
                if torch.cuda.cudart().cudaHostRegister(a, b - a, _REGISTER_READ_ONLY) != 0:
                    _discard_cuda_error()  # a device without read-only registration
                    for start in done:
                        torch.cuda.cudart().cudaHostUnregister(start)
                    return None
                done.append(a)
            _pins += len(spans)
            for a, b in spans:
                self._held[a] = _in_place[a] = b - a
            self._buffers += views
            self.used += nbytes
            BUDGET._count(self.owner, nbytes)
            _live += nbytes
        return views

    def report(self, what: str):
        """Log the buffers pinned since the last report, in one line (the benchmarks count these)."""
        n, nbytes = len(self._buffers) - self._reported[0], self.used - self._reported[1]
        if n > 0 and self.pin:
            log.info("Z-Image: pinned %.2f GiB of host memory for the %s (%d buffers%s; %.2f GiB held by the pack)",
                     nbytes / GiB, what, n,
                     f", {self.in_place / GiB:.2f} GiB of them in place" if self.in_place else "", _live / GiB)
        self._reported = (len(self._buffers), self.used)

    def free(self, buf):
        """Give one buffer back (e.g. one whose filling was interrupted)."""
        nbytes = self._held.pop(buf.data_ptr())
        _release({buf.data_ptr(): nbytes}, self.pin, self.owner)
        self._buffers = [b for b in self._buffers if b.data_ptr() != buf.data_ptr()]
        self.used -= nbytes
        self._reported = (self._reported[0] - 1, self._reported[1] - nbytes)

    def holds(self, t) -> bool:
        """``t`` (a buffer of this pool, or a view into one) lies in this pool's memory."""
        p = t.data_ptr()
        return any(start <= p < start + nbytes for start, nbytes in self._held.items())

    def release_all(self):
        """Unlock every buffer; the memory itself goes when the last reference to it does."""
        _release(self._held, self.pin, self.owner)
        self._buffers.clear()
        self.used = 0
        self._reported = (0, 0)

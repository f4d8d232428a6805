"""A model's tensors run from pinned host masters: device copies that a run swaps in, or that stay
placed (the transformer's fixed part, which every step needs).

The model is left as it is between runs (its tensors stay wherever its owner keeps them).
``load()`` makes the masters once and uploads device copies: where the model's loader
memory-mapped its file, the same bytes locked in place (``HostPool.pin_in_place``); else packed
copies, pinned while the host budget has room, that the model's tensors then point at (host
memory holds each weight once);
``running()`` points the model's parameters and buffers at the copies and back afterwards.
Unloading drops the copies and copies nothing back, so making room is free, and loading again
is one upload from pinned memory. Same values, same kernels: the output is the model's own.
"""
from __future__ import annotations

import contextlib

import torch

from .devices import device_of
from .host_memory import HostPool, maps_file


def viewable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where no op can view it, a tensor on the same memory that can be viewed.

    A tensor made in inference mode and then converted outside it keeps no version counter, yet no
    longer counts as an inference tensor: any view of it, in either mode, raises "Inference tensors
    do not track version counter". ComfyUI makes such tensors: it loads models inside a prompt's
    inference mode, and its classic model manager moves a model back to the CPU outside it (the
    server's ``/free``, the interface's "unload models")."""
    if t.is_inference():
        return t
    try:
        t._version
        return t
    except RuntimeError:
        with torch.inference_mode(False):
            return torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def copy_source(t):
    """A tensor as a copy source; a meta tensor (a key missing from the file) reads as zeros, as
    the model's own loader materialises it."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape) if t.is_meta else viewable(t).detach()


def host_masters(tensors: list, pool: HostPool) -> list:
    """Host masters of ``tensors``, in order: views into one packed buffer per dtype taken from
    ``pool`` (pinned on CUDA: one registration instead of one per tensor) where it has room, else
    the tensors themselves (on the CPU, where the pool's cap is 0, the model's own tensors are the
    masters: nothing is held twice)."""
    sources = [copy_source(t) for t in tensors]
    masters = [None] * len(tensors)
    by_dtype = {}
    for j, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(j)
    for dtype, items in by_dtype.items():
        flat = pool.allocate(sum(tensors[j].numel() for j in items), dtype)
        o = 0
        for j in items:
            t = sources[j]
            if flat is None:
                masters[j] = t
                continue
            masters[j] = flat[o:o + t.numel()].view(t.shape).copy_(t)
            o += t.numel()
    return masters


def module_tensors(root: torch.nn.Module, skip: set = frozenset()) -> list:
    """[(module, "_parameters" or "_buffers", name)] for every tensor under ``root`` outside the
    modules whose ids are in ``skip``."""
    return [(m, kind, name) for m in root.modules() if id(m) not in skip
            for kind in ("_parameters", "_buffers") for name, v in getattr(m, kind).items() if v is not None]


class DeviceCopies:
    def __init__(self, entries: list, device, pool: HostPool, dtypes: list | None = None):
        """``dtypes``: per entry, the dtype the model runs that tensor in where it differs from the
        tensor's own (a loader that keeps the file's fp32 tensors and casts them as it loads them),
        else None; the device copies are cast to it after the upload. Every copy goes to ``device``
        until ``spread`` sends some to other cards."""
        self.entries, self.device, self.pool = entries, device_of(device), pool
        self.devices = [self.device] * len(entries)  # where each entry's copy goes
        tensors = [getattr(m, kind)[name] for m, kind, name in entries]
        self.dtypes = [d if d is not None and d != t.dtype else None
                       for t, d in zip(tensors, dtypes or [None] * len(entries))]
        self.loaded_bytes = sum(t.numel() * (d or t.dtype).itemsize for t, d in zip(tensors, self.dtypes))
        self._index = {(id(m), name): j for j, (m, kind, name) in enumerate(entries)}
        self._host = None    # the masters (pinned where the pool allows), made once
        self._device = None  # the device copies, while loaded
        self.placed = False  # the model's tensors are the device copies until ``unload``

    def device_bytes(self, device=None) -> int:
        """What the copies hold on the devices now (on ``device`` only, where given)."""
        if self._device is None:
            return 0
        return sum(t.numel() * t.element_size() for t, d in zip(self._device, self.devices)
                   if device is None or d == device)

    def spread(self, devices: list):
        """Each entry's copy on ``devices[j]`` from now on (a transformer whose blocks span cards:
        a block's norms and adaLN on the card that runs it). Copies already loaded elsewhere are
        dropped and uploaded again from the same masters, on their new card."""
        devices = [device_of(d) for d in devices]
        if devices == self.devices:
            return
        placed = self.placed
        self.unload()
        self.devices = devices
        if placed:
            self.place()

    def load(self):
        if self._host is None:
            tensors = [getattr(m, kind)[name] for m, kind, name in self.entries]
            # where the model's loader memory-mapped its file: the same bytes locked in place, no copy
            # (the model keeps its own tensors); else packed masters the model's tensors point at
            self._host = self.pool.pin_in_place(tensors) if self.device.type == "cuda" else None
            if self._host is None:
                self._host = host_masters(tensors, self.pool)
                self._point(self._host)
        if self._device is None:
            # uploaded as stored, then cast on the device: a cast on the way would go through a
            # pageable copy on the CPU
            self._device = [t.to(device, non_blocking=True).to(d or t.dtype)
                            for t, d, device in zip(self._host, self.dtypes, self.devices)]

    def place(self):
        """Load, and leave the model's tensors on the device copies (a model whose every forward
        needs them: the transformer's fixed part) until ``unload``."""
        self.load()
        self._point(self._device)
        self.placed = True

    def unload(self) -> int:
        """Drop the device copies (the model's tensors are the masters again); returns the bytes freed."""
        held = self.device_bytes()
        if self.placed:
            self._point(self._host)
            self.placed = False
        self._device = None
        return held

    def release(self):
        """Device copies and host masters (pinned memory goes back with the pool)."""
        self.unload()
        self._host = None

    def write(self, module, name, value: torch.Tensor):
        """Set ``module``'s tensor ``name`` to ``value`` in its master and, while loaded, its device
        copy. A master that is a file's pages (locked in place, or a mapped tensor the pool had no
        room to copy) is read-only: that tensor gets a master of its own instead."""
        j = self._index[(id(module), name)]
        m, kind, _ = self.entries[j]
        own = getattr(m, kind)[name].data  # what the model's tensor is now
        old = own if self._host is None else self._host[j]
        new = torch.empty_like(old) if maps_file(old) else old
        new.copy_(value)
        if self._host is not None:
            self._host[j] = new
        if self._device is not None:
            if self._device[j].data_ptr() == old.data_ptr():  # on the CPU the device copy is the master
                self._device[j] = new
            else:
                self._device[j].copy_(value)
        if own.data_ptr() == old.data_ptr():
            self._point_one(j, new)

    def _point_one(self, j, t):
        m, kind, name = self.entries[j]
        getattr(m, kind)[name] = torch.nn.Parameter(t, requires_grad=False) if kind == "_parameters" else t

    def _point(self, tensors):
        for j, t in enumerate(tensors):
            self._point_one(j, t)

    @contextlib.contextmanager
    def running(self):
        """Within: the model's tensors are the device copies."""
        self.load()
        saved = [getattr(m, kind)[name] for m, kind, name in self.entries]
        try:
            self._point(self._device)
            yield
        finally:
            for (m, kind, name), t in zip(self.entries, saved):
                getattr(m, kind)[name] = t

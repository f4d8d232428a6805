"""How a layer's big matrices lie in one flat buffer, the order in which layers become resident, and
the one config a layer stream is built from: what the host side (``host_masters``) and the device
schedule (``streamer``) share, and what the planner sizes its plans by."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .config import ZImageConfig
from .devices import device_of
from .dit import BigWeights
from .ram import read_mapped
from .safetensors_file import read_many, read_pieces

ALIGN = 256  # bytes; every matrix starts on the same alignment in every buffer
# Uploads without a host master go through a ring of small pinned buffers, a chunk at a time: the
# read into one overlaps the upload from the other. Two are enough: the upload thread fills them
# (measured on an H200, every layer from the page cache: the same step time with two as with four),
# and the ring costs 128 MiB of pinned memory per model instead of two whole layers (0.66 GiB for
# Z-Image, 0.38 for Qwen3-4B).
STAGING_CHUNK = 64 << 20  # bytes
STAGING_BUFFERS = 2


def staging_chunk(layout) -> int:
    """Elements of one staging buffer: a chunk, or the whole layer where it is smaller."""
    return min(layout.numel, STAGING_CHUNK // layout.dtype.itemsize)


def staging_bytes(layout) -> int:
    """Host bytes of a stream's staging ring."""
    return STAGING_BUFFERS * staging_chunk(layout) * layout.dtype.itemsize


@functools.lru_cache(maxsize=None)
def residency_order(n: int) -> tuple:
    """The order in which layers become resident: each next one in the middle of the longest
    run of streamed layers (the earliest of equal runs), so that the resident layers are spread
    evenly through the stack for every count, and one more or one fewer moves no other layer.

    Why spread: the copy engine can only run ahead of the compute by as many layers as there are
    slots. Resident layers in one block (with the refiners before them) are a stretch of compute
    during which the slots fill up and the copy engine idles; spread out, each resident layer is a
    short pause that two slots cover, so the memory of extra slots goes to resident layers instead."""
    runs, order = [(0, n)], []
    while runs:
        a, b = max(runs, key=lambda run: (run[1] - run[0], -run[0]))
        runs.remove((a, b))
        m = (a + b) // 2
        order.append(m)
        runs += [run for run in ((a, m), (m + 1, b)) if run[1] > run[0]]
    return tuple(order)


def kept_as_blocks(n: int, resident: int, blocks: int) -> frozenset:
    """The layers of a quantized stream that keep their blocks on the device when ``resident`` of
    ``n`` are resident: the next ``blocks`` of ``residency_order``, spread through the stack as the
    resident ones are."""
    return frozenset(residency_order(n)[resident:resident + blocks])


def streamed_in_order(n: int, resident: int) -> list:
    """The layers that stream when ``resident`` of ``n`` stay on the device, in the order they run."""
    keep = set(residency_order(n)[:resident])
    return [i for i in range(n) if i not in keep]


class PackLayout:
    """Where each tensor of a layer sits inside one flat per-layer buffer."""

    def __init__(self, shapes, dtype: torch.dtype):
        """``shapes``: a ``ZImageConfig`` (its five big matrices, viewed as ``BigWeights``) or any
        {name: shape} (viewed as a dict)."""
        self.wrap = BigWeights if isinstance(shapes, ZImageConfig) else dict
        self.shapes = dict(shapes.big_shapes if isinstance(shapes, ZImageConfig) else shapes)
        self.dtype = dtype
        step = ALIGN // dtype.itemsize
        self.offsets, n = {}, 0
        for name, shape in self.shapes.items():
            self.offsets[name] = n
            n += -(-math.prod(shape) // step) * step
        self.numel = n
        self.nbytes = n * dtype.itemsize

    def views(self, flat: torch.Tensor):
        return self.wrap(**{name: self.region(flat, name) for name in self.shapes})

    def region(self, flat, name):
        # a compressed master's bytes are codes: a copy into its "region" would cast values into them
        assert flat.dtype == self.dtype, f"{name}: a {flat.dtype} buffer is not a packed {self.dtype} layer"
        shape = self.shapes[name]
        o = self.offsets[name]
        return flat[o:o + math.prod(shape)].view(shape)

    def fill(self, flat, pieces: dict, start: int = 0, pinned: bool = False):
        """Copy pieces {name: [(row, tensor or StoredTensor)]} into ``flat`` (casting to its dtype):
        the packed layer's elements from ``start`` on, as many as ``flat`` holds (by default all of
        them). A ``StoredTensor`` is read from its file straight into host memory. ``pinned``: the
        tensors are page-locked (locked in place, which ``is_pinned`` does not report), so copies
        to the device are asynchronous."""
        stop = start + flat.numel()
        stored = []
        for name, parts in pieces.items():
            row_numel = math.prod(self.shapes[name][1:])
            for row, t in parts:
                a = self.offsets[name] + row * row_numel  # where this piece starts in the packed layer
                lo, hi = max(a, start), min(a + math.prod(t.shape), stop)
                if lo >= hi:
                    continue
                dst = flat[lo - start:hi - start]
                if isinstance(t, torch.Tensor):
                    dst.copy_(t.reshape(-1)[lo - a:hi - a], non_blocking=flat.is_cuda and (pinned or t.is_pinned()))
                else:
                    stored.append((t, dst, lo - a))
        read_many(stored)

    @staticmethod
    def cache_parts(pieces: dict) -> list:
        """A layer's bytes as reads that bring them into the page cache (``read_ahead``): a file's,
        or those behind a tensor that maps a file (another model's weights in a memory mapping).
        [(bytes, read(scratch))] (``SafetensorsFile.cache_parts``)."""
        parts = []
        for pieces_of in pieces.values():
            for _, t in pieces_of:
                if not isinstance(t, torch.Tensor):
                    parts += t.cache_parts()
                elif t.device.type == "cpu":
                    address, nbytes = t.data_ptr(), t.numel() * t.element_size()
                    parts += [(n, lambda _, a=address + a, n=n: read_mapped(a, n)) for a, n in read_pieces(nbytes)]
        return parts

    @staticmethod
    def drop(pieces: dict):
        """A layer's file bytes leave the page cache (its master has them)."""
        for parts in pieces.values():
            for _, t in parts:
                if not isinstance(t, torch.Tensor):
                    t.drop()


@dataclass(frozen=True)
class StreamConfig:
    """What a layer stream is built from, once: its layout, the device that computes, and how its
    host side keeps the layers."""
    layout: PackLayout
    device: torch.device
    # streamed layers get packed host masters (the planner says which); without, every upload reads
    # the source through the staging ring (a model uploaded once per run whose owner holds its weights)
    masters: bool = True
    # the sources are tensors locked in place (``HostPool.pin_in_place``): uploaded from where they are
    pinned_sources: bool = False
    # bf16 masters may be stored compressed (``compression``) and decoded on the device
    compress: bool = False
    # the sources are GGML blocks (a GGUF file's): masters keep them, and every upload dequantizes
    # them where the layer lands (``quants``)
    quantized: bool = False

    def __post_init__(self):
        object.__setattr__(self, "device", device_of(self.device))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def can_compress(self) -> bool:
        return self.compress and self.masters and not self.quantized and self.layout.dtype == torch.bfloat16

"""Layers (every block with big matrices: the refiners and the main layers, in the order a forward
runs them): some resident on the device, spread through the stack, the others streamed.

A layer's five big matrices come from its source (the checkpoint file, or another model's own
tensors). With ``masters`` (the transformer, whose streamed layers are uploaded at every step) a
streamed layer gets one host master at its first upload: a packed buffer taken from a
``HostPool`` (pinned on CUDA) when the host budget has room for it, so loading pins nothing and
the first forward pins as it goes (with ``compress``, a bf16 master is stored compressed and
decoded on the device at every upload: ``compression``). A layer without a master (resident
layers, and streamed layers past the budget) is read from its source a chunk at a time into a
ring of small pinned staging buffers, each read overlapping the upload from the other, with the
kernel asked to read the next layer's bytes ahead; no weight is held in host memory twice. Every upload (into a slot, or
of a layer promoted to resident) runs on the streamer's ``UploadThread``, in the order it was
queued; a layer waits for its own upload where it begins. The first ``n_resident`` layers of
``residency_order`` have a packed device buffer; the others are uploaded, one copy per layer,
into a ring of device slots on a dedicated copy stream, ordered with events: a slot is refilled
only after the layer that used it has finished, and a layer runs only after its upload. While a
forward's last layers run, the next forward's first uploads can already be queued
(``run_layers(..., next_forward=True)``), so the copy engine does not idle between steps.
Uploads go host -> device only, so evicting a resident layer just drops its device buffer and
promoting one is a single upload. Every buffer has the same layout, so a matrix is the same view
of the same shape and alignment whichever buffer it lives in: the kernels, and therefore the
bits, do not depend on the split or on where a layer came from. On the CPU the same code runs
with plain tensors and synchronous copies.

Weight patches (a LoRA: ``set_patch``) are applied on the device, to the layer's buffer just
before it runs: into a slot after every upload, into a resident buffer once. Host masters and
sources are never written for a patch; a patched resident layer is restored by uploading it
again from its master or source when the patch goes.

Why spread: the copy engine can only run ahead of the compute by as many layers as there are
slots. Resident layers in one block (with the refiners before them) are a stretch of compute
during which the slots fill up and the copy engine idles; spread out, each resident layer is a
short pause that two slots cover, so the memory of extra slots goes to resident layers instead.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import time

import torch
from torch.utils.hooks import RemovableHandle

from . import compression
from .config import ZImageConfig
from .errors import NonFiniteWeights
from .host_memory import HostPool, advise_mapped
from .dit import BigWeights
from .safetensors_file import read_many
from .uploads import UploadThread

ALIGN = 256  # bytes; every matrix starts on the same alignment in every buffer
# Uploads without a host master go through a ring of small pinned buffers, a chunk at a time: the
# read into one overlaps the upload from the other. Two are enough: the upload thread fills them
# (measured on an H200, every layer from the page cache: the same step time with two as with four),
# and the ring costs 128 MiB of pinned memory per model instead of two whole layers (0.66 GiB for
# Z-Image, 0.38 for Qwen3-4B).
STAGING_CHUNK = 64 << 20  # bytes
STAGING_BUFFERS = 2
# a master's encode reads the next staging buffer from the file on this thread while the device
# encodes the last one (one thread: the reads themselves run on the file's reader threads)
_READER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zimage-prefill")


def staging_chunk(layout) -> int:
    """Elements of one staging buffer: a chunk, or the whole layer where it is smaller."""
    return min(layout.numel, STAGING_CHUNK // layout.dtype.itemsize)


def staging_bytes(layout) -> int:
    """Host bytes of a streamer's staging ring."""
    return STAGING_BUFFERS * staging_chunk(layout) * layout.dtype.itemsize


@functools.lru_cache(maxsize=None)
def residency_order(n: int) -> tuple:
    """The order in which layers become resident: each next one in the middle of the longest
    run of streamed layers (the earliest of equal runs), so that the resident layers are spread
    evenly through the stack for every count, and one more or one fewer moves no other layer."""
    runs, order = [(0, n)], []
    while runs:
        a, b = max(runs, key=lambda run: (run[1] - run[0], -run[0]))
        runs.remove((a, b))
        m = (a + b) // 2
        order.append(m)
        runs += [run for run in ((a, m), (m + 1, b)) if run[1] > run[0]]
    return tuple(order)


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
    def advise(pieces: dict):
        """Ask the OS to start reading a layer's bytes from disk now: a file's, or those behind a
        tensor that maps a file (another model's weights in a memory mapping)."""
        for parts in pieces.values():
            for _, t in parts:
                if isinstance(t, torch.Tensor):
                    advise_mapped(t)
                else:
                    t.advise()

    @staticmethod
    def drop(pieces: dict):
        """A layer's file bytes leave the page cache (its master has them)."""
        for parts in pieces.values():
            for _, t in parts:
                if not isinstance(t, torch.Tensor):
                    t.drop()


def all_finite(t) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device: no NaN or infinity in ``t`` (fp8 e4m3fn has NaN only).
    One ``aminmax`` pass, which propagates NaN (an infinity is the minimum or the maximum): on a
    CPU 17 times faster than ``isfinite(t).all()``, which took seconds a model."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if not t.numel():
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def device_of(device) -> torch.device:
    """A device with its index: tensors report ``cuda:0``, and comparisons with a bare ``cuda`` fail."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class LayerStreamer:
    def __init__(self, layout: PackLayout, sources: list, device, pool: HostPool, check_finite=False,
                 masters=True, pinned_sources=False, compress=False):
        """``sources[i]`` is layer i's {name: [(row, tensor or StoredTensor)]} pieces. With
        ``check_finite`` every layer's matrices are checked for NaN and infinity the first time they
        run (on the device, read back once at the end of that forward: ``NonFiniteWeights``).
        ``masters``: streamed layers get packed host masters where the budget has room; without,
        every upload reads the source through the staging buffers (a model uploaded once per
        run, whose owner already holds its weights in host memory). ``pinned_sources``: the sources
        are tensors locked in place (``HostPool.pin_in_place``), uploaded straight from where they
        are, with no master and no staging. ``compress``: bf16 masters are stored compressed
        (``compression``: about 0.75 of the bytes, in host memory and over the bus) and decoded into
        their slot on the device, bit for bit."""
        self.layout, self.device, self.pool = layout, device_of(device), pool
        self.pinned_sources = pinned_sources
        # where the decode runs on this device is the planner's to ask (``compression.decodes_on``),
        # and only where layers stream
        self.can_compress = compress and masters and layout.dtype == torch.bfloat16
        self.compress = self.can_compress  # whether new masters are compressed: the plan's (``configure``)
        self.cuda = self.device.type == "cuda"
        self.n_layers = len(sources)
        self.sources = sources
        self.masters = masters
        self.from_file = 0                     # streamed layers left without a master (``configure``)
        self.order = residency_order(self.n_layers)
        self.host = [None] * self.n_layers      # packed host masters (pinned where possible)
        self.codes = [None] * self.n_layers     # the chunks of the masters stored compressed
        self._runs = [None] * self.n_layers     # their runs and tables on the device (``_decode``)
        self.encode_seconds = 0.0              # spent encoding masters (what compression adds to a first image)
        self.resident = {}                     # layer -> packed device buffer
        self.streamed = list(range(self.n_layers))  # the other layers, in the order they run
        self._index = {i: j for j, i in enumerate(self.streamed)}  # layer -> its place in streamed
        self.slots = []
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # compressed uploads: a run of chunks crosses on the copy stream into one of the device
        # buffers (``compression.BUFFERS``) while the previous runs are decoded into the slot on this
        # stream. Its priority is high: a decode is a few microseconds of work that would otherwise
        # queue behind the step's matrix kernels while the copy stream waits for its buffer
        self.decode_stream = (torch.cuda.Stream(self.device, priority=-1)
                              if self.cuda and self.can_compress else None)
        self._packed = []                      # [device buffer, event of the last decode from it]
        self._packed_next = 0
        self._ready, self._free = [], []
        # streamed layers are counted across forwards: position ``_base + j`` is the current
        # forward's j-th streamed layer and uses slot position % slots; uploads are queued up to
        # position ``_queued`` (exclusive)
        self._base = self._queued = 0
        self._staging = []                     # [host buffer, event of its last upload or None]
        self.chunk = staging_chunk(layout)     # elements per staging buffer
        self._stage_next = 0
        self.check_finite = check_finite
        self._unchecked = set(range(self.n_layers)) if check_finite else set()
        self._checks = []                      # (layer, {name: 0-d bool on the device}) of this forward
        self._upload_hooks = collections.OrderedDict()  # what ``register_upload_hook`` added (a handle needs a weakref)
        self.patch = None                      # the weight patches applied on the device (``set_patch``)
        self._patched = set()                  # resident layers whose buffer holds ``patch``'s values
        self.uploads = UploadThread(self.device, self.copy_stream)  # every upload runs there, in queue order
        self._slot_job = {}                    # slot -> the upload into it that the next layer there waits for
        self._promoting = {}                   # layer -> (its upload, event after it), until the layer runs

    # -- host side -------------------------------------------------------------------------

    @property
    def master_bytes(self) -> int:
        """Host bytes of one master (a compressed one is sized for the most exceptions it may hold)."""
        return compression.bound(self.layout.numel) if self.compress else self.layout.nbytes

    def _make_master(self, i, dst=None, plain=False) -> bool:
        """Pack layer i into a master from the pool, if it has room: compressed where the streamer
        compresses and the layer's weights allow it (then ``dst``, where given, holds the layer
        too: it was encoded from there), else (or with ``plain``) plain."""
        if self.compress and not plain:
            buf, codes = self._encode(i, dst)
            if buf is None:
                return False
            if codes is not None:
                self.host[i], self.codes[i] = buf, codes
                if self.cuda:  # made here, where the encode waits for the device anyway: a table's
                    # upload from pageable memory waits for its stream, which at upload time is busy
                    self._runs[i] = [(run, compression.table(run, self.device)) for run in compression.groups(codes)]
                self.layout.drop(self.sources[i])
                return True
            self.pool.free(buf)  # too many exceptions for the bound: a plain master
        buf = self.pool.allocate(self.layout.numel, self.layout.dtype)
        if buf is None:
            return False
        try:
            self.layout.fill(buf, self.sources[i])
        except BaseException:  # an interrupt or a file that changed: no half-filled master stays
            self.pool.free(buf)
            raise
        self.host[i] = buf
        self.layout.drop(self.sources[i])
        return True

    def _encode(self, i, dst=None) -> tuple:
        """Layer i compressed into a master from the pool (allocated and pinned while the first read
        runs), a staging buffer at a time: read from its source (on the reading thread, the next
        buffer while this one is encoded), copied to the device (into ``dst`` where given, which
        then holds the layer), encoded there a chunk at a time (a CPU takes seconds a layer), the
        bytes copied back. Returns (the master, its chunks): (None, None) where the pool has no
        room, chunks None where one has more exceptions than the master was sized for."""
        self._make_staging()
        ring = [host for host, _ in self._staging]
        for _, done in self._staging:
            if done is not None:
                done.synchronize()  # its last upload has left it
        per = max(compression.CHUNK, self.chunk // compression.CHUNK * compression.CHUNK)  # whole chunks a buffer
        inference = torch.is_inference_mode_enabled()  # per thread: the ring may be inference tensors
        spans = [(start, min(per, self.layout.numel - start)) for start in range(0, self.layout.numel, per)]

        def read(k):
            start, n = spans[k]
            with torch.inference_mode(inference):
                part = ring[k % len(ring)][:n].zero_()  # the gaps between matrices too: garbage there would be exceptions
                self.layout.fill(part, self.sources[i], start)
            return part

        chunks, offset = [], 0
        pending = _READER.submit(read, 0)
        buf = self.pool.allocate(self.master_bytes, torch.uint8)
        try:
            if buf is None:
                return None, None
            for k, (start, n) in enumerate(spans):
                part, pending = pending.result(), None
                ahead = k + 1 < len(spans)
                if ahead and len(ring) > 1:  # into the other buffer while this one crosses
                    pending = _READER.submit(read, k + 1)
                on_device = part.to(self.device) if dst is None else dst[start:start + n].copy_(part)
                if ahead and pending is None:  # one buffer only: free once it has crossed
                    pending = _READER.submit(read, k + 1)
                begin = time.perf_counter()
                for a, m in compression.pieces(n):
                    base, n_exc, packed = compression.encode(on_device[a:a + m])
                    if n_exc > compression.max_exceptions(m):
                        return buf, None
                    buf[offset:offset + packed.numel()].copy_(packed)
                    chunks.append(compression.Chunk(start + a, m, offset, n_exc, base))
                    offset += packed.numel()
                self.encode_seconds += time.perf_counter() - begin  # the copies back waited for the encode
        except BaseException:  # an interrupt or a file that changed: no half-filled master stays
            if buf is not None:
                self.pool.free(buf)
            raise
        finally:
            if pending is not None:
                pending.exception()  # no read into the ring outlives this call
        return buf, tuple(chunks)

    def _plain(self, i):
        """Layer i's compressed master, decoded into a plain one (a patch writes into it)."""
        self.synchronize()  # no upload reads the compressed master any more
        buf = self.pool.allocate(self.layout.numel, self.layout.dtype)
        if buf is None:
            buf = torch.empty(self.layout.numel, dtype=self.layout.dtype)
        compression.decode_all(self.codes[i], self.host[i], buf)
        self.pool.free(self.host[i])
        self.host[i], self.codes[i], self._runs[i] = buf, None, None

    def ensure_host(self, i):
        """A plain packed host master for layer i even past the budget (then pageable memory): a
        patched layer cannot be re-read from its source, and a patch writes into it (never a
        compressed one, where the streamer compresses: its bytes are codes)."""
        if self.codes[i] is not None:
            self._plain(i)
        if self.host[i] is None and not self._make_master(i, plain=True):
            buf = torch.empty(self.layout.numel, dtype=self.layout.dtype)
            self.layout.fill(buf, self.sources[i])
            self.host[i] = buf

    @property
    def pinned_layers(self) -> int:
        return sum(h is not None and self.pool.holds(h) for h in self.host)

    @property
    def master_layers(self) -> int:
        return sum(h is not None for h in self.host)

    def _upload(self, i, dst, master=True):
        """Layer i into ``dst``: from its host master, or without one from its source. With
        ``master`` (a streamed layer) the layer first gets a master if it keeps them and the pool
        has room."""
        if self.host[i] is None and master and self.masters and self.master_layers < self.n_streamed - self.from_file:
            self._read_ahead_next(i)
            if self._make_master(i, dst) and self.codes[i] is not None:
                return  # encoded from ``dst``, which holds the layer already
        if self.codes[i] is not None:
            return self._decode(i, dst)
        elif self.host[i] is not None:
            dst.copy_(self.host[i], non_blocking=self.cuda)
        elif self.pinned_sources or not (self.cuda or master):  # (on the CPU: a resident layer's buffer is its host copy)
            self.layout.fill(dst, self.sources[i], pinned=self.pinned_sources)
        else:
            self._stage(i, dst)

    def _decode(self, i, dst):
        """Layer i from its compressed master into ``dst``: on a GPU each run of chunks
        (``compression.groups``) crosses into the next of ``compression.BUFFERS`` device buffers on
        the copy stream and is decoded on the decode stream, so the next runs cross while this one is
        decoded. Returns the decode stream, where the layer is done (the slot's ready event is
        recorded there): the copy stream goes on to the next upload without waiting for the last
        decode."""
        if not self.cuda:
            compression.decode_all(self.codes[i], self.host[i], dst)
            return
        if not self._packed:
            self._packed = [[torch.empty(compression.GROUP_BYTES, dtype=torch.uint8, device=self.device),
                             torch.cuda.Event()] for _ in range(compression.BUFFERS)]
        for run, rows in self._runs[i]:
            packed, decoded = self._packed[self._packed_next]
            self._packed_next = (self._packed_next + 1) % len(self._packed)
            start, nbytes = run[0].offset, sum(c.nbytes for c in run)
            self.copy_stream.wait_event(decoded)  # the decode from this buffer has finished
            packed[:nbytes].copy_(self.host[i][start:start + nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.decode_stream.wait_event(copied)
            with torch.cuda.stream(self.decode_stream):
                compression.decode_run(packed[:nbytes], run, dst, rows)
            decoded.record(self.decode_stream)
        return self.decode_stream

    def staging_due(self) -> int:
        """Host bytes the staging ring takes when it is made (0 once it is)."""
        return 0 if self._staging else staging_bytes(self.layout)

    def staging_buffer(self) -> torch.Tensor:
        """A staging buffer (made if there is none yet)."""
        self.synchronize()  # the ring is the upload thread's
        self._make_staging()
        return self._staging[0][0]

    def _make_staging(self):
        if not self._staging:
            for _ in range(STAGING_BUFFERS):
                buf = self.pool.allocate(self.chunk, self.layout.dtype)
                if buf is None:
                    break
                self._staging.append([buf, torch.cuda.Event() if self.cuda else None])
            if not self._staging:
                self._staging.append([torch.empty(self.chunk, dtype=self.layout.dtype), None])

    def _stage(self, i, dst):
        """Upload layer i from its source through the staging buffers, a chunk at a time: pinned ones
        when the pool has room (the read into one runs while the others' uploads are on the bus),
        else one pageable buffer and synchronous copies (always on the CPU)."""
        self._make_staging()
        for start in range(0, self.layout.numel, self.chunk):
            buf, done = self._staging[self._stage_next]
            self._stage_next = (self._stage_next + 1) % len(self._staging)
            if done is not None:
                done.synchronize()  # its previous upload has left it
            n = min(self.chunk, self.layout.numel - start)
            self.layout.fill(buf[:n], self.sources[i], start)
            if done is None:
                dst[start:start + n].copy_(buf[:n])
            else:
                dst[start:start + n].copy_(buf[:n], non_blocking=True)
                done.record(torch.cuda.current_stream(self.device))

    def _read_ahead_next(self, i):
        """While layer i gets its master (the first forward), the OS reads the next streamed layer
        from the disk, so the reads go on while layer i is pinned and encoded."""
        j = self._index.get(i)
        if j is not None and j + 1 < len(self.streamed):
            self._read_ahead(self.streamed[j + 1])

    def _read_ahead(self, i):
        if self.host[i] is None:
            self.layout.advise(self.sources[i])

    # -- device side -----------------------------------------------------------------------

    @property
    def n_resident(self) -> int:
        return len(self.resident)

    @property
    def n_streamed(self) -> int:
        return self.n_layers - self.n_resident

    @property
    def device_bytes(self) -> int:
        return (self.n_resident + len(self.slots)) * self.layout.nbytes + len(self._packed) * compression.GROUP_BYTES

    def _empty(self):
        return torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.device)

    def configure(self, n_resident: int, n_slots: int, from_file: int | None = None, compress: bool | None = None):
        """Make the first ``n_resident`` layers of ``residency_order`` resident with ``n_slots``
        slots for the rest (0 slots: only the resident layers stay on the device, as when the
        model is offloaded). Frees before it allocates, so a shrinking split never needs extra
        memory. ``from_file``: streamed layers left without a master (the planner's page-cache
        layers; masters made before stay, and a layer evicted later may get one), None: as before.
        ``compress``: whether masters made from now on are compressed, where the streamer can
        (those made before stay as they are), None: as before."""
        if from_file is not None:
            self.from_file = from_file
        if compress is not None:
            self.compress = compress and self.can_compress
        n_resident = max(0, min(n_resident, self.n_layers))
        n_slots = 0 if n_resident == self.n_layers or n_slots == 0 else min(n_slots, self.n_layers - n_resident)
        keep = set(self.order[:n_resident])
        self.synchronize()
        for i in [i for i in self.resident if i not in keep]:
            del self.resident[i]
            self._promoting.pop(i, None)
            self._patched.discard(i)
        del self.slots[n_slots:]
        del self._ready[n_slots:], self._free[n_slots:]
        if not n_slots:
            self._packed = []  # the decode's buffers serve the streamed layers (a promotion makes them again)
        self.streamed = [i for i in range(self.n_layers) if i not in keep]
        self._index = {i: j for j, i in enumerate(self.streamed)}
        self.drop_queued()
        while len(self.slots) < n_slots:
            self.slots.append(self._empty())
            if self.cuda:
                self._ready.append(torch.cuda.Event())
                self._free.append(torch.cuda.Event())
        for i in sorted(keep - self.resident.keys()):
            self._make_resident(i)

    def _make_resident(self, i, buf=None):
        """Layer i resident with its own values: on the CPU a plain host master is the layer (no
        second copy); else ``buf`` (default: a new device buffer), filled by a queued upload."""
        if not self.cuda and self.host[i] is not None and self.codes[i] is None:
            self.resident[i] = self.host[i]
            return
        self._read_ahead(i)
        buf = self._empty() if buf is None else buf
        self.resident[i] = buf
        self._promoting[i] = self._promote(i, buf)

    def _promote(self, i, buf):
        """Queue layer i's upload into its resident buffer (no host copy: it stays in its source);
        the forward that first runs it waits for it, so the uploads overlap the layers before."""
        ready = torch.cuda.Event() if self.cuda else None
        return self._submit_upload(functools.partial(self._upload, i, buf, master=False), ready), ready

    def _submit_upload(self, upload, ready, after=None):
        """Queue ``upload()`` on the upload thread: on a GPU after event ``after`` (the last user of
        its destination has finished), with event ``ready`` recorded once it is on the copy stream
        (or on the stream ``upload()`` returns, where it finishes: a decode's)."""
        def job():
            if after is not None:
                self.copy_stream.wait_event(after)
            done_on = upload()
            if ready is not None:
                ready.record(done_on or self.copy_stream)
        return self.uploads.submit(job)

    def release(self):
        """Drop every device buffer, host master and staging buffer (pinned memory goes back to
        the OS)."""
        self.uploads.shutdown()
        self._promoting.clear()
        self.synchronize()
        self.resident.clear()
        self._patched.clear()
        self.patch = None
        self.slots.clear()
        self._ready.clear(), self._free.clear()
        self.drop_queued()
        self.host = [None] * self.n_layers
        self.codes = [None] * self.n_layers
        self._runs = [None] * self.n_layers
        self._packed = []
        self._staging, self._stage_next = [], 0
        self.pool.release_all()

    def synchronize(self):
        """Until every queued upload has reached the device (and the device is idle)."""
        self.uploads.wait()
        if self.cuda:
            self.copy_stream.synchronize()
            if self.decode_stream is not None:
                self.decode_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    # -- running ---------------------------------------------------------------------------

    def drop_queued(self):
        """Forget uploads queued ahead for the next forward (its split or its weights changed):
        it queues its own. What is still running is waited for: a slot is written by one upload at
        a time."""
        self.uploads.wait(quiet=True)
        self._slot_job.clear()
        self._base = self._queued = 0

    def register_upload_hook(self, hook) -> RemovableHandle:
        """``hook(layer, upload)`` runs in place of each upload into a slot (on the copy stream, on a
        GPU) and performs it by calling ``upload()``, returning what that returns: benchmarks time
        it or skip it (to time the compute alone), tests count it. ``handle.remove()`` takes the
        hook away."""
        handle = RemovableHandle(self._upload_hooks)
        self._upload_hooks[handle.id] = hook
        return handle

    def _prefetch(self, i, k):
        upload = functools.partial(self._upload, i, self.slots[k])
        for hook in self._upload_hooks.values():
            upload = functools.partial(hook, i, upload)
        events = (self._ready[k], self._free[k]) if self.cuda else (None, None)
        self._slot_job[k] = self._submit_upload(upload, *events)

    def _queue(self, pos):
        """Queue the upload of streamed position ``pos`` (this forward's or, past its end, the
        next one's) into its slot."""
        self._prefetch(self.streamed[(pos - self._base) % self.n_streamed], pos % len(self.slots))
        self._queued = pos + 1
        self._read_ahead(self.streamed[(pos + 1 - self._base) % self.n_streamed])

    def prefetch_first(self):
        """Start the uploads of the first streamed layers that are not queued yet; they overlap
        the layers before them. Call it after the forward's inputs are on the device: a small
        host-to-device copy queued after layer uploads waits for all of them."""
        k = min(len(self.slots), self.n_streamed)
        for pos in range(max(self._queued, self._base), self._base + k):
            self._queue(pos)

    def run_layers(self, x, layer_fn, blocks=None, next_forward=False):
        """x -> layer_fn(i, x, BigWeights) for the layers in ``blocks`` (a range; default all), in
        order: a forward runs every layer once, in one call or in consecutive ranges. With
        ``next_forward`` (another forward follows with nothing to send to the device first; give it
        alike to every range of a forward) the slots freed by the last layers are refilled with the
        next forward's first layers."""
        blocks = range(self.n_layers) if blocks is None else blocks
        try:
            for i in blocks:
                x = layer_fn(i, x, self.begin(i))
                self.end(i, next_forward)
            if blocks and blocks[-1] == self.n_layers - 1:
                self._verify()
                if self.patch is not None:
                    self.patch.verify()
        except BaseException:
            self.drop_queued()  # stopped mid-forward: the next one starts from its first layer
            self._checks.clear()
            raise
        return x

    def recheck(self, i):
        """Layer i's weights changed (``set_weight``): check them again when they next run."""
        if self.check_finite:
            self._unchecked.add(i)

    def set_patch(self, patch):
        """Weight patches for the next forwards, or None. ``patch.layers``: the layers it changes;
        ``patch.apply(i, views)`` writes layer i's patched matrices into ``views`` (its buffer, on
        the device) in place, with kernels queued on the current stream; ``patch.verify()`` runs
        at the end of each forward (it reads what it checked, and may raise). The resident layers
        the previous patch wrote are uploaded again from their masters or sources (the first
        forward waits for each where it begins), so that every layer starts from its own values."""
        self.synchronize()
        for i in self._patched:
            self._make_resident(i, self.resident[i])
        self._patched.clear()
        self.patch = patch

    def _verify(self):
        """Read the checks this forward queued (one wait for the device, once per layer ever)."""
        if not self._checks:
            return
        checks, self._checks = self._checks, []
        flags = torch.stack([f for _, named in checks for f in named.values()]).cpu().tolist()
        for layer, named in checks:
            for name in named:
                if not flags.pop(0):
                    raise NonFiniteWeights(layer, name)
            self._unchecked.discard(layer)

    def begin(self, i):
        """Layer i's weights, ready for the kernels queued next on the current stream."""
        if i in self.resident:
            if i in self._promoting:
                job, ready = self._promoting.pop(i)
                self._await(job, ready)
            views = self.layout.views(self.resident[i])
        else:
            s = (self._base + self._index[i]) % len(self.slots)
            if s not in self._slot_job:  # not queued ahead (an earlier range of this forward did not look ahead)
                self._prefetch(i, s)
            self._await(self._slot_job.pop(s), self._ready[s] if self.cuda else None)
            views = self.layout.views(self.slots[s])
        if i in self._unchecked:  # the layer's own values (a patch checks its results itself)
            named = views._asdict() if isinstance(views, tuple) else views
            self._checks.append((i, {name: all_finite(v) for name, v in named.items()}))
        if self.patch is not None and i in self.patch.layers and i not in self._patched:
            if i in self.resident:
                if self.resident[i] is self.host[i]:  # on the CPU the master is the layer: patch a copy
                    self.resident[i] = self.host[i].clone()
                    views = self.layout.views(self.resident[i])
                self._patched.add(i)
            self.patch.apply(i, views)
        return views

    def _await(self, job, ready):
        """The current stream's next kernels run after the upload ``job`` (its failure is raised here)."""
        job.result()
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def end(self, i, next_forward=False):
        """Layer i's kernels are queued: its slot is refilled with the streamed layer k places on
        (in this forward, or with ``next_forward`` in the next) once they finish. The last layer
        ends the forward."""
        if i not in self.resident:
            k = len(self.slots)
            pos = self._base + self._index[i]
            if self.cuda:
                self._free[pos % k].record(torch.cuda.current_stream(self.device))
            if pos + k < self._base + (2 if next_forward else 1) * self.n_streamed:
                self._queue(pos + k)
        if i == self.n_layers - 1:
            self._base += self.n_streamed

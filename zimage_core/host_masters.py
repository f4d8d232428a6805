"""The host side of a layer stream: where each layer's bytes come from for an upload.

A layer's five big matrices come from its source (the checkpoint file, or another model's own
tensors). A streamed layer that the plan names (``HostMasters.plan``) gets one host master at its
first upload: a packed buffer taken from a ``HostPool`` (pinned on CUDA) when the host budget has
room for it, so loading pins nothing and the first forward pins as it goes. Where the stream
compresses, a bf16 master is stored compressed (``compression``: about 0.75 of the bytes) and
decoded on the device at every upload, bit for bit. A layer without a master (resident layers,
and streamed layers the plan leaves in the page cache or past the budget) is read from its source
a chunk at a time into a ring of small pinned staging buffers, each read overlapping the upload
from the other; no weight is held in host memory twice. Before the uploads that read a source,
threads read its layers into the page cache ahead of them (``read_ahead``), so that the disk does
not wait for the uploads. Masters and sources are never written for a weight patch (``streamer``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import torch

from . import compression
from .host_memory import BUDGET, HostPool
from .layout import ALIGN, STAGING_BUFFERS, StreamConfig, staging_bytes, staging_chunk
from .read_ahead import ReadAhead

def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def dequantize_into(blocks: dict, layout, dst: torch.Tensor):
    """A quantized layer's matrices ({name: GGUFTensor}, on ``dst``'s device) dequantized into the
    packed layer ``dst`` (the CPU's path, and the device's once its bytes have crossed)."""
    for name, t in blocks.items():
        layout.region(dst, name).copy_(t.values(dst.dtype))


# a master's encode reads the next staging buffer from the file on this thread while the device
# encodes the last one (one thread: the reads themselves run on the file's reader threads)
_READER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zimage-prefill")


class HostMasters:
    def __init__(self, config: StreamConfig, sources: list, pool: HostPool):
        """``sources[i]`` is layer i's {name: [(row, tensor or StoredTensor)]} pieces."""
        self.config, self.layout, self.sources, self.pool = config, config.layout, sources, pool
        self.device = config.device
        n = len(sources)
        self.compress = config.can_compress  # whether new masters are compressed: the plan's (``plan``)
        self.wanted = None                   # layers that get a master at their first upload; None: every streamed one
        self.host = [None] * n               # packed host masters (pinned where possible)
        self.codes = [None] * n              # the chunks of the masters stored compressed
        self.runs = [None] * n               # their runs and tables on the device (``streamer``'s decode)
        self.blocks = [None] * n             # a quantized master's matrices: {name: GGUFTensor} views of it
        self.on_device = [None] * n          # a quantized layer's matrices kept on the device (``keep_on_device``)
        self._unfilled = set()               # of those, the ones no upload has copied there yet
        # a quantized stream's layers as stored (their blocks' bytes, each matrix aligned)
        self.stored_bytes = [sum(_aligned(p.tensor.data.numel()) for parts in src.values() for _, p in parts)
                             for src in sources] if config.quantized else None
        self.encode_seconds = 0.0            # spent encoding masters (what compression adds to a first image)
        self._staging = []                   # [host buffer, event of its last upload or None]
        self.chunk = staging_chunk(self.layout)  # elements per staging buffer
        self._stage_next = 0
        self._parts = None                   # each layer's reads into the page cache (``read_ahead``)
        self._ahead = None                   # the reads ahead of the uploads, once started

    def plan(self, wanted: frozenset | None = None, compress: bool | None = None):
        """The layers that get a master at their first upload as a streamed layer (None: as before;
        masters made before stay), and whether masters made from now on are compressed, where the
        stream can (None: as before)."""
        if wanted is not None:
            self.wanted = frozenset(wanted)
        if compress is not None:
            self.compress = compress and self.config.can_compress

    @property
    def master_bytes(self) -> int:
        """Host bytes of one master (a compressed one is sized for the most exceptions it may hold,
        a quantized one for the largest layer's blocks)."""
        if self.stored_bytes:
            return max(self.stored_bytes)
        return compression.bound(self.layout.numel) if self.compress else self.layout.nbytes

    def plain(self, i) -> bool:
        """Layer i has a plain packed master (the layer's values, as a slot holds them)."""
        return self.host[i] is not None and self.codes[i] is None and self.blocks[i] is None

    def reads_source(self, i) -> bool:
        """An upload of layer i now reads its source: it has no master, and no blocks on the device
        that an earlier upload filled."""
        return self.host[i] is None and (self.on_device[i] is None or i in self._unfilled)

    def layer_blocks(self, i) -> dict:
        """A quantized layer's matrices as {name: GGUFTensor}, as an upload reads them: kept on the
        device (copied there at the first upload that reads them, on its stream), else
        ``stored_blocks``."""
        kept = self.on_device[i]
        if kept is None:
            return self.stored_blocks(i)
        if i in self._unfilled:
            self._fill(kept, i, staged=self.blocks[i] is None)
            self._unfilled.discard(i)
        return kept

    def stored_blocks(self, i) -> dict:
        """A quantized layer's matrices as {name: GGUFTensor}: views of its host master, else of the
        file."""
        if self.blocks[i] is not None:
            return self.blocks[i]
        pieces = {name: parts[0][1] for name, parts in self.sources[i].items()}
        for file in {id(p.file): p.file for p in pieces.values()}.values():
            file.check_unchanged()  # a mapping of a file truncated since would kill the process
        return {name: p.tensor for name, p in pieces.items()}

    @property
    def pinned_layers(self) -> int:
        return sum(h is not None and self.pool.holds(h) for h in self.host)

    @property
    def master_layers(self) -> int:
        return sum(h is not None for h in self.host)

    def wants_master(self, i) -> bool:
        """Streamed layer i gets its master at this upload (not one whose blocks the device keeps)."""
        return (self.config.masters and self.host[i] is None and self.on_device[i] is None
                and (self.wanted is None or i in self.wanted))

    @property
    def blocks_on_device(self) -> int:
        return sum(b is not None for b in self.on_device)

    @property
    def device_bytes(self) -> int:
        """Device bytes of the blocks kept there."""
        return sum(self.stored_bytes[i] for i, b in enumerate(self.on_device) if b is not None)

    def keep_on_device(self, layers):
        """The quantized blocks of ``layers`` (and no others) kept on the device in one buffer a
        layer, copied there once, by the first upload that reads them (on the upload thread, so a
        split that brings blocks back after another model took their room costs the next forward's
        uploads, not the caller): such a layer is dequantized into its slot from there as it comes,
        nothing crossing the bus (``planner``: a layer's blocks take a third to a half of its
        dequantized bytes). The others' buffers go first, so a smaller set needs no extra memory.
        The uploads must not be reading them (the caller has waited)."""
        layers = set(layers)
        for i in range(len(self.on_device)):
            if i not in layers:
                self.on_device[i] = None
                self._unfilled.discard(i)
        for i in sorted(layers):
            if self.on_device[i] is None:
                self.on_device[i] = self._laid_out(i, torch.empty(self.stored_bytes[i], dtype=torch.uint8,
                                                                  device=self.device))
                self._unfilled.add(i)

    def make_master(self, i, dst=None, plain=False) -> bool:
        """Pack layer i into a master from the pool, if it has room: compressed where the stream
        compresses and the layer's weights allow it (then ``dst``, where given, holds the layer
        too: it was encoded from there), else (or with ``plain``) plain."""
        if self.config.quantized and not plain:
            return self._keep_blocks(i)
        if self.compress and not plain:
            buf, codes = self._encode(i, dst)
            if buf is None:
                return False
            if codes is not None:
                self.host[i], self.codes[i] = buf, codes
                if self.config.cuda:  # made here, where the encode waits for the device anyway: a table's
                    # upload from pageable memory waits for its stream, which at upload time is busy
                    self.runs[i] = [(run, compression.table(run, self.device)) for run in compression.groups(codes)]
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

    def _keep_blocks(self, i) -> bool:
        """Layer i's quantized blocks copied into a master from the pool, if it has room."""
        buf = self.pool.allocate(self.stored_bytes[i], torch.uint8)
        if buf is None:
            return False
        try:
            blocks = self._laid_out(i, buf)
            self._fill(blocks, i)
        except BaseException:  # an interrupt or a file that changed: no half-filled master stays
            self.pool.free(buf)
            raise
        self.host[i], self.blocks[i] = buf, blocks
        return True

    def _laid_out(self, i, buf) -> dict:
        """Layer i's quantized matrices as {name: GGUFTensor} views of ``buf``, each aligned (not
        yet filled: ``_fill``)."""
        blocks, o = {}, 0
        for name, t in self.stored_blocks(i).items():
            blocks[name] = dataclasses.replace(t, data=buf[o:o + t.data.numel()])
            o += _aligned(t.data.numel())
        return blocks

    def _fill(self, blocks, i, staged=False):
        """``blocks`` (``_laid_out``'s views) filled with layer i's bytes from its master or the file
        (asynchronously from a pinned master). ``staged``: through the staging buffers, for blocks
        the device keeps that come from the file, whose mapping is pageable memory: a copy from
        there would hold the copy stream, and every upload queued behind it, until it was done."""
        for name, t in self.stored_blocks(i).items():
            if staged:
                self._through_staging(blocks[name].data, lambda buf, start, src=t.data:
                                      buf.copy_(src[start:start + buf.numel()]))
            else:
                blocks[name].data.copy_(t.data, non_blocking=t.data.is_pinned())

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

    def ensure_plain(self, i):
        """A plain packed host master for layer i even past the budget (then pageable memory), for a
        weight written into it (``set_weight``): never a compressed one, whose bytes are codes. No
        upload may be reading layer i's master (the caller has waited for them)."""
        if self.codes[i] is not None or self.blocks[i] is not None:
            buf = self.pool.allocate(self.layout.numel, self.layout.dtype)
            if buf is None:
                buf = torch.empty(self.layout.numel, dtype=self.layout.dtype)
            if self.codes[i] is not None:
                compression.decode_all(self.codes[i], self.host[i], buf)
            else:
                dequantize_into(self.blocks[i], self.layout, buf)
            self.pool.free(self.host[i])
            self.host[i], self.codes[i], self.runs[i], self.blocks[i] = buf, None, None, None
        self.on_device[i] = None  # the layer is its plain master's now
        self._unfilled.discard(i)
        if self.host[i] is None and not self.make_master(i, plain=True):
            buf = torch.empty(self.layout.numel, dtype=self.layout.dtype)
            self.layout.fill(buf, self.sources[i])
            self.host[i] = buf

    def copy_into(self, i, dst):
        """Layer i into ``dst`` from its plain master, or without one straight from its source
        (asynchronously where the sources are locked in place)."""
        if self.host[i] is not None:
            dst.copy_(self.host[i], non_blocking=self.config.cuda)
        else:
            self.layout.fill(dst, self.sources[i], pinned=self.config.pinned_sources)

    # -- staging ----------------------------------------------------------------------------

    def staging_due(self) -> int:
        """Host bytes the staging ring takes when it is made (0 once it is)."""
        return 0 if self._staging else staging_bytes(self.layout)

    def staging(self) -> torch.Tensor:
        """A staging buffer (made if there is none yet); the uploads must not be using the ring."""
        self._make_staging()
        return self._staging[0][0]

    def _make_staging(self):
        if not self._staging:
            for _ in range(STAGING_BUFFERS):
                buf = self.pool.allocate(self.chunk, self.layout.dtype)
                if buf is None:
                    break
                self._staging.append([buf, torch.cuda.Event() if self.config.cuda else None])
            if not self._staging:
                self._staging.append([torch.empty(self.chunk, dtype=self.layout.dtype), None])

    def stage(self, i, dst):
        """Upload layer i from its source through the staging buffers."""
        self._through_staging(dst, lambda buf, start: self.layout.fill(buf, self.sources[i], start))

    def _through_staging(self, dst, fill):
        """``dst`` (flat, on the device) filled a staging buffer at a time, ``fill(buf, start)``
        writing its elements from ``start`` on into ``buf`` (viewed in ``dst``'s dtype): pinned
        buffers when the pool has room (the read into one runs while the others' uploads are on the
        bus), else one pageable buffer and synchronous copies (always on the CPU)."""
        self._make_staging()
        per = self._staging[0][0].view(dst.dtype).numel()
        for start in range(0, dst.numel(), per):
            buf, done = self._staging[self._stage_next]
            self._stage_next = (self._stage_next + 1) % len(self._staging)
            if done is not None:
                done.synchronize()  # its previous upload has left it
            n = min(per, dst.numel() - start)
            part = buf.view(dst.dtype)[:n]
            fill(part, start)
            if done is None:
                dst[start:start + n].copy_(part)
            else:
                dst[start:start + n].copy_(part, non_blocking=True)
                done.record(torch.cuda.current_stream(self.device))

    def read_ahead(self, order):
        """Start reading the layers of ``order`` that an upload will read from their source into
        the page cache, on threads of their own (``ReadAhead``), where a stream makes masters (the
        transformer's); where reads are under way already, they follow this order from now on."""
        if not self.config.masters:
            return
        order = [i for i in order if self.reads_source(i)]
        if self._ahead is not None and self._ahead.reorder(order):
            return
        if order:
            if self._parts is None:
                self._parts = [self.layout.cache_parts(src) for src in self.sources]
            self._ahead = ReadAhead(self._parts, order, lambda: BUDGET.ram_room("read-ahead") // 2, self)

    def reading(self, i):
        """An upload reads layer i now (what was read ahead of it is no longer ahead)."""
        if self._ahead is not None:
            self._ahead.reading(i)

    def stop_reading(self):
        """The reads ahead stop (returns once those in flight are done)."""
        if self._ahead is not None:
            self._ahead.stop()

    def release(self):
        """Drop every master and staging buffer (pinned memory goes back to the OS); the reads
        ahead stop."""
        self.stop_reading()
        n = len(self.sources)
        self.host, self.codes, self.runs, self.blocks = [None] * n, [None] * n, [None] * n, [None] * n
        self.on_device, self._unfilled = [None] * n, set()
        self._staging, self._stage_next = [], 0
        self.pool.release_all()

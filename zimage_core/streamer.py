"""The device schedule of a layer stream: every block with big matrices (the refiners and the main
layers, in the order a forward runs them), some resident on the device, spread through the stack
(``residency_order`` says why), the others uploaded into a ring of device slots as the forward reaches them. Where each upload's
bytes come from is the host side's (``host_masters``).

Every upload (into a slot, or of a layer promoted to resident) runs on the stream's
``UploadThread``, in the order it was queued; a layer waits for its own upload where it begins.
The first ``n_resident`` layers of ``residency_order`` have a packed device buffer; the others are
uploaded, one copy per layer, into the slots on a dedicated copy stream (of a quantized stream,
the next ``blocks`` of that order keep their blocks on the device and are only dequantized into
their slot), ordered with events: a
slot is refilled only after the layer that used it has finished, and a layer runs only after its
upload. While a forward's last layers run, the next forward's first uploads can already be queued
(``run_layers(..., next_forward=True)``), so the copy engine does not idle between steps. Uploads
go host -> device only, so evicting a resident layer just drops its device buffer and promoting
one is a single upload. Every buffer has the same layout, so a matrix is the same view of the same
shape and alignment whichever buffer it lives in: the kernels, and therefore the bits, do not
depend on the split or on where a layer came from. On the CPU the same code runs with plain
tensors and synchronous copies.

Weight patches (a LoRA: ``set_patch``) are applied on the device, to the layer's buffer just
before it runs: into a slot after every upload, into a resident buffer once. Host masters and
sources are never written for a patch; a patched resident layer is restored by uploading it
again from its master or source when the patch goes. Others watch from outside: observers
(``observe``: the finiteness checks) see each layer's own values as it begins and the end of each
forward; upload hooks (``register_upload_hook``: benchmarks, tests) wrap each upload into a slot.

"""
from __future__ import annotations

import collections
import functools

import torch
from torch.utils.hooks import RemovableHandle

from . import compression
from .device_decode import DeviceDecode
from .host_masters import HostMasters, dequantize_into
from .host_memory import HostPool
from .layout import StreamConfig, kept_as_blocks, residency_order
from .uploads import UploadThread


class LayerStreamer:
    def __init__(self, config: StreamConfig, sources: list, pool: HostPool):
        """``sources[i]`` is layer i's {name: [(row, tensor or StoredTensor)]} pieces (``HostMasters``)."""
        self.config, self.layout, self.device = config, config.layout, config.device
        self.cuda = config.cuda
        self.masters = HostMasters(config, sources, pool)
        self.pool = pool
        self.n_layers = len(sources)
        self.order = residency_order(self.n_layers)
        self.resident = {}                     # layer -> packed device buffer
        self.streamed = list(range(self.n_layers))  # the other layers, in the order they run
        self._index = {i: j for j, i in enumerate(self.streamed)}  # layer -> its place in streamed
        self.slots = []
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.decode = (DeviceDecode(self.device, self.copy_stream)
                       if self.cuda and (config.can_compress or config.quantized) else None)
        self._ready, self._free = [], []
        # streamed layers are counted across forwards: position ``_base + j`` is the current
        # forward's j-th streamed layer and uses slot position % slots; uploads are queued up to
        # position ``_queued`` (exclusive)
        self._base = self._queued = 0
        self._observers = []                   # what ``observe`` added
        self._upload_hooks = collections.OrderedDict()  # what ``register_upload_hook`` added (a handle needs a weakref)
        self.patch = None                      # the weight patches applied on the device (``set_patch``)
        self._patched = set()                  # resident layers whose buffer holds ``patch``'s values
        self.uploads = UploadThread(self.device, self.copy_stream)  # every upload runs there, in queue order
        self._slot_job = {}                    # slot -> the upload into it that the next layer there waits for
        self._promoting = {}                   # layer -> (its upload, event after it), until the layer runs
        # uploads so far that read their layer from its source rather than a master (through the
        # staging ring from the page cache or the disk, or from pages locked in place), a master made
        # on the way included: what a sample's first step waits for when borrowed layers come back
        self.source_uploads = 0

    @property
    def n_resident(self) -> int:
        return len(self.resident)

    @property
    def n_streamed(self) -> int:
        return self.n_layers - self.n_resident

    @property
    def device_bytes(self) -> int:
        return ((self.n_resident + len(self.slots)) * self.layout.nbytes + self.masters.device_bytes
                + (self.decode.device_bytes if self.decode else 0))

    def _empty(self):
        return torch.empty(self.layout.numel, dtype=self.layout.dtype, device=self.device)

    @property
    def split(self) -> tuple:
        """(resident layers, slots, layers keeping their blocks on the device): ``configure``'s."""
        return self.n_resident, len(self.slots), self.masters.blocks_on_device

    def configure(self, n_resident: int, n_slots: int, blocks: int = 0, masters: frozenset | None = None,
                  compress: bool | None = None):
        """Make the first ``n_resident`` layers of ``residency_order`` resident with ``n_slots``
        slots for the rest (0 slots: only the resident layers stay on the device, as when the
        model is offloaded); of a quantized stream, the next ``blocks`` keep their blocks on the
        device (``HostMasters.keep_on_device``). Frees before it allocates, so a shrinking split
        never needs extra memory. ``masters`` and ``compress``: which streamed layers get host
        masters and whether new ones are compressed (``HostMasters.plan``; None: as before)."""
        self.masters.plan(masters, compress)
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
        self.masters.keep_on_device(kept_as_blocks(self.n_layers, n_resident, blocks) if self.config.quantized else ())
        if not n_slots and self.decode:
            self.decode.drop()  # its buffers serve the streamed layers (a promotion makes them again)
        self.streamed = [i for i in range(self.n_layers) if i not in keep]
        self._index = {i: j for j, i in enumerate(self.streamed)}
        self.drop_queued()
        # the order the uploads read their layers in: the new resident ones (queued below), then
        # the streamed ones as the next forward reaches them
        self.masters.read_ahead(sorted(keep - self.resident.keys()) + self.streamed)
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
        m = self.masters
        if not self.cuda and m.plain(i):
            self.resident[i] = m.host[i]
            return
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

    def staging_buffer(self) -> torch.Tensor:
        """A staging buffer of the host side (made if there is none yet)."""
        self.synchronize()  # the ring is the upload thread's
        return self.masters.staging()

    def release(self):
        """Drop every device buffer, host master and staging buffer (pinned memory goes back to
        the OS)."""
        self.close()
        self.masters.release()

    def close(self):
        """Stop the upload thread and drop every device buffer, leaving the host pool as it is (the
        other streamers of a transformer that spans cards share it); the reads ahead stop."""
        self.masters.stop_reading()
        self.uploads.shutdown()
        self._promoting.clear()
        self.synchronize()
        self.resident.clear()
        self._patched.clear()
        self.patch = None
        self.slots.clear()
        self._ready.clear(), self._free.clear()
        self.drop_queued()
        if self.decode:
            self.decode.drop()

    def synchronize(self):
        """Until every queued upload has reached the device (and the device is idle)."""
        self.uploads.wait()
        if self.cuda:
            self.copy_stream.synchronize()
            if self.decode:
                self.decode.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    # -- uploads ----------------------------------------------------------------------------

    def _upload(self, i, dst, master=True):
        """Layer i into ``dst``: from its host master, or without one from its source. With
        ``master`` (a streamed layer) the layer first gets a master where the plan gives it one
        and the pool has room."""
        m = self.masters
        m.reading(i)
        if master and m.wants_master(i):
            made = m.make_master(i, dst)
            self.source_uploads += made  # its master was read from the source
            if made and m.codes[i] is not None:
                return  # encoded from ``dst``, which holds the layer already
        self.source_uploads += m.reads_source(i)
        if m.codes[i] is not None:
            return self._decode(i, dst)
        if self.config.quantized and not m.plain(i):  # its blocks, from its master or the file
            return self._dequantize(m.layer_blocks(i), dst)
        if m.host[i] is not None or self.config.pinned_sources or not (self.cuda or master):
            m.copy_into(i, dst)  # (on the CPU: a resident layer's buffer is its host copy)
        else:
            m.stage(i, dst)

    def _decode(self, i, dst):
        """Layer i from its compressed master into ``dst``: on a GPU through ``DeviceDecode`` (returns
        the stream where the layer is done), on the CPU here."""
        m = self.masters
        if not self.cuda:
            compression.decode_all(m.codes[i], m.host[i], dst)
            return
        return self.decode.upload(m.host[i], m.runs[i], dst)

    def _dequantize(self, blocks, dst):
        """A quantized layer's blocks into ``dst``: on a GPU through ``DeviceDecode`` (returns the
        stream where the layer is done), on the CPU here."""
        if not self.cuda:
            dequantize_into(blocks, self.layout, dst)
            return
        return self.decode.dequantize(blocks, self.layout, dst)

    # -- running ---------------------------------------------------------------------------

    def drop_queued(self):
        """Forget uploads queued ahead for the next forward (its split or its weights changed):
        it queues its own. What is still running is waited for: a slot is written by one upload at
        a time."""
        self.uploads.wait(quiet=True)
        self._slot_job.clear()
        self._base = self._queued = 0

    def observe(self, observer):
        """``observer.layer_ready(i, views)`` runs as each layer begins, on its own values (before a
        patch); ``observer.forward_done()`` after a forward's last layer (it may raise), and
        ``observer.forward_stopped()`` where a forward stopped before its end."""
        self._observers.append(observer)

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
                for observer in self._observers:
                    observer.forward_done()
                if self.patch is not None:
                    self.patch.verify()
        except BaseException:
            self.drop_queued()  # stopped mid-forward: the next one starts from its first layer
            for observer in self._observers:
                observer.forward_stopped()
            raise
        return x

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
        for observer in self._observers:
            observer.layer_ready(i, views)
        if self.patch is not None and i in self.patch.layers and i not in self._patched:
            if i in self.resident:
                if self.resident[i] is self.masters.host[i]:  # on the CPU the master is the layer: patch a copy
                    self.resident[i] = self.masters.host[i].clone()
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

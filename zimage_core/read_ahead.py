"""A model's first reads begun before its first forward: threads that read its layers from their
files into the page cache, in the order the uploads will read them, while the rest of the prompt
runs (ComfyUI loads the text encoder and the VAE, the prompt is encoded, the split is planned).

Where the checkpoint is not in the page cache, the first image waits on the disk: the first step
reads every layer. Read only as the uploads reach them, the disk idles while the prompt is encoded
and between the uploads' reads; read ahead, it works from the moment the model loads until every
layer is in. The kernel's own hint (POSIX_FADV_WILLNEED) reads one read-ahead window a call
(128 KiB to a few MiB), not a layer of hundreds of MB, so the layers are read here, a piece at a
time into a scratch buffer, skipping pieces the page cache holds already.

What is read ahead sits in the page cache until an upload reads it (then the master made from it
drops it, or a resident layer keeps it there to come back from). So the reads stay at most
``room()`` bytes ahead of the uploads: half the RAM the host budget leaves (``HostBudget``), so
that pages read ahead are not pushed out by the pinned masters before their upload comes.
"""
from __future__ import annotations

import threading
import weakref

from .safetensors_file import READ_PIECE

# reads in flight: more than one keeps the disk busy while a reader is between pieces (on the disk
# measured, a virtual one, 1 to 32 readers read alike: 1.2-1.7 GB/s)
READERS = 4


class ReadAhead:
    def __init__(self, parts: list, order, room, owner):
        """``parts[i]``: layer i's reads, [(bytes, read(scratch))] (``PackLayout.cache_parts``);
        ``order``: the layers to read, first first; ``room()``: the bytes the reads may be ahead of
        the uploads now; ``owner``: what the reads are for (they stop once it is gone)."""
        self._parts, self._room, self._owner = parts, room, weakref.ref(owner)
        self._sizes = [sum(n for n, _ in p) for p in parts]
        self._order = list(order)
        self._taken = set()     # layers read ahead, or read by an upload before the reads came to them
        self._ahead = {}        # layer -> its bytes: read ahead, not yet read by an upload
        self._pending = []      # the pieces of the layer being read ahead
        self._current = None
        self._stopped = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._work, name="zimage-read-ahead", daemon=True)
                         for _ in range(READERS)]
        for t in self._threads:
            t.start()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def reorder(self, order) -> bool:
        """The layers still to read, in this order from now on; False where the reads have ended
        (nothing was left, or they stopped): then nobody reads them."""
        with self._cv:
            self._order = list(order)
            self._cv.notify_all()
            return not self._stopped

    def reading(self, i):
        """An upload reads layer i now: what was read ahead of it is no longer ahead, and a layer
        not reached yet is not read ahead any more."""
        with self._cv:
            self._taken.add(i)
            if self._ahead.pop(i, None) is not None:
                if i == self._current:
                    self._pending.clear()
                self._cv.notify_all()

    def stop(self):
        """No more reads; returns once the reads in flight are done."""
        self._halt()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    def _next(self):
        """The next piece to read (None: nothing is left, or the reads stopped), waiting while the
        next layer would take the reads past their room."""
        with self._cv:
            while not self._stopped and self._owner() is not None:
                if self._pending:
                    return self._pending.pop(0)
                i = next((i for i in self._order if i not in self._taken), None)
                if i is None:
                    self._stopped = True  # the reads are over: a new order needs new reads
                    return None
                if sum(self._ahead.values()) + self._sizes[i] > self._room():
                    self._cv.wait(1.0)  # an upload reading a layer read ahead makes room; the RAM may too
                    continue
                self._taken.add(i)
                self._ahead[i] = self._sizes[i]
                self._current, self._pending = i, [read for _, read in self._parts[i]]
            return None

    def _work(self):
        scratch = bytearray(READ_PIECE)
        while (read := self._next()) is not None:
            try:
                read(scratch)
            except Exception:  # the file changed, went or was closed: the uploads' own reads say so
                self._halt()
                return

    def _halt(self):
        with self._cv:
            self._stopped = True
            self._pending.clear()
            self._cv.notify_all()

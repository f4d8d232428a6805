"""Compressed masters' uploads on a GPU: a layer's runs of chunks (``compression.groups``) cross on
the copy stream into the next of ``compression.BUFFERS`` device buffers and are decoded into the
layer's slot on a decode stream of their own, so the next runs cross while one is decoded. The
decode stream's priority is high: a decode is a few microseconds of work that would otherwise queue
behind the step's matrix kernels while the copy stream waits for its buffer."""
from __future__ import annotations

import torch

from . import compression


class DeviceDecode:
    def __init__(self, device: torch.device, copy_stream):
        self.device, self.copy_stream = device, copy_stream
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._buffers = []  # [device buffer, event of the last decode from it], made at the first upload
        self._next = 0

    @property
    def device_bytes(self) -> int:
        return len(self._buffers) * compression.GROUP_BYTES

    def drop(self):
        """Free the buffers (the next upload makes them again)."""
        self._buffers = []

    def upload(self, host, runs, dst) -> torch.cuda.Stream:
        """A compressed master ``host`` with its ``runs`` (runs of chunks and their tables on the
        device) into ``dst``. Returns the decode stream, where the layer is done: the copy stream goes
        on to the next upload without waiting for the last decode."""
        if not self._buffers:
            self._buffers = [[torch.empty(compression.GROUP_BYTES, dtype=torch.uint8, device=self.device),
                              torch.cuda.Event()] for _ in range(compression.BUFFERS)]
        for run, rows in runs:
            packed, decoded = self._buffers[self._next]
            self._next = (self._next + 1) % len(self._buffers)
            start, nbytes = run[0].offset, sum(c.nbytes for c in run)
            self.copy_stream.wait_event(decoded)  # the decode from this buffer has finished
            packed[:nbytes].copy_(host[start:start + nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
            self.stream.wait_event(copied)
            with torch.cuda.stream(self.stream):
                compression.decode_run(packed[:nbytes], run, dst, rows)
            decoded.record(self.stream)
        return self.stream

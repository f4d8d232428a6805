"""Coded layers' uploads on a GPU: a compressed master's runs of chunks (``compression.groups``), or a
quantized layer's blocks a run at a time (unless the device keeps them), cross on the copy stream into the next of
``compression.BUFFERS`` device buffers and are decoded into the layer's slot on a decode stream of
their own, so the next runs cross while one is decoded. The decode stream's priority is high: a
decode is a few microseconds of work that would otherwise queue behind the step's matrix kernels
while the copy stream waits for its buffer."""
from __future__ import annotations

import torch

from . import compression, int8_rows, quants, triton_dequant
from .gguf_file import PLAIN

def dequantize_run(blocks: torch.Tensor, type_name: str, region: torch.Tensor, start: int):
    """Whole blocks ([n, bytes], contiguous, on the device) of GGML type ``type_name`` dequantized
    into ``region`` from element ``start``: in one launch where the device runs the kernel
    (``triton_dequant``), else by torch's ops; the same bits either way."""
    per = quants.TYPES[type_name].elements
    out = region[start:start + blocks.shape[0] * per].view(-1, per)
    if blocks.is_cuda and triton_dequant.runs_on(blocks.device, type_name, region.dtype):
        triton_dequant.dequantize_blocks(blocks, type_name, out)
    else:
        quants.dequantize_blocks(blocks, type_name, out)


def _cast(dst: torch.Tensor, src: torch.Tensor, scale: float | None):
    """``src`` cast into ``dst``, times ``scale`` (a scaled fp8 weight's, in ``dst``'s dtype) where given."""
    if scale is None:
        dst.copy_(src)
    else:
        torch.mul(src.to(dst.dtype), scale, out=dst)


class DeviceDecode:
    def __init__(self, device: torch.device, copy_stream):
        self.device, self.copy_stream = device, copy_stream
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._buffers = []  # [device buffer, event of the last decode from it], made at the first upload
        self._scales = {}   # an I8 weight's scales (its host tensor) -> their device copy
        self._next = 0

    @property
    def device_bytes(self) -> int:
        return len(self._buffers) * compression.GROUP_BYTES

    def drop(self):
        """Free the buffers (the next upload makes them again)."""
        self._buffers = []
        self._scales = {}

    def _row_scale(self, t) -> torch.Tensor:
        """An I8 weight's scales on the device: copied at its first upload (a float a row), kept until
        ``drop``."""
        scale = self._scales.get(t.row_scale)
        if scale is None:
            scale = self._scales[t.row_scale] = t.row_scale.to(self.device)
        return scale

    def _cross(self, src, decode):
        """``src`` (host bytes, at most a buffer) into the next buffer on the copy stream, then
        ``decode(its bytes on the device)`` on the decode stream."""
        if not self._buffers:
            self._buffers = [[torch.empty(compression.GROUP_BYTES, dtype=torch.uint8, device=self.device),
                              torch.cuda.Event()] for _ in range(compression.BUFFERS)]
        packed, decoded = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        self.copy_stream.wait_event(decoded)  # the decode from this buffer has finished
        packed[:src.numel()].copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.copy_stream)
        self.stream.wait_event(copied)
        with torch.cuda.stream(self.stream):
            decode(packed[:src.numel()])
        decoded.record(self.stream)

    def upload(self, host, runs, dst) -> torch.cuda.Stream:
        """A compressed master ``host`` with its ``runs`` (runs of chunks and their tables on the
        device) into ``dst``. Returns the decode stream, where the layer is done: the copy stream goes
        on to the next upload without waiting for the last decode."""
        for run, rows in runs:
            start, nbytes = run[0].offset, sum(c.nbytes for c in run)
            self._cross(host[start:start + nbytes], lambda b, run=run, rows=rows: compression.decode_run(b, run, dst, rows))
        return self.stream

    def _here(self, t, region):
        """A matrix whose blocks are on the device already, into ``region`` on the decode stream,
        after what the copy stream has queued (the wait for the slot's last user among it)."""
        scale = self._row_scale(t) if t.type_name == "I8" else None
        self.stream.wait_stream(self.copy_stream)
        with torch.cuda.stream(self.stream):
            if scale is not None:
                int8_rows.dequantize(t.codes(), scale, t.rotation, region.dtype, out=region.view(t.shape))
            elif t.type_name in PLAIN:
                _cast(region, t.data.view(PLAIN[t.type_name]), None if t.scale is None else t.scale_in(region.dtype))
            else:
                dequantize_run(t.data.view(-1, quants.TYPES[t.type_name].nbytes), t.type_name, region, 0)

    def dequantize(self, blocks: dict, layout, dst) -> torch.cuda.Stream:
        """A quantized layer's matrices ({name: GGUFTensor} in host memory) into the packed layer
        ``dst``: a run of whole blocks (at most a buffer) at a time; a matrix the file stores plain,
        its values cast. Returns the decode stream, where the layer is done."""
        for name, t in blocks.items():
            region = layout.region(dst, name).view(-1)
            if t.data.is_cuda:  # kept on the device (``HostMasters.keep_on_device``): nothing crosses
                self._here(t, region)
                continue
            if t.type_name == "I8":  # whole rows at a time: each is scaled (and rotated back) alone
                rows, inputs = t.shape
                scale, step = self._row_scale(t), max(1, compression.GROUP_BYTES // inputs)
                codes = t.data.view(rows, inputs)
                for a in range(0, rows, step):
                    part = codes[a:a + step]
                    self._cross(part.reshape(-1), lambda b, a=a, n=part.shape[0], t=t, region=region:
                                int8_rows.dequantize(b.view(torch.int8).view(n, inputs),
                                                     scale[a:a + n] if scale.dim() else scale, t.rotation,
                                                     region.dtype, out=region[a * inputs:(a + n) * inputs].view(n, inputs)))
                continue
            if t.type_name in PLAIN:
                values = t.data.view(PLAIN[t.type_name])
                step = compression.GROUP_BYTES // values.element_size()
                scale = None if t.scale is None else t.scale_in(region.dtype)
                for a in range(0, values.numel(), step):
                    part = values[a:a + step]
                    self._cross(part.view(torch.uint8), lambda b, a=a, n=part.numel(), d=part.dtype:
                                _cast(region[a:a + n], b.view(d), scale))
                continue
            q = quants.TYPES[t.type_name]
            data = t.data.view(-1, q.nbytes)
            run = compression.GROUP_BYTES // q.nbytes   # blocks a buffer holds
            for a in range(0, data.shape[0], run):
                rows = data[a:a + run]
                self._cross(rows.reshape(-1), lambda b, a=a, n=rows.shape[0], t=t:
                            dequantize_run(b.view(n, q.nbytes), t.type_name, region, a * q.elements))
        return self.stream

"""What the planner needs measured on the device that computes, once per image size: one layer's
compute over one layer's upload, an upload from the file over one from a pinned master, and a
compressed layer's decode, a quantized layer's dequantization."""
from __future__ import annotations

import time

import torch

from . import attention_input, compression, elementwise, int8_rows, quants
from .device_decode import dequantize_run
from .device_timing import device_seconds
from .errors import OutOfDeviceMemory
from .gguf_file import PLAIN
from .simulation import compute_copy_ratio
from .streamer import LayerStreamer


class Calibration:
    def __init__(self, cfg, dtype: torch.dtype, streamer: LayerStreamer):
        self.cfg, self.dtype, self.streamer = cfg, dtype, streamer
        self.device = streamer.device
        self._ratios = {}          # tokens -> (compute/copy ratio, page-cache/pinned upload, upload seconds)
        self._layer_decode_s = None  # a compressed layer's decode on this device, once measured
        self._layer_dequantize_s = None  # a quantized layer's dequantization, likewise

    def ratios(self, tokens: int, make_room) -> tuple:
        """(compute/copy ratio, page-cache/pinned upload or None, a layer's upload in seconds) for
        ``tokens`` image tokens, measured once: on a card that the current split fills (a larger
        image or batch after a smaller one) ``make_room()`` evicts a layer at a time (False once
        none is left) until the measurement's buffers fit. The plan that follows promotes them again
        where they fit. (None, None, None) on the CPU."""
        if self.device.type != "cuda":
            return None, None, None
        while tokens not in self._ratios:
            try:
                self._ratios[tokens] = self._measure(tokens)
                break
            except torch.OutOfMemoryError:
                pass  # out of the handler first: its traceback holds the measurement's tensors
            if not make_room():
                raise OutOfDeviceMemory(f"Out of GPU memory even with every layer streamed, while timing a "
                                        f"step of {tokens} image tokens. Lower the image size or batch, or free "
                                        "GPU memory.")
            torch.cuda.empty_cache()
        return self._ratios[tokens]

    def _measure(self, tokens) -> tuple:
        """Compute time of one layer over upload time of one layer: a matmul and an upload timed on
        this device, the rest is the planner's model. A layer's upload from the file through
        the staging ring over one from a pinned master: a chunk read into the staging buffer (from
        the page cache, or the disk where it is not cached: then more layers are pinned), each
        chunk's read overlapping the previous chunk's upload (None once every layer has a master).
        And a layer's upload in seconds."""
        cfg, dev, s = self.cfg, self.device, self.streamer
        x = torch.randn(tokens + 512, cfg.dim, device=dev, dtype=self.dtype)
        w = torch.randn(cfg.ffn_dim, cfg.dim, device=dev, dtype=self.dtype)
        host = s.staging_buffer()  # what an upload copies from (pinned if the budget has room)
        dst = torch.empty_like(host, device=dev)
        chunks = s.layout.numel / host.numel()  # a layer is uploaded in this many chunks
        matmul_s = device_seconds(lambda: [torch.nn.functional.linear(x, w) for _ in range(5)]) / 5
        if host.is_pinned():
            upload_s = device_seconds(lambda: dst.copy_(host, non_blocking=True))
        else:  # a pageable copy returns once the device has done it (``device_seconds``)
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            dst.copy_(host)
            upload_s = time.perf_counter() - start
        rate = 2 * x.shape[0] * cfg.dim * cfg.ffn_dim / matmul_s
        fused = attention_input.runs_on(dev) and elementwise.runs_on(dev)
        ratio = compute_copy_ratio(cfg, x.shape[0], rate, chunks * upload_s, fused)
        m = s.masters
        unpinned = [i for i in reversed(s.order) if m.host[i] is None]  # the last to become resident first
        if not unpinned:
            return ratio, None, chunks * upload_s
        s.layout.fill(host, m.sources[unpinned[0]])  # untimed: the first read may fault the pages in
        start = time.perf_counter()
        s.layout.fill(host, m.sources[unpinned[0]])
        return ratio, max(1.0, (time.perf_counter() - start) / upload_s), chunks * upload_s

    def decode_ratio(self, layer_upload_s: float) -> float:
        """A compressed layer's decode on this device over a layer's upload; the decode measured
        once, from one chunk of random weights encoded and decoded here."""
        if self._layer_decode_s is None:
            flat = (torch.randn(compression.CHUNK, device=self.device) * 0.02).to(torch.bfloat16)
            chunks, packed = compression.encode_all(flat)
            seconds = compression.decode_seconds(chunks, packed, torch.empty_like(flat))
            self._layer_decode_s = seconds * self.streamer.layout.numel / flat.numel()
        return self._layer_decode_s / layer_upload_s

    def dequantize_ratio(self, layer_upload_s: float) -> float:
        """A quantized layer's dequantization on this device over a layer's upload: its largest
        matrix's blocks dequantized here once, as ``DeviceDecode`` does, scaled to the layer (a
        K-quant mix's matrices differ in type: the largest stands for them all)."""
        if self._layer_dequantize_s is None:
            s = self.streamer
            t = max(s.masters.stored_blocks(s.order[-1]).values(), key=lambda t: t.data.numel())
            if t.type_name == "I8":  # a scale per row, and a matrix product where it is rotated
                codes = t.codes().to(self.device)
                scale, out = t.row_scale.to(self.device), torch.empty(t.shape, dtype=s.layout.dtype, device=self.device)
                seconds = device_seconds(lambda: int8_rows.dequantize(codes, scale, t.rotation, out.dtype, out=out))
                self._layer_dequantize_s = seconds * s.layout.numel / out.numel()
            elif t.type_name in PLAIN:
                self._layer_dequantize_s = 0.0
            else:
                q = quants.TYPES[t.type_name]
                blocks = t.data.to(self.device).view(-1, q.nbytes)
                out = torch.empty(blocks.shape[0] * q.elements, dtype=s.layout.dtype, device=self.device)
                seconds = device_seconds(lambda: dequantize_run(blocks, t.type_name, out, 0))
                self._layer_dequantize_s = seconds * s.layout.numel / out.numel()
        return self._layer_dequantize_s / layer_upload_s

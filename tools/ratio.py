"""How well a checkpoint's streamed layers compress (``zimage_core.compression``): each layer's
packed bf16 buffer, as the streamer uploads it, encoded and decoded back (checked bit for bit)."""
from __future__ import annotations

import time

import torch

from zimage_core import compression
from zimage_core.checkpoint import Checkpoint
from zimage_core.layout import PackLayout
from zimage_core.transformer import layer_pieces


def layer_ratio(flat: torch.Tensor) -> tuple:
    """(compressed bytes, exceptions) of one packed bf16 layer, after checking that it decodes to
    the same bits."""
    chunks, packed = compression.encode_all(flat)
    back = torch.empty_like(flat)
    compression.decode_all(chunks, packed, back)
    if not torch.equal(back.view(torch.int16), flat.view(torch.int16)):
        raise AssertionError("the decoded layer differs from the original")
    return packed.numel(), sum(c.n_exc for c in chunks)


def report(path, n_layers=None, device="cpu"):
    ckpt = Checkpoint(path)
    try:
        cfg = ckpt.config
        if ckpt.storage_dtype != torch.bfloat16:
            print(f"{path}: stored as {ckpt.storage_dtype}; the compression is for bf16 layers")
            return
        layout = PackLayout(cfg, torch.bfloat16)
        names = cfg.block_names()[:n_layers]
        host = torch.empty(layout.numel, dtype=torch.bfloat16)
        total = raw = 0
        for name in names:
            layout.fill(host, layer_pieces(ckpt, f"{name}."))
            start = time.perf_counter()
            nbytes, n_exc = layer_ratio(host.to(device))
            total, raw = total + nbytes, raw + layout.nbytes
            print(f"{name:22s} {nbytes / layout.nbytes:.4f}  {n_exc:8d} exceptions  "
                  f"({time.perf_counter() - start:.2f} s to encode and check)")
        print(f"all {len(names)} layers: {total / raw:.4f} of bf16 ({total / 2**30:.2f} of {raw / 2**30:.2f} GiB)")
    finally:
        ckpt.close()

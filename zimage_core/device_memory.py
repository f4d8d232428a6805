"""What a forward needs on the device beside the weights: its activations, the allocator's margin,
and the decode buffers of compressed uploads. Measured on an H200; the planner's sizes."""
from __future__ import annotations

import torch

from . import compression
from .config import ZImageConfig

MiB = 1 << 20
GiB = 1 << 30
RESERVE = 160 * MiB  # cuBLAS workspaces and the allocator's rounding, whatever the image
# compressed uploads: the device buffers of ``compression.GROUP_BYTES``, and what the encode's
# temporaries (a chunk's, at a layer's first upload) leave split among the allocator's blocks (on an
# H200 a compressed run held about 0.2 GiB more reserved beyond its tensors than a plain one)
CODEC_BYTES = compression.BUFFERS * compression.GROUP_BYTES + 192 * MiB
HOST_RESERVE = GiB   # what a forward on the CPU leaves to the rest of the machine


def activation_bytes(cfg: ZImageConfig, width, height, batch=1, cap_tokens=512,
                     dtype=torch.bfloat16, storage=torch.bfloat16, chunk_rows=None, chunk_queries=None) -> int:
    """Peak activation memory of one forward, per token of the joint sequence: seven
    model-wide tensors (residual, normed and modulated input, q, k, v and their contiguous
    copies for the attention kernel) and three FFN-wide ones (w1 and w3 outputs, their
    product), plus the fp32 rotary tables; an upcast copy of the largest weight for narrow
    storage comes on top. Measured on an H200: 118 KB per token, as this formula gives.
    Run in pieces (``chunk_rows`` / ``chunk_queries``, see ``dit.Chunks``), the FFN-wide
    tensors exist for one piece at a time; the model-wide ones are counted twelve times (the
    projection's pieces beside their concatenation), plus one attention piece's scores in fp32."""
    tokens = cfg.image_tokens(width, height) + cap_tokens + (-cap_tokens) % cfg.pad_multiple
    e = dtype.itemsize
    rope = cfg.head_dim * 2 * 4 * 2
    upcast = cfg.ffn_dim * cfg.dim * e if storage.itemsize < e else 0
    if chunk_rows is None:
        per_token = (7 * cfg.dim + 3 * cfg.ffn_dim) * e + rope
        return batch * tokens * per_token + upcast + 64 * MiB
    pieces = min(chunk_rows, tokens) * 3 * cfg.ffn_dim * e + min(chunk_queries, tokens) * tokens * cfg.n_heads * 4
    return batch * (tokens * (12 * cfg.dim * e + rope) + pieces) + upcast + 64 * MiB


def device_margin(activations: int, batch: int = 1) -> int:
    """Device memory a forward needs beyond its tensors: ``RESERVE``, and what torch's caching
    allocator holds reserved but unallocated at the peak, where blocks freed by activations of one
    size are split for those of another. Measured on an H200 with every layer streamed through one
    slot: 150-260 MiB beyond the tensors at 768x768 to 1536x1536, about 0.5 GiB more at batch 4."""
    return RESERVE + activations // 5 + (batch - 1) * 96 * MiB

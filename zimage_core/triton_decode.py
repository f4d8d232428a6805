"""The device decode of compressed chunks (``compression``) as two Triton kernels: one pass that
writes every weight from its code and low byte, then one that writes the exceptions' high bytes.
One launch of each covers a run of chunks, described by a small table on the device.

torch's elementwise ops take about ten launches and passes over each chunk; launched from the
upload thread, hundreds a layer, they held the interpreter lock that the thread queuing the step
needs, and the step slowed down (an H200 at 5.5 GiB: 202 ms instead of 160). This is one read of
the compressed bytes and one write of the slot, in two launches a run.

Triton ships with torch's CUDA builds on Linux (on Windows it is the optional ``triton-windows``
wheel). Where it does not import or compile, ``compression.decodes_on`` says no and masters are
not compressed: the reference decode in ``compression`` stays the CPU's.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 4096          # weights a program decodes
PATCH_BLOCK = 1024    # exceptions a program patches


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def weights(src, rows, out, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """Program (b, r): weights b*BLOCK... of the chunk in row r. ALIGNED: its first weight
        and its size are multiples of 16, so that loads and stores are wide."""
        row = rows + tl.program_id(1) * 7
        at, n, base = tl.load(row), tl.load(row + 1), tl.load(row + 2).to(tl.int32)
        first, low_at = tl.load(row + 3), tl.load(row + 6)
        if ALIGNED:
            n, first = tl.multiple_of(n, 16), tl.multiple_of(first, 16)
        at, low_at = tl.multiple_of(at, 16), tl.multiple_of(low_at, 16)  # the format aligns them
        start = tl.program_id(0).to(tl.int64) * BLOCK
        pairs = start // 2 + tl.arange(0, BLOCK // 2)
        byte = tl.load(src + at + pairs, mask=pairs < (n + 1) // 2, other=0).to(tl.int32)
        code = tl.interleave(byte & 15, byte >> 4)  # weight 2k's code is byte k's low nibble
        high = ((code & 8) << 4) | ((code & 7) + base)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        low = tl.load(src + low_at + offs, mask=mask, other=0).to(tl.int32)
        tl.store(out + first + offs, ((high << 8) | low).to(tl.int16), mask=mask)

    @triton.jit
    def exceptions(src, rows, out, BLOCK: tl.constexpr):
        """Program (b, r): exceptions b*BLOCK... of the chunk in row r, written over its weights."""
        row = rows + tl.program_id(1) * 7
        first, n_exc, at = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_exc
        where = tl.load((src + at).to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=0).to(tl.int64)
        high = tl.load(src + at + 4 * n_exc + offs, mask=mask, other=0).to(tl.int32)
        low = tl.load(out + first + where, mask=mask, other=0).to(tl.int32) & 0xFF
        tl.store(out + first + where, ((high << 8) | low).to(tl.int16), mask=mask)

    return weights, exceptions


def decode(src: torch.Tensor, rows: torch.Tensor, max_numel: int, max_exc: int, dst: torch.Tensor,
           aligned: bool):
    """The chunks that ``rows`` (``compression.table``) describe, from ``src`` (uint8: the run's
    bytes) into the layer ``dst`` (bf16), all on one CUDA device, on the current stream.
    ``aligned``: every chunk's first weight and size are multiples of 16."""
    weights, exceptions = _kernels()
    out = dst.view(torch.int16)
    weights[(-(-max_numel // BLOCK), rows.shape[0])](src, rows, out, ALIGNED=aligned, BLOCK=BLOCK)
    if max_exc:
        exceptions[(-(-max_exc // PATCH_BLOCK), rows.shape[0])](src, rows, out, BLOCK=PATCH_BLOCK)

"""GGML blocks dequantized on a CUDA device by one Triton kernel launch a run: each program reads
the bytes its weights need (codes, the block's scales) and writes the weights once, in the slot's
dtype. torch's ops (``quants``) take 5-8 launches a piece and write and read float32 temporaries:
on an H200 a 10240x3840 Q4_K matrix took 0.6-1 ms that way, launched from the upload thread, and a
Q4_K_M file whose layers the card keeps as their blocks dequantizes every layer every step. On a
card with a tenth of the H200's memory bandwidth, the temporaries alone would cost more than the
step's products.

The arithmetic is ``quants``' (the ``gguf`` package's): the same float32 operations in the same
order, products and sums not fused into one rounding (``enable_fp_fusion=False``), the result
rounded once to the slot's dtype (nearest even). Whether the kernel runs on a device is decided once
per type and dtype (``runs_on``: it must give the bits ``quants`` gives); where Triton does not
import or compile, ``quants`` dequantizes there, with the same bits.
"""
from __future__ import annotations

import functools
import threading

import torch

from . import quants
from .device_check import DeviceCheck, triton_check

BLOCK = 1024  # weights a program writes
KINDS = {name: k for k, name in enumerate(quants.TYPES)}  # each type's branch in the kernel


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize(src, out, n, KIND: tl.constexpr, PER: tl.constexpr, NBYTES: tl.constexpr,
                   OUT_F32: tl.constexpr, BLOCK: tl.constexpr):
        """Program p: weights p*BLOCK... of the run, each from its block (``quants``' layouts)."""
        w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = w < n
        base = src + (w // PER) * NBYTES
        e = (w % PER).to(tl.int32)  # the weight's place in its block
        # the block's first float16 (d) and, for Q4_1 / Q4_K / Q5_K, its second (m, dmin); Q6_K's d is last
        at = 208 if KIND == 6 else 0
        d = ((tl.load(base + at, mask=mask, other=0).to(tl.uint16)
              | (tl.load(base + at + 1, mask=mask, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32))
        m = ((tl.load(base + 2, mask=mask, other=0).to(tl.uint16)
              | (tl.load(base + 3, mask=mask, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32))
        if KIND == 0:    # Q8_0: d, 32 int8 codes
            v = tl.load(base + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32) * d
        elif KIND == 1:  # Q4_0: d, 16 bytes of nibbles (the low ones first), codes - 8
            q = (tl.load(base + 2 + e % 16, mask=mask, other=0).to(tl.int32) >> (4 * (e // 16))) & 15
            v = d * (q - 8).to(tl.float32)
        elif KIND == 2:  # Q4_1: d, m, 16 bytes of nibbles
            q = (tl.load(base + 4 + e % 16, mask=mask, other=0).to(tl.int32) >> (4 * (e // 16))) & 15
            v = d * q.to(tl.float32) + m
        elif KIND == 3:  # Q5_0: d, 32 fifth bits (a little-endian int32), 16 bytes of nibbles, codes - 16
            high = (tl.load(base + 2 + e // 8, mask=mask, other=0).to(tl.int32) >> (e % 8)) & 1
            q = ((tl.load(base + 6 + e % 16, mask=mask, other=0).to(tl.int32) >> (4 * (e // 16))) & 15) | (high << 4)
            v = d * (q - 16).to(tl.float32)
        elif KIND == 6:  # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; codes - 32
            half, r, i = e // 128, (e % 128) // 32, e % 32
            low = (tl.load(base + half * 64 + (r % 2) * 32 + i, mask=mask, other=0).to(tl.int32) >> (4 * (r // 2))) & 15
            high = (tl.load(base + 128 + half * 32 + i, mask=mask, other=0).to(tl.int32) >> (2 * r)) & 3
            scale = tl.load(base + 192 + e // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            v = (d * scale) * ((low | (high << 4)) - 32).to(tl.float32)
        else:            # Q4_K / Q5_K: d, dmin, 12 bytes of six-bit scales and mins, [32 bytes of fifth bits], 128 of nibbles
            j, i = e // 32, e % 32  # sub-block j: nibble j % 2 of the bytes of run j // 2
            a = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
            b = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
            c = tl.load(base + 4 + j % 4, mask=mask, other=0).to(tl.int32)
            sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4)).to(tl.float32)
            mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
            codes = 16 if KIND == 4 else 48
            q = (tl.load(base + codes + (j // 2) * 32 + i, mask=mask, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
            if KIND == 5:
                q = q | (((tl.load(base + 16 + i, mask=mask, other=0).to(tl.int32) >> j) & 1) << 4)
            v = (d * sc) * q.to(tl.float32) - m * mn
        if OUT_F32:
            tl.store(out + w, v, mask=mask)
        else:
            tl.store(out + w, v.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return dequantize


def dequantize_blocks(blocks: torch.Tensor, type_name: str, out: torch.Tensor):
    """``quants.dequantize_blocks`` in one launch on the current stream: ``blocks`` ([n, block
    bytes], uint8, contiguous) into ``out`` ([n, block weights], contiguous, float32 / bf16 /
    fp16), both on one CUDA device."""
    q = quants.TYPES[type_name]
    n = out.numel()
    if n:
        _kernel()[(-(-n // BLOCK),)](blocks, out, n, KIND=KINDS[type_name], PER=q.elements, NBYTES=q.nbytes,
                                     OUT_F32=out.dtype == torch.float32, BLOCK=BLOCK, enable_fp_fusion=False)


def check(device: torch.device, type_name: str, dtype: torch.dtype) -> str | None:
    """None where the kernel gives ``quants``' bits for ``type_name`` in ``dtype`` on ``device``
    (blocks of random bytes with finite scales: every code pattern), else why not."""
    blocks = quants.random_blocks(type_name, 256, seed=len(type_name)).to(device)
    want = quants.dequantize_blocks(blocks, type_name,
                                    torch.empty(256, quants.TYPES[type_name].elements, dtype=dtype, device=device))
    got = torch.full_like(want, float("nan"))
    dequantize_blocks(blocks, type_name, got)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    return None if torch.equal(got.view(bits), want.view(bits)) else f"its {type_name} weights in {dtype} are not the gguf package's"


_checks, _lock = {}, threading.Lock()


def _check(type_name: str, dtype: torch.dtype) -> DeviceCheck:
    """The once-per-device check of one type into one dtype: a compile each (a second or so, a few
    tenths from Triton's cache on disk), so only the types a file holds are compiled."""
    with _lock:
        if (type_name, dtype) not in _checks:
            _checks[type_name, dtype] = triton_check(
                functools.partial(check, type_name=type_name, dtype=dtype), f"the fused {type_name} dequantization",
                "torch's ops dequantize instead (slower, same images)", "zimage-dequant-check")
        return _checks[type_name, dtype]


def runs_on(device, type_name: str, dtype: torch.dtype) -> bool:
    """Whether the kernel dequantizes ``type_name`` into ``dtype`` on ``device`` (asked where a run
    is first dequantized there; the check runs once)."""
    return _check(type_name, dtype)(device)


def check_soon(device, type_names, dtype: torch.dtype):
    """Start the checks of the GGML types among ``type_names`` into ``dtype`` on a CUDA device,
    each on a thread of its own (``transformer.check_kernels_soon``)."""
    for name in set(type_names) & set(quants.TYPES):
        _check(name, dtype).soon(device)

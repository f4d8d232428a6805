"""A block's elementwise steps between its matrix products: the modulated norm before attention and
FFN (``scaled_norm``), the gated residual after them (``gated_residual``), and the FFN's SiLU gate
(``silu_gate``). On CUDA each is one launch of a Triton kernel (the two norms share one, which
normalises a row and then scales it or adds it gated); elsewhere, or where they do not run, torch's
ops (``torch_*``).

torch's ops take ten launches a modulated block for these, most of them reading and writing the
whole sequence once each (a norm, a multiply broadcast over the tokens, a tanh, an add): on an H200
about 14 of the 94 ms of GPU time in a resident 1024x1024 step (torch.profiler), where the matrix
products take 61. Each kernel reads its inputs once and writes its output once.

They compute what torch's ops compute, in the same precisions: each op in fp32, its result rounded
to the activation dtype before the next reads it, as separate kernels do. A norm's sum of squares
runs in another order than torch's, so a value can come out one unit in the last place apart
(``check``). Whether they run is decided once per device, before the first forward uses them, so a
model's output never depends on timing; streamed and resident blocks run the same kernels. Where
Triton does not import or compile, torch's ops run and the console says so once.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .config import FULL
from .device_check import triton_check

_DTYPES = (torch.bfloat16, torch.float16)
_MAX_DIM = 16384  # a row is one program's tile


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # every op in fp32, its result rounded to the activation dtype (nearest even) before the next reads it
    @triton.jit
    def norm_row(x, y, weight, factor, out, dim, tokens, eps, GATED: tl.constexpr, BLOCK: tl.constexpr):
        """Program r: n = rms_norm(y) * weight of row r (of batch r // tokens), then with ``GATED``
        x + factor[batch] * n (a gated residual), else n * factor[batch] (a modulated norm)."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        ty = out.dtype.element_ty
        v = tl.load(y + r * dim + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / dim + eps)
        n = (v * rstd * tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)).to(ty, fp_downcast_rounding="rtne")
        f = tl.load(factor + (r // tokens) * dim + cols, mask=mask, other=0.0).to(tl.float32)
        t = f * n.to(tl.float32)
        if GATED:
            t = tl.load(x + r * dim + cols, mask=mask, other=0.0).to(tl.float32) + t.to(ty, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(out + r * dim + cols, t.to(ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def silu_gate(a, b, out, numel, BLOCK: tl.constexpr):
        """silu(a) * b, elementwise; the SiLU as torch's: a / (1 + exp(-a)), correctly rounded."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < numel
        ty = out.dtype.element_ty
        u = tl.load(a + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.div_rn(u, 1.0 + tl.exp(-u)).to(ty, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(out + i, (s * tl.load(b + i, mask=mask, other=0.0).to(tl.float32)).to(ty, fp_downcast_rounding="rtne"),
                 mask=mask)

    return norm_row, silu_gate


def _rows(x) -> tuple:
    """(rows, their length, tokens per batch entry) of x [B, L, D]."""
    return x.numel() // x.shape[-1], x.shape[-1], x.shape[1]


def usable(*tensors) -> bool:
    """Whether these tensors are ones the kernels read: on CUDA, contiguous, bf16 or fp16 alike, rows
    of at most ``_MAX_DIM``, and the kernels checked on that device (``runs_on``; the first call
    waits for it)."""
    x = tensors[0]
    return (x.is_cuda and x.dtype in _DTYPES and x.shape[-1] <= _MAX_DIM
            and all(t.is_contiguous() and t.dtype == x.dtype for t in tensors) and runs_on(x.device))


def scaled_norm(x, weight, eps, scale):
    """rms_norm(x) * weight * scale, x [B, L, D], scale [B, D] (one per batch entry: adaLN's 1 + scale)."""
    fn = fused_scaled_norm if usable(x, weight, scale) else torch_scaled_norm
    return fn(x, weight, eps, scale)


def gated_residual(x, y, weight, eps, gate):
    """x + gate * (rms_norm(y) * weight), x and y [B, L, D], gate [B, D] (adaLN's tanh(gate))."""
    fn = fused_gated_residual if usable(x, y, weight, gate) else torch_gated_residual
    return fn(x, y, weight, eps, gate)


def silu_gate(a, b):
    """silu(a) * b (the FFN's gate: w1's output through SiLU, times w3's)."""
    fn = fused_silu_gate if usable(a, b) and a.shape == b.shape else torch_silu_gate
    return fn(a, b)


def fused_scaled_norm(x, weight, eps, scale):
    return _norm_row(x, x, weight, eps, scale, gated=False)


def fused_gated_residual(x, y, weight, eps, gate):
    return _norm_row(x, y, weight, eps, gate, gated=True)


def _norm_row(x, y, weight, eps, factor, gated: bool):
    out = torch.empty_like(x)
    rows, dim, tokens = _rows(x)
    _kernels()[0][(rows,)](x, y, weight, factor, out, dim, tokens, eps, GATED=gated, BLOCK=_block(dim))
    return out


_SILU_BLOCK = 2048


def fused_silu_gate(a, b):
    out = torch.empty_like(a)
    _kernels()[1][(-(-a.numel() // _SILU_BLOCK),)](a, b, out, a.numel(), BLOCK=_SILU_BLOCK)
    return out


def _block(dim: int) -> int:
    """A row's tile: the next power of two."""
    return 1 << (dim - 1).bit_length()


def torch_scaled_norm(x, weight, eps, scale):
    return F.rms_norm(x, weight.shape, weight, eps) * scale.unsqueeze(1)


def torch_gated_residual(x, y, weight, eps, gate):
    return x + gate.unsqueeze(1) * F.rms_norm(y, weight.shape, weight, eps)


def torch_silu_gate(a, b):
    return F.silu(a) * b


def check(device, units: int = 1, tokens: int = 32) -> str | None:
    """None where the kernels give what torch's ops give on ``device``, to ``units`` in the last place
    of bf16 at the scale of each row; otherwise why not. (Triton's interpreter, which runs them on
    the CPU in the tests, rounds toward zero where the compiled kernels round to nearest: there
    each rounding can be one unit off.) ``tokens``: of each of the two entries of the batch.

    It runs at Z-Image's sizes (a row of 3840, not a power of two: the tile's mask is checked too),
    with a token count that is a multiple of 16 as a forward's always is: Triton compiles a kernel
    for each set of sizes and alignments, so the check's compiles are the ones the first forward
    uses."""
    g = torch.Generator().manual_seed(0)
    dim, hidden, eps = FULL.dim, FULL.ffn_dim, FULL.norm_eps

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=device, dtype=torch.bfloat16)

    x, y = rand(2, tokens, dim, scale=4), rand(2, tokens, dim, scale=4)
    a, b = rand(2, tokens, hidden, scale=3), rand(2, tokens, hidden)
    w, s, gate = rand(dim, scale=0.25, shift=1), rand(2, dim, scale=0.5, shift=1), rand(2, dim, scale=0.5).tanh()
    cases = (("scaled norm", fused_scaled_norm(x, w, eps, s), torch_scaled_norm(x, w, eps, s), x),
             ("gated residual", fused_gated_residual(x, y, w, eps, gate), torch_gated_residual(x, y, w, eps, gate), x),
             ("SiLU gate", fused_silu_gate(a, b), torch_silu_gate(a, b), a))
    for name, got, want, inp in cases:
        got, want = got.float(), want.float()
        if not torch.isfinite(got).all():
            return f"its {name} is not finite"
        scale = torch.maximum(want.abs().amax(-1, keepdim=True), inp.float().abs().amax(-1, keepdim=True))
        if ((got - want).abs() > scale * units * 2 ** -7).any():
            return f"its {name} differs from torch's by more than {units} unit(s) in the last place"
    return None


# asked by the first forward; started early where a prompt is encoded or a model loads
# (``transformer.check_kernels_soon``)
runs_on = triton_check(check, "the fused norm kernels", "torch's ops run instead (slower, same images)",
                       "zimage-elementwise-check")

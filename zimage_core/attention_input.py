"""The attention's inputs from a block's qkv projection: the query and key RMS norms, the rotary
embedding, and the head-major layout that attention reads. On CUDA one Triton kernel makes them
(one token a program); elsewhere, or where it does not run, torch's ops (``torch_path``).

torch's ops take eleven launches a block for this, over fp32 copies of q and k (the rotation runs
in fp32, as in ComfyUI): 17 of the 108 ms of GPU time in a step at 1024x1024 on an H200 (measured
with torch.profiler), where the matrix products take 59. The kernel reads qkv once and writes q,
k and v once.

It computes what the torch path computes, in the same precisions: the norm in fp32, rounded to the
activation dtype, then rotated in fp32 and rounded again. Its sums of squares run in another order
than torch's kernel, so a value can come out one unit in the last place apart from the torch path
(``check``). Whether it runs is decided once per device, before the first forward uses it, so a
model's output never depends on timing; streamed and resident blocks run the same kernel.
Where Triton does not import or compile, the torch path runs and the console says so once.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .config import FULL
from .device_check import triton_check

# torch's rms_norm without an eps uses that of the dtype it computes in (fp32 for bf16 and fp16)
_EPS = torch.finfo(torch.float32).eps


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_input(qkv, q_weight, k_weight, freqs, q, k, v, tokens, row_stride, eps,
                        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
        """Program t: token t (of batch t // tokens); qkv rows are [q heads | k heads | v heads].
        Every load is contiguous; even and odd elements are split in registers."""
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HP)[:, None]
        cols = tl.arange(0, D)[None, :]
        mask = heads < H
        src = qkv + t * row_stride
        # this token's [D/2, 2, 2] rotation matrices, as (row, column) pairs
        f = tl.reshape(tl.load(freqs + t * (2 * D) + tl.arange(0, 2 * D)), (D // 2, 2, 2))
        first, second = tl.split(f)  # columns 0 and 1
        f00, f10 = tl.split(first)
        f01, f11 = tl.split(second)
        f00, f01, f10, f11 = f00[None, :], f01[None, :], f10[None, :], f11[None, :]
        at = ((t // tokens) * H + heads) * tokens * D + (t % tokens) * D  # [B, H, L, D]
        for which in tl.static_range(2):
            if which == 0:
                weight, dst = q_weight, q + at
            else:
                weight, dst = k_weight, k + at
            x = tl.load(src + which * H * D + heads * D + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            # the norm's output is rounded to the activation dtype before the rotation reads it
            n = (tl.load(weight + cols).to(tl.float32) * (rstd * x)).to(q.dtype.element_ty, fp_downcast_rounding="rtne")
            ne, no = tl.split(tl.reshape(n.to(tl.float32), (HP, D // 2, 2)))
            out = tl.interleave(f00 * ne + f01 * no, f10 * ne + f11 * no)
            tl.store(dst + cols, out.to(q.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(v + at + cols, tl.load(src + 2 * H * D + heads * D + cols, mask=mask), mask=mask)

    return attention_input


def make(qkv, q_weight, k_weight, freqs, heads: int, head_dim: int):
    """[B, L, 3*H*D] qkv, the q and k norm weights [D] and the rotations [B, L, 1, D/2, 2, 2] ->
    q, k, v as [B, H, L, D]: the kernel's where it runs (``usable``), else torch's."""
    if usable(qkv, freqs, head_dim):
        return fused(qkv, q_weight, k_weight, freqs, heads, head_dim)
    return torch_path(qkv, q_weight, k_weight, freqs, heads, head_dim)


def usable(qkv: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> bool:
    """Whether these tensors are ones the kernel reads: on CUDA, contiguous, a power-of-two head
    dimension, and the kernel checked on that device (``runs_on``; the first call waits for it)."""
    return (qkv.is_cuda and qkv.is_contiguous() and freqs.is_contiguous() and freqs.dtype == torch.float32
            and head_dim >= 4 and head_dim & (head_dim - 1) == 0 and runs_on(qkv.device))


def fused(qkv, q_weight, k_weight, freqs, heads: int, head_dim: int):
    """``make``'s q, k, v from the kernel, each contiguous. Its inputs must be contiguous."""
    b, n, _ = qkv.shape
    q, k, v = (torch.empty(b, heads, n, head_dim, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    hp = 1 << (heads - 1).bit_length()
    _kernel()[(b * n,)](qkv, q_weight, k_weight, freqs, q, k, v, n, qkv.stride(1), _EPS,
                        H=heads, HP=hp, D=head_dim)
    return q, k, v


def torch_path(qkv, q_weight, k_weight, freqs, heads: int, head_dim: int):
    """``make``'s q, k, v from torch's ops: norms without an eps of their own (as ComfyUI builds
    them), rotation in fp32, then head-major views."""
    b, n, _ = qkv.shape
    q, k, v = (t.view(b, n, heads, head_dim) for t in qkv.split(heads * head_dim, dim=-1))
    q = F.rms_norm(q, (head_dim,), q_weight, None)
    k = F.rms_norm(k, (head_dim,), k_weight, None)
    q, k = rotate(q, freqs), rotate(k, freqs)
    return q.movedim(1, 2), k.movedim(1, 2), v.movedim(1, 2)


def rotate(x, freqs):
    """The rotary embedding as ComfyUI computes it: in the rotations' fp32, rounded back."""
    x_ = x.to(freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    out = freqs[..., 0] * x_[..., 0]
    out.addcmul_(freqs[..., 1], x_[..., 1])
    return out.reshape(*x.shape).type_as(x)


def check(device, units: int = 1, tokens: int = 32) -> str | None:
    """None where the kernel gives what the torch path gives on ``device``, to ``units`` in the last
    place of bf16 at the scale of each head's vector (a rotated value near zero carries the
    rounding of its larger inputs); otherwise why not. (Triton's interpreter, which runs it on the CPU in the tests,
    rounds toward zero where the compiled kernel rounds to nearest: there the norm and the rotation
    can each be one unit off.) ``tokens``: of each of the two prompts it makes up.

    It runs at Z-Image's head count and size, with a token count that is a multiple of 16 as a
    forward's always is: Triton compiles a kernel for each set of sizes and alignments it is given,
    so the check's compile is the one the first forward uses (on an H200 a second recompile took
    about a second of the first image's first step)."""
    g = torch.Generator().manual_seed(0)
    heads, head_dim, n = FULL.n_heads, FULL.head_dim, tokens
    qkv = (torch.randn(2, n, 3 * heads * head_dim, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    w = [(1 + torch.randn(head_dim, generator=g) / 4).to(device=device, dtype=torch.bfloat16) for _ in range(2)]
    angles = torch.rand(2, n, 1, head_dim // 2, generator=g) * 6.3
    c, s = torch.cos(angles), torch.sin(angles)
    freqs = torch.stack([c, -s, s, c], dim=-1).reshape(2, n, 1, head_dim // 2, 2, 2).to(device)
    got = fused(qkv, w[0], w[1], freqs, heads, head_dim)
    want = torch_path(qkv, w[0], w[1], freqs, heads, head_dim)
    for name, a, b in zip("qkv", got, want):
        a, b = a.float(), b.float()
        if not torch.isfinite(a).all():
            return f"its {name} is not finite"
        if ((a - b).abs() > b.abs().amax(-1, keepdim=True) * units * 2 ** -7).any():
            return f"its {name} differs from torch's by more than {units} unit(s) in the last place"
    return None


# asked by the first forward; started early where a prompt is encoded or a model loads
# (``transformer.check_kernels_soon``)
runs_on = triton_check(check, "the fused attention-input kernel", "torch's ops run instead (slower, same images)",
                       "zimage-attention-check")

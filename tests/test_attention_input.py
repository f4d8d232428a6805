"""The attention's inputs (query and key norms, rotation, head-major layout): the Triton kernel
against torch's ops, in Triton's interpreter on the CPU (the GPU test runs it compiled)."""
import os
import subprocess
import sys

import pytest
import torch

from zimage_core import attention_input

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_torch_path_is_the_norms_then_the_rotation_then_head_major():
    """What the kernel must reproduce, written out: each head normalised over its dimension and
    rotated pair by pair, [B, L, H, D] -> [B, H, L, D]."""
    g = torch.Generator().manual_seed(1)
    b, n, h, d = 2, 5, 3, 8
    qkv = torch.randn(b, n, 3 * h * d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    angle = torch.rand(b, n, 1, d // 2, generator=g) * 6
    c, s = torch.cos(angle), torch.sin(angle)
    freqs = torch.stack([c, -s, s, c], dim=-1).reshape(b, n, 1, d // 2, 2, 2)
    q, k, v = attention_input.make(qkv, w, w, freqs, h, d)
    x = qkv[..., :h * d].view(b, n, h, d)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps) * w
    e, o = x[..., 0::2], x[..., 1::2]
    want = torch.stack([c * e - s * o, s * e + c * o], dim=-1).flatten(-2).movedim(1, 2)
    assert torch.allclose(q, want, atol=1e-5)
    assert torch.equal(v, qkv[..., 2 * h * d:].view(b, n, h, d).movedim(1, 2))
    assert not qkv.is_cuda and k.shape == (b, h, n, d)


def test_the_kernel_gives_torchs_values_in_tritons_interpreter():
    """The kernel on bf16 activations against torch's ops, to one unit in the last place where it
    is compiled and two in the interpreter (which rounds toward zero)."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    code = "from zimage_core import attention_input as a; r = a.check('cpu', units=2, tokens=5); assert r is None, r"
    r = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

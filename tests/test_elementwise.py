"""A block's elementwise steps (modulated norm, gated residual, SiLU gate): torch's path written out
by hand, and the Triton kernels against it in Triton's interpreter on the CPU (the GPU test runs
them compiled)."""
import os
import subprocess
import sys

import pytest
import torch

from zimage_core import elementwise

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_torch_path_is_what_a_modulated_block_computes():
    """The three steps as ComfyUI's Z-Image block writes them: the norm then the scale broadcast
    over the tokens, the gated norm added to the residual, SiLU times the second projection."""
    g = torch.Generator().manual_seed(2)
    b, n, d, eps = 2, 5, 16, 1e-5
    x, y = torch.randn(b, n, d, generator=g), torch.randn(b, n, d, generator=g)
    w, s, gate = torch.rand(d, generator=g) + 0.5, torch.randn(b, d, generator=g), torch.randn(b, d, generator=g).tanh()
    norm = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    assert torch.allclose(elementwise.scaled_norm(x, w, eps, s), norm(x) * s[:, None], atol=1e-6)
    assert torch.allclose(elementwise.gated_residual(x, y, w, eps, gate), x + gate[:, None] * norm(y), atol=1e-6)
    assert torch.allclose(elementwise.silu_gate(x, y), x * torch.sigmoid(x) * y, atol=1e-6)
    assert not elementwise.usable(x, y)  # the CPU runs torch's ops


def test_the_kernels_give_torchs_values_in_tritons_interpreter():
    """The kernels on bf16 activations against torch's ops, to one unit in the last place where
    compiled and two in the interpreter (which rounds toward zero)."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    code = "from zimage_core import elementwise as e; r = e.check('cpu', units=2, tokens=5); assert r is None, r"
    r = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

"""The modulated blocks' activations written into one buffer per forward (``dit.Scratch``): the same
bits as the blocks allocating their own, every dtype, a batch of two, the whole forward, and with
the Triton kernels (in the interpreter) writing into the buffer and over their own inputs."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY, inputs
from zimage_core import dit
from zimage_core.transformer import ZImageTransformer

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def block_outputs(dtype, b=2, n=24):
    """A random modulated block of the tiny config run three times on the same input: allocating
    its own activations, then twice into one ``Scratch`` (made for a longer stage, as a forward's).
    Returns the three outputs and the scratch."""
    g = torch.Generator().manual_seed(3)
    cfg = TINY
    block = dit.Block(cfg, True).to(dtype).requires_grad_(False)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(b, n, cfg.dim, generator=g).to(dtype)
    ids = torch.stack([torch.full((n,), 3.0), torch.arange(n) // 6, torch.arange(n) % 6], dim=-1).expand(b, n, 3)
    freqs = dit.rope_freqs(ids.float(), cfg.axes_dims, cfg.rope_theta)
    adaln = torch.randn(b, cfg.t_dim, generator=g).to(dtype)
    w = dit.BigWeights(*(torch.randn(shape, generator=g).to(dtype) * 0.05 for shape in
                         ((3 * cfg.dim, cfg.dim), (cfg.dim, cfg.dim), (cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim),
                          (cfg.dim, cfg.ffn_dim))))
    scratch = dit.Scratch(cfg, b * n + 8, dtype, x.device)
    with torch.no_grad():
        return (block(x.clone(), freqs, adaln, w), block(x.clone(), freqs, adaln, w, None, scratch),
                block(x.clone(), freqs, adaln, w, None, scratch), scratch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_writes_the_same_bits_into_its_scratch(dtype):
    want, got, again, scratch = block_outputs(dtype)
    assert torch.equal(got, want) and torch.equal(again, want)  # reused: nothing left over
    # the kernels on a GPU read the four factors as contiguous [B, dim] rows
    adaln = torch.zeros(2, TINY.t_dim, dtype=dtype)
    assert all(t.is_contiguous() and t.shape == (2, TINY.dim) for t in scratch.modulation(adaln, 4 * TINY.dim)[1:])


def test_the_kernels_write_the_same_bits_into_the_scratch_in_tritons_interpreter():
    """The fused kernels (taken as usable on the CPU, run by Triton's interpreter) in both paths:
    writing into the scratch, the residual over its own input and the SiLU gate over w1's output
    give what writing into new tensors gives."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    # the last line: each of the three runs launched the kernels (five elementwise launches and one
    # of the attention inputs a run; the first launch of each makes the kernel)
    code = ("import sys, torch; sys.path.insert(0, 'tests')\n"
            "from zimage_core import attention_input, elementwise\n"
            "elementwise.usable = lambda *t: all(x.is_contiguous() and x.dtype == t[0].dtype for x in t)\n"
            "attention_input.usable = lambda qkv, freqs, head_dim: True\n"
            "import test_scratch\n"
            "want, got, again, _ = test_scratch.block_outputs(torch.bfloat16)\n"
            "assert torch.equal(got, want) and torch.equal(again, want), (got - want).abs().max()\n"
            "assert elementwise._kernels.cache_info().hits == 14 and attention_input._kernel.cache_info().hits == 2\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_forward_with_scratch_buffers_gives_the_same_bits(tiny_file, monkeypatch):
    """Unchunked (as on a GPU), with and without the per-forward buffer."""
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16")
    m.prepare(96, 80, 2)
    x, t, ctx = inputs(TINY, 96, 80, batch=2)
    made = []
    real = dit.Scratch
    monkeypatch.setattr(dit, "Scratch", lambda *a: made.append(real(*a)) or made[-1])
    with torch.no_grad():
        got = m.model(x, t, ctx)
        monkeypatch.setattr(dit, "Scratch", lambda *a: None)
        want = m.model(x, t, ctx)
    assert len(made) == 1 and torch.equal(got, want)

"""The modulated blocks' activations written into one buffer per forward (``dit.Scratch``): the same
bits as the blocks allocating their own, every dtype, a batch of two, the whole forward."""
import pytest
import torch

from conftest import TINY, inputs
from zimage_core import dit
from zimage_core.transformer import ZImageTransformer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_writes_the_same_bits_into_its_scratch(dtype):
    g = torch.Generator().manual_seed(3)
    cfg = TINY
    block = dit.Block(cfg, True).to(dtype)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    b, n = 2, 24
    x = torch.randn(b, n, cfg.dim, generator=g).to(dtype)
    ids = torch.stack([torch.full((n,), 3.0), torch.arange(n) // 6, torch.arange(n) % 6], dim=-1).expand(b, n, 3)
    freqs = dit.rope_freqs(ids.float(), cfg.axes_dims, cfg.rope_theta)
    adaln = torch.randn(b, cfg.t_dim, generator=g).to(dtype)
    w = dit.BigWeights(*(torch.randn(shape, generator=g).to(dtype) * 0.05 for shape in
                         ((3 * cfg.dim, cfg.dim), (cfg.dim, cfg.dim), (cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim),
                          (cfg.dim, cfg.ffn_dim))))
    scratch = dit.Scratch(cfg, b * n + 8, dtype, x.device)  # room for a longer stage, as a forward's
    with torch.no_grad():
        want = block(x.clone(), freqs, adaln, w)
        assert torch.equal(block(x.clone(), freqs, adaln, w, None, scratch), want)
        assert torch.equal(block(x.clone(), freqs, adaln, w, None, scratch), want)  # reused: nothing left over
    # the kernels on a GPU read the four factors as contiguous [B, dim] rows
    assert all(t.is_contiguous() and t.shape == (b, cfg.dim) for t in scratch.modulation(adaln, 4 * cfg.dim)[1:])


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

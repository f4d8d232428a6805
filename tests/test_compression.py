"""The lossless layer code (``zimage_core.compression``): every bf16 bit pattern comes back as it
went in, across chunk borders, and trained-like weights take about 0.75 of their bf16 bytes."""
import pytest
import torch

from tools.random_weights import random_tensor
from zimage_core import compression


def roundtrip(flat):
    layout = compression.plan(flat)
    packed = torch.empty(layout.nbytes, dtype=torch.uint8)
    compression.encode(flat, layout, packed)
    back = torch.full_like(flat, float("nan"))
    for c in layout.chunks:
        compression.decode(packed[c.offset:c.offset + c.nbytes].clone(), c, layout.base,
                           back[c.start:c.start + c.numel])
    return layout, back


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_every_bf16_bit_pattern_comes_back():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    layout, back = roundtrip(every)  # zeros, subnormals, infinities, NaNs of every payload
    assert same_bits(back, every)
    assert sum(c.n_exc for c in layout.chunks) == 65536 - 16 * 256  # 16 of 256 high bytes have a code


@pytest.mark.parametrize("numel", [1, 2, 7, 1000, 4099])
def test_chunk_borders_and_odd_sizes(monkeypatch, numel):
    monkeypatch.setattr(compression, "CHUNK", 1024)
    torch.manual_seed(numel)
    flat = (torch.randn(numel) * 0.02).to(torch.bfloat16)
    flat[::97] = 0  # exceptions in every chunk
    layout, back = roundtrip(flat)
    assert len(layout.chunks) == -(-numel // 1024)
    assert all(c.offset % 4 == 0 for c in layout.chunks)
    assert same_bits(back, flat)


def test_trained_like_weights_take_three_quarters():
    gen = torch.Generator().manual_seed(0)
    for key in ("layers.0.feed_forward.w1.weight", "layers.0.attention.out.weight",
                "layers.0.adaLN_modulation.0.weight"):
        flat = random_tensor(key, (512, 2048), gen).to(torch.bfloat16).view(-1)
        layout, back = roundtrip(flat)
        assert same_bits(back, flat)
        assert layout.nbytes / flat.nbytes < 0.76


def test_realistic_random_weights_differ_from_plain_ones_as_stated():
    gen = torch.Generator().manual_seed(0)
    norm = random_tensor("layers.0.attention_norm1.weight", (4096,), gen)
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.01
    w1 = random_tensor("layers.0.feed_forward.w1.weight", (1024, 1024), gen)
    w2 = random_tensor("layers.0.feed_forward.w2.weight", (1024, 1024), gen)
    assert w2.abs().median() < w1.abs().median()  # output projections smaller (by 4x, less the jitter)
    big = (w1.abs() > 10 * w1.abs().median() * 1.48).float().mean()  # past ~10 sigma: only outliers
    assert 2e-5 < big < 5e-4
    plain = random_tensor("layers.0.feed_forward.w1.weight", (1024, 1024), gen, realistic=False)
    assert abs(plain.std() - 0.02) < 1e-3

"""The lossless layer code (``zimage_core.compression``): every bf16 bit pattern comes back as it
went in, across chunk borders, and trained-like weights take about 0.75 of their bf16 bytes."""
import pytest
import torch

from tools.random_weights import random_tensor
from zimage_core import compression


def roundtrip(flat):
    chunks, packed = compression.encode_all(flat)
    back = torch.full_like(flat, float("nan"))
    compression.decode_all(chunks, packed.clone(), back)
    return chunks, packed, back


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_every_bf16_bit_pattern_comes_back():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    chunks, _, back = roundtrip(every)  # zeros, subnormals, infinities, NaNs of every payload
    assert same_bits(back, every)
    assert sum(c.n_exc for c in chunks) == 65536 - 16 * 256  # 16 of 256 high bytes have a code


@pytest.mark.parametrize("numel", [1, 2, 7, 1000, 4099])
def test_chunk_borders_and_odd_sizes(monkeypatch, numel):
    monkeypatch.setattr(compression, "CHUNK", 1024)
    torch.manual_seed(numel)
    flat = (torch.randn(numel) * 0.02).to(torch.bfloat16)
    flat[::97] = 0  # exceptions in every chunk
    chunks, packed, back = roundtrip(flat)
    assert len(chunks) == -(-numel // 1024) and packed.numel() == sum(c.nbytes for c in chunks)
    assert all(c.offset % 4 == 0 for c in chunks)
    assert same_bits(back, flat)


def test_trained_like_weights_take_three_quarters():
    gen = torch.Generator().manual_seed(0)
    for key in ("layers.0.feed_forward.w1.weight", "layers.0.attention.out.weight",
                "layers.0.adaLN_modulation.0.weight"):
        flat = random_tensor(key, (512, 2048), gen).to(torch.bfloat16).view(-1)
        chunks, packed, back = roundtrip(flat)
        assert same_bits(back, flat)
        assert packed.numel() / flat.nbytes < 0.76
        assert all(c.n_exc <= compression.max_exceptions(c.numel) for c in chunks)
        assert packed.numel() <= compression.bound(flat.numel()) < 0.78 * flat.nbytes


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


def test_the_switch_reads_off_on_and_auto_and_refuses_the_rest():
    from zimage_core.environment import parse_compression
    from zimage_core.errors import SettingError
    for text, want in (("", "auto"), ("off", "off"), ("on", "on"), (" ON ", "on"), ("Auto", "auto")):
        assert parse_compression(text) == want
    with pytest.raises(SettingError, match="ZIMAGE_COMPRESSION is 'fast': set it to auto"):
        parse_compression("fast")


_KERNELS_ON_THE_CPU = """
import sys, torch
from zimage_core import compression, triton_decode
compression.CHUNK, compression.GROUP_BYTES = 30000, 100000
g = torch.Generator().manual_seed(0)
w = (torch.randn(200_003, generator=g) * 0.02).to(torch.bfloat16)
w[::97] = 0
w[5::1009] = 30.0
w[:65536] = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
chunks, packed = compression.encode_all(w)
out = torch.zeros_like(w)
runs = compression.groups(chunks)
for run in runs:
    first, nbytes = run[0].offset, sum(c.nbytes for c in run)
    triton_decode.decode(packed[first:first + nbytes], compression.table(run, "cpu"), max(c.numel for c in run),
                         max(c.n_exc for c in run), out, aligned=all(c.start % 16 == 0 and c.numel % 16 == 0 for c in run))
assert 1 < len(runs) < len(chunks) and any(c.numel % 16 for c in chunks)
sys.exit(0 if torch.equal(out.view(torch.int16), w.view(torch.int16)) else 1)
"""


def test_the_device_kernels_give_back_every_bit_in_tritons_interpreter():
    """The Triton kernels, run by Triton's interpreter on the CPU (where Triton is installed: the
    GPU test runs them compiled), on runs of chunks with and without wide loads."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _KERNELS_ON_THE_CPU], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

"""GGML block dequantization in torch (zimage_core/quants.py) against the gguf package's reference,
to the bit, for every type the pack reads; blocks of random bytes with finite scales (every byte
pattern of a quant is a valid value)."""
import numpy as np
import pytest
import torch

from zimage_core import quants

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package (pip install gguf) is the reference")

# byte offsets of each block's float16 scales
SCALES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name, n_blocks, seed):
    nbytes = quants.TYPES[type_name].nbytes
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for at in SCALES[type_name]:
        scale = (g.standard_normal(n_blocks) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("type_name", list(quants.TYPES))
def test_dequantized_weights_equal_the_gguf_reference_to_the_bit(type_name):
    elements = quants.TYPES[type_name].elements
    blocks = random_blocks(type_name, 64, seed=len(type_name))
    qtype = getattr(gguf_quants.GGMLQuantizationType, type_name)
    want = gguf_quants.dequantize(blocks.reshape(-1), qtype).reshape(8, -1)
    got = quants.dequantize(torch.from_numpy(blocks), type_name, (8, 64 * elements // 8))
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_by_the_reference_and_back(type_name):
    """Weights quantized by the gguf package dequantize to what it dequantizes them to."""
    w = (np.random.default_rng(3).standard_normal((16, 256)) * 0.02).astype(np.float32)
    qtype = getattr(gguf_quants.GGMLQuantizationType, type_name)
    data = gguf_quants.quantize(w, qtype)
    want = gguf_quants.dequantize(data, qtype)
    got = quants.dequantize(torch.from_numpy(np.ascontiguousarray(data)).reshape(-1), type_name, (16, 256))
    assert np.array_equal(got.numpy(), want) and np.abs(got.numpy() - w).max() < 0.2 * np.abs(w).max()


@pytest.mark.parametrize("type_name", list(quants.TYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_into_a_narrower_buffer_rounds_the_reference_once(type_name, dtype):
    """With ``out`` the last float32 operation writes straight into the compute dtype: the reference
    values rounded once, as ``.to(dtype)`` of them rounds."""
    elements = quants.TYPES[type_name].elements
    blocks = torch.from_numpy(random_blocks(type_name, 64, seed=7))
    out = torch.full((64, elements), float("nan"), dtype=dtype)
    quants.dequantize_blocks(blocks, type_name, out)
    assert torch.equal(out, quants.dequantize_blocks(blocks, type_name).to(dtype))


@pytest.mark.parametrize("type_name", list(quants.TYPES))
def test_pieces_of_a_run_give_the_whole_runs_weights(type_name, monkeypatch):
    """The scales are worked out once for all the blocks and the values a piece at a time: pieces of
    a few blocks (the last one short) give the reference weights of the whole run."""
    elements = quants.TYPES[type_name].elements
    blocks = random_blocks(type_name, 64, seed=11)
    want = gguf_quants.dequantize(blocks.reshape(-1), getattr(gguf_quants.GGMLQuantizationType, type_name))
    monkeypatch.setattr(quants, "PIECE", 5 * elements)
    got = quants.dequantize_blocks(torch.from_numpy(blocks), type_name)
    assert np.array_equal(got.numpy().reshape(-1).view(np.uint32), want.astype(np.float32).reshape(-1).view(np.uint32))

"""GGML block dequantization in torch (zimage_core/quants.py) against the gguf package's reference,
to the bit, for every type the pack reads; blocks of random bytes with finite scales (every byte
pattern of a quant is a valid value)."""
import numpy as np
import pytest
import torch

from zimage_core import quants

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package (pip install gguf) is the reference")


@pytest.mark.parametrize("type_name", list(quants.TYPES))
def test_dequantized_weights_equal_the_gguf_reference_to_the_bit(type_name):
    elements = quants.TYPES[type_name].elements
    blocks = quants.random_blocks(type_name, 64, seed=len(type_name)).numpy()
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
    blocks = quants.random_blocks(type_name, 64, seed=7)
    out = torch.full((64, elements), float("nan"), dtype=dtype)
    quants.dequantize_blocks(blocks, type_name, out)
    assert torch.equal(out, quants.dequantize_blocks(blocks, type_name).to(dtype))


@pytest.mark.parametrize("type_name", list(quants.TYPES))
def test_pieces_of_a_run_give_the_whole_runs_weights(type_name, monkeypatch):
    """The scales are worked out once for all the blocks and the values a piece at a time: pieces of
    a few blocks (the last one short) give the reference weights of the whole run."""
    elements = quants.TYPES[type_name].elements
    blocks = quants.random_blocks(type_name, 64, seed=11).numpy()
    want = gguf_quants.dequantize(blocks.reshape(-1), getattr(gguf_quants.GGMLQuantizationType, type_name))
    monkeypatch.setattr(quants, "PIECE", 5 * elements)
    got = quants.dequantize_blocks(torch.from_numpy(blocks), type_name)
    assert np.array_equal(got.numpy().reshape(-1).view(np.uint32), want.astype(np.float32).reshape(-1).view(np.uint32))


_KERNEL_IN_THE_INTERPRETER = """
import sys, torch
from zimage_core import quants, triton_dequant
bad = []
for name, q in quants.TYPES.items():
    blocks = quants.random_blocks(name, 37, seed=3)  # 37 blocks: a last program that is partly masked
    values = quants.dequantize_blocks(blocks, name)
    # the interpreter rounds float32 to bf16 toward zero (compiled: to nearest even, as torch does)
    toward_zero = (values.view(torch.int32) >> 16).to(torch.int16)
    for dtype, want in ((torch.float32, values.view(torch.int32)), (torch.float16, values.half().view(torch.int16)),
                        (torch.bfloat16, toward_zero)):
        got = torch.full((37, q.elements), float("nan"), dtype=dtype)
        triton_dequant.dequantize_blocks(blocks, name, got)
        if not torch.equal(got.view(want.dtype), want):
            bad.append(f"{name} {dtype}")
    for dtype in (torch.float32, torch.float16):  # the check a device runs once, here where it rounds as torch does
        if triton_dequant.check(torch.device("cpu"), name, dtype) is not None:
            bad.append(f"{name} {dtype}: check")
print(bad)
sys.exit(1 if bad else 0)
"""


def test_the_triton_kernel_gives_the_reference_bits_in_tritons_interpreter():
    """The device's one-launch dequantization (``triton_dequant``), run by Triton's interpreter on
    the CPU where Triton is installed (the GPU test runs it compiled): every type's weights equal
    ``quants``' (the gguf package's) to the bit in float32, rounded to fp16 as torch rounds them,
    and to bf16 as the interpreter rounds (toward zero; ``runs_on`` checks the compiled kernel's
    rounding against torch's)."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _KERNEL_IN_THE_INTERPRETER], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]

"""GGML's block quantizations dequantized with torch ops, on whatever device holds the bytes: a
quantized layer crosses the bus as its blocks and becomes weights where it is computed. Each
function takes blocks as bytes ([n_blocks, block bytes], uint8) and gives float32 values
([n_blocks, block elements]) equal to the ``gguf`` package's reference dequantization to the bit:
the same float32 operations in the same order (``tests/test_quants.py``). Given ``out`` (that
shape, any float dtype), the last operation writes its float32 result there, rounded once: no
float32 copy of the weights is made and copied again (a Q8_0 matrix is read once as its blocks and
written once as weights)."""
from __future__ import annotations

import torch

QK_K = 256           # elements of a K-quant super-block
K_SCALE_SIZE = 12    # bytes of a Q4_K / Q5_K block's packed 6-bit scales and mins


def _f16(blocks, start) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs, group) -> torch.Tensor:
    """Low then high nibbles of each run of ``group`` bytes: [n, runs * 2 * group] (uint8)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, -1)


def q8_0(blocks, out=None):
    d = _f16(blocks, 0)
    return torch.mul(blocks[:, 2:].view(torch.int8), d, out=out)  # int8 codes promote to float32 exactly


def q4_0(blocks, out=None):
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).to(torch.int8) - 8
    return torch.mul(d, q, out=out)


def q4_1(blocks, out=None):
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return torch.add(d * _nibbles(blocks[:, 4:], 16).float(), m, out=out)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bits 0..width-1 of each little-endian int32 in ``packed`` ([n, 1]): [n, width] (uint8)."""
    shifts = torch.arange(width, device=packed.device, dtype=torch.int32)
    return ((packed >> shifts) & 1).to(torch.uint8)


def q5_0(blocks, out=None):
    d = _f16(blocks, 0)
    qh = _bits(blocks[:, 2:6].contiguous().view(torch.int32), 32)
    q = (_nibbles(blocks[:, 6:], 16) | (qh << 4)).to(torch.int8) - 16
    return torch.mul(d, q, out=out)


def _scale_min(scales) -> tuple:
    """A K-quant block's 8 six-bit scales and 8 six-bit mins from its 12 bytes (uint8)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(blocks, n):
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min(blocks[:, 4:4 + K_SCALE_SIZE])
    return (d * sc.float()).reshape(n, -1, 1), (dmin * mn.float()).reshape(n, -1, 1)


def _into(out, n, groups):
    """``out`` ([n, elements]) viewed as [n, groups, elements / groups], or None."""
    return None if out is None else out.view(n, groups, -1)


def q4_k(blocks, out=None):
    n = blocks.shape[0]
    d, dm = _k_scales(blocks, n)
    q = _nibbles(blocks[:, 4 + K_SCALE_SIZE:], 32).reshape(n, -1, 32).float()
    return torch.sub(d * q, dm, out=_into(out, n, QK_K // 32)).reshape(n, QK_K)


def q5_k(blocks, out=None):
    n = blocks.shape[0]
    d, dm = _k_scales(blocks, n)
    start = 4 + K_SCALE_SIZE
    qh = blocks[:, start:start + QK_K // 8].reshape(n, 1, 32)
    ql = _nibbles(blocks[:, start + QK_K // 8:], 32).reshape(n, -1, 32)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 8, 1)
    high = ((qh >> shifts) & 1).reshape(n, -1, 32)
    return torch.sub(d * (ql | (high << 4)).float(), dm, out=_into(out, n, QK_K // 32)).reshape(n, QK_K)


def q6_k(blocks, out=None):
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :QK_K // 2], 64).reshape(n, -1, 32)
    qh = blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4].reshape(n, -1, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = ((qh >> shifts) & 3).reshape(n, -1, 32)
    scales = blocks[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16].contiguous().view(torch.int8).float()
    d = (_f16(blocks, QK_K // 2 + QK_K // 4 + QK_K // 16) * scales).reshape(n, QK_K // 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1)
    return torch.mul(d, q, out=_into(out, n, QK_K // 16)).reshape(n, QK_K)


# type name -> (elements, bytes) of a block and its dequantization; the types ComfyUI-GGUF users
# run Z-Image in. Others (the i-quants, Q2_K, Q3_K, Q5_1, ...) are refused by name where a file
# holds them.
TYPES = {
    "Q8_0": (32, 34, q8_0),
    "Q4_0": (32, 18, q4_0),
    "Q4_1": (32, 20, q4_1),
    "Q5_0": (32, 22, q5_0),
    "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k),
    "Q6_K": (QK_K, 210, q6_k),
}


# mixes as llama.cpp's quantizer names them: the medium K-quant keeps the feed-forward's down
# projection (w2) at 6 bits and stores the other matrices in 4
MIXES = {"Q4_K_M": {"": "Q4_K", "w2": "Q6_K"}}


def matrix_types(quant: str, names) -> dict:
    """{matrix name: GGML type} of a layer's matrices ``names`` in ``quant`` (a type or a mix)."""
    mix = MIXES.get(quant, {"": quant})
    return {name: mix.get(name, mix[""]) for name in names}


def stored_bytes(shapes: dict, quant: str, align: int = 1) -> int:
    """A layer's bytes with its matrices ({name: shape}) stored in ``quant``, each rounded up to
    ``align``: what its master and its kept blocks take."""
    total = 0
    for name, kind in matrix_types(quant, shapes).items():
        elements, nbytes, _ = TYPES[kind]
        n = -(-shapes[name][0] * shapes[name][1] // elements) * nbytes
        total += -(-n // align) * align
    return total


def dequantize(data: torch.Tensor, type_name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The weights of ``shape`` that ``data`` (the tensor's bytes, uint8) holds in GGML type
    ``type_name``, in ``dtype`` (rounded from the float32 reference values)."""
    elements, nbytes, fn = TYPES[type_name]
    out = torch.empty(shape, dtype=dtype, device=data.device)
    fn(data.reshape(-1, nbytes), out=out.view(-1, elements))
    return out

"""GGML's block quantizations dequantized with torch ops, on whatever device holds the bytes: a
quantized layer crosses the bus as its blocks and becomes weights where it is computed. Blocks come
as bytes ([n_blocks, block bytes], uint8) and become float32 values ([n_blocks, block elements])
equal to the ``gguf`` package's reference dequantization to the bit: the same float32 operations in
the same order (``tests/test_quants.py``). Given ``out`` (that shape, any float dtype), the last
operation writes its float32 result there, rounded once.

These are the reference the CPU runs, and a GPU where the one-launch kernel (``triton_dequant``,
the same bits) does not. Each type is split in two: its blocks' scales (a few floats a block,
worked out once for all the blocks given) and its values (``PIECE`` weights at a time, a handful
of kernels each): on a GPU these ops are bound by how many kernels they launch, and the per-block
scales of a K-quant take a dozen small ones."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

QK_K = 256           # elements of a K-quant super-block
K_SCALE_SIZE = 12    # bytes of a Q4_K / Q5_K block's packed 6-bit scales and mins
# weights dequantized at once: the float32 temporaries of a piece take 32 MiB beside the step, where
# a whole matrix's (10240x3840) would take 0.5 GiB
PIECE = 8 << 20


def _f16(blocks, start) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _halves(fn, qs, d, out):
    """``fn(nibbles, scale, out)`` for the low then the high nibbles of the runs of bytes ``qs``
    ([n, runs, bytes]), with ``d`` and ``out`` shaped [n, runs, 2, ...] to match: a run's low
    nibbles are the weights before its high ones."""
    fn(qs & 0x0F, d[:, :, 0], out[:, :, 0])
    fn(qs >> 4, d[:, :, 1], out[:, :, 1])


def _q8_0(blocks, d, out):
    torch.mul(blocks[:, 2:].view(torch.int8), d, out=out)  # int8 codes promote to float32 exactly


def _both(d):
    """A block's one scale ([n, 1]) for both halves of its one run: [n, 1, 2, 1]."""
    return d.view(-1, 1, 1, 1).expand(-1, 1, 2, 1)


def _q4_0(blocks, d, out):
    n = blocks.shape[0]
    _halves(lambda q, d, o: torch.mul(d, q.view(torch.int8) - 8, out=o),
            blocks[:, 2:].reshape(n, 1, 16), _both(d), out.view(n, 1, 2, 16))


def _q4_1(blocks, d, m, out):
    n = blocks.shape[0]
    _halves(lambda q, d, o: torch.add(d * q, m.view(n, 1, 1), out=o),
            blocks[:, 4:].reshape(n, 1, 16), _both(d), out.view(n, 1, 2, 16))


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bits 0..width-1 of each little-endian int32 in ``packed`` ([n, 1]): [n, width] (uint8)."""
    shifts = torch.arange(width, device=packed.device, dtype=torch.int32)
    return ((packed >> shifts) & 1).to(torch.uint8)


def _q5_0(blocks, d, out):
    n = blocks.shape[0]
    high = (_bits(blocks[:, 2:6].contiguous().view(torch.int32), 32) << 4).view(n, 1, 2, 16)
    qs = blocks[:, 6:].reshape(n, 1, 16)
    out = out.view(n, 1, 2, 16)
    for h, q in enumerate((qs & 0x0F, qs >> 4)):
        torch.mul(d.view(n, 1, 1), (q | high[:, :, h]).view(torch.int8) - 16, out=out[:, :, h])


def _scale_min(scales) -> tuple:
    """A K-quant block's 8 six-bit scales and 8 six-bit mins from its 12 bytes (uint8)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(blocks):
    """A Q4_K / Q5_K block's 8 scales and 8 mins as float32 [n, 8, 1]."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min(blocks[:, 4:4 + K_SCALE_SIZE])
    return (d * sc.float()).reshape(n, -1, 1), (dmin * mn.float()).reshape(n, -1, 1)


def _q4_k(blocks, d, dm, out):
    n = blocks.shape[0]
    v = torch.empty(n, 4, 2, 32, dtype=torch.float32, device=blocks.device)
    _halves(lambda q, d, o: torch.mul(q, d, out=o), blocks[:, 4 + K_SCALE_SIZE:].reshape(n, 4, 32),
            d.view(n, 4, 2, 1), v)
    torch.sub(v.view(n, 8, 32), dm, out=out.view(n, 8, 32))


def _q5_k(blocks, d, dm, out):
    n = blocks.shape[0]
    start = 4 + K_SCALE_SIZE
    qh = blocks[:, start:start + QK_K // 8].reshape(n, 1, 32)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).reshape(1, 8, 1)
    high = (((qh >> shifts) & 1) << 4).view(n, 4, 2, 32)  # run 2g+h's fifth bits
    qs = blocks[:, start + QK_K // 8:].reshape(n, 4, 32)
    v = torch.empty(n, 4, 2, 32, dtype=torch.float32, device=blocks.device)
    d = d.view(n, 4, 2, 1)
    for h, q in enumerate((qs & 0x0F, qs >> 4)):
        torch.mul(q | high[:, :, h], d[:, :, h], out=v[:, :, h])
    torch.sub(v.view(n, 8, 32), dm, out=out.view(n, 8, 32))


def _q6_k_scales(blocks):
    n = blocks.shape[0]
    at = QK_K // 2 + QK_K // 4  # the 16 int8 scales, then the float16 d
    scales = blocks[:, at:at + QK_K // 16].contiguous().view(torch.int8).float()
    return ((_f16(blocks, at + QK_K // 16) * scales).reshape(n, QK_K // 16, 1),)


def _q6_k(blocks, d, out):
    n = blocks.shape[0]
    # the 256 codes as [n, 2 halves, 4 runs, 32]: run r of half b takes nibble r // 2 of the low
    # bits' bytes (b, r % 2) and bits 2r, 2r+1 of the high bits' bytes (b) as its fifth and sixth
    ql = blocks[:, :QK_K // 2].reshape(n, 2, 2, 32)
    qh = blocks[:, QK_K // 2:QK_K // 2 + QK_K // 4].reshape(n, 2, 1, 32)
    codes = torch.empty(n, 2, 4, 32, dtype=torch.uint8, device=blocks.device)
    torch.bitwise_and(ql, 0x0F, out=codes[:, :, :2])
    torch.bitwise_right_shift(ql, 4, out=codes[:, :, 2:])
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    codes |= ((qh >> shifts) & 3) << 4
    torch.mul(d, (codes.view(torch.int8) - 32).view(n, QK_K // 16, 16), out=out.view(n, QK_K // 16, 16))


class Quant(NamedTuple):
    elements: int        # weights a block holds
    nbytes: int          # bytes a block takes
    scales: Callable     # blocks -> the per-block tensors ``values`` needs (first dimension: blocks)
    values: Callable     # (blocks, *scales, out) -> writes the blocks' weights into out ([n, elements])


def _d(blocks):
    return (_f16(blocks, 0),)


# the types ComfyUI-GGUF users run Z-Image in. Others (the i-quants, Q2_K, Q3_K, Q5_1, ...) are
# refused by name where a file holds them.
TYPES = {
    "Q8_0": Quant(32, 34, _d, _q8_0),
    "Q4_0": Quant(32, 18, _d, _q4_0),
    "Q4_1": Quant(32, 20, lambda b: (_f16(b, 0), _f16(b, 2)), _q4_1),
    "Q5_0": Quant(32, 22, _d, _q5_0),
    "Q4_K": Quant(QK_K, 144, _k_scales, _q4_k),
    "Q5_K": Quant(QK_K, 176, _k_scales, _q5_k),
    "Q6_K": Quant(QK_K, 210, _q6_k_scales, _q6_k),
}


# byte offsets of each type's float16 scales in its block
SCALE_BYTES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, n_blocks: int, seed: int) -> torch.Tensor:
    """``n_blocks`` blocks of random bytes with finite float16 scales (every byte pattern of a
    code is valid): what checks of a dequantization run on."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n_blocks, TYPES[type_name].nbytes), dtype=torch.uint8, generator=g)
    for at in SCALE_BYTES[type_name]:
        scale = (torch.randn(n_blocks, generator=g) * 0.01).to(torch.float16)
        blocks[:, at:at + 2] = scale.view(torch.uint8).view(n_blocks, 2)
    return blocks


def dequantize_blocks(blocks: torch.Tensor, type_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of ``blocks`` ([n, block bytes]) in GGML type ``type_name``, written to ``out``
    ([n, block elements], any float dtype; float32 made where not given): the scales of all the
    blocks at once, then ``PIECE`` weights at a time."""
    q = TYPES[type_name]
    if out is None:
        out = torch.empty(blocks.shape[0], q.elements, dtype=torch.float32, device=blocks.device)
    scales = q.scales(blocks)
    step = max(1, PIECE // q.elements)
    for a in range(0, blocks.shape[0], step):
        q.values(blocks[a:a + step], *(s[a:a + step] for s in scales), out[a:a + step])
    return out


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
        q = TYPES[kind]
        n = -(-shapes[name][0] * shapes[name][1] // q.elements) * q.nbytes
        total += -(-n // align) * align
    return total


def dequantize(data: torch.Tensor, type_name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The weights of ``shape`` that ``data`` (the tensor's bytes, uint8) holds in GGML type
    ``type_name``, in ``dtype`` (rounded from the float32 reference values)."""
    q = TYPES[type_name]
    out = torch.empty(shape, dtype=dtype, device=data.device)
    dequantize_blocks(data.reshape(-1, q.nbytes), type_name, out.view(-1, q.elements))
    return out

"""ComfyUI's INT8 weights (its mixed-precision ``int8_tensorwise`` format): int8 codes with a float32
scale per output row (or one per matrix), optionally stored rotated ("ConvRot": each row's groups of
``rotation`` inputs multiplied by a normalized Hadamard matrix before quantizing, which spreads the
outliers). A weight's value is ComfyUI's dequantization, ``codes.float() * scale``, rotated back
group by group with one float32 matrix product, then cast: the same operations in the same order,
so the values equal ComfyUI's own to the bit where its dequantized weights are used.

ComfyUI multiplies such layers with int8 activations instead (each token's row rotated and
quantized on the fly, also where a layer's config asks for full-precision products); the pack
computes with the dequantized weights (the same matrix products as for any other file), which is
what ComfyUI computes where a LoRA patches the layer on the fly."""
from __future__ import annotations

import functools

import torch

# rows dequantized at a time: a piece's float32 temporaries (about 3x its weights' bytes) stay small
ROWS_PIECE_WEIGHTS = 4 << 20


@functools.cache
def hadamard(size: int, device: torch.device) -> torch.Tensor:
    """The normalized regular Hadamard matrix of ``size`` (a power of 4), float32, as ComfyUI builds
    it: Kronecker powers of a symmetric 4x4 one, divided by sqrt(size)."""
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32, device=device)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return h / (size ** 0.5)


def is_rotation(size: int) -> bool:
    """A group size ComfyUI can rotate by: a power of 4, at least 4."""
    n = size
    while n > 1 and n % 4 == 0:
        n //= 4
    return size >= 4 and n == 1


def dequantize(codes: torch.Tensor, scale: torch.Tensor, rotation: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes`` (int8 [rows, inputs]) times ``scale`` (float32 [rows, 1], or a 0-d one for the whole
    matrix), rotated back by groups of ``rotation`` inputs (0: not rotated), as ``dtype``, into
    ``out`` ([rows, inputs]) where given. ``ROWS_PIECE_WEIGHTS`` weights at a time: a row's values
    do not depend on the rows computed beside it."""
    rows, inputs = codes.shape
    out = torch.empty(rows, inputs, dtype=dtype, device=codes.device) if out is None else out
    step = max(1, ROWS_PIECE_WEIGHTS // inputs)
    h = hadamard(rotation, codes.device).T if rotation else None
    for a in range(0, rows, step):
        part = codes[a:a + step]
        w = part.float() * (scale[a:a + step] if scale.dim() else scale)
        if h is not None:
            w = torch.matmul(w.reshape(part.shape[0], inputs // rotation, rotation), h).reshape(part.shape[0], inputs)
        out[a:a + step].copy_(w)
    return out

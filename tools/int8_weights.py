"""A Z-Image transformer written as ComfyUI's int8_tensorwise files: every layer's five big matrices
as int8 codes with a float32 scale per row (the row's largest magnitude over 127), optionally
rotated first as ComfyUI's ConvRot quantizer does (each row's groups of N inputs times a normalized
Hadamard matrix), and a ``.comfy_quant`` config per layer; everything else as stored. The files
the int8 tests and benchmarks load.

    python3 -m tools int8-weights SRC.safetensors OUT.safetensors [--convrot 256]
"""
from __future__ import annotations

import json

import torch

from zimage_core.int8_rows import hadamard

from .fp8_weights import write_layers


def write_int8(src, out, rotation: int = 0):
    """``src`` as an int8_tensorwise file ``out``; ``rotation``: the ConvRot group size (0: not
    rotated)."""
    conf = {"format": "int8_tensorwise", **({"convrot": True, "convrot_groupsize": rotation} if rotation else {})}
    config = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)

    def quantize(name, w):
        rows, inputs = w.shape
        if rotation:
            w = torch.matmul(w.reshape(rows, inputs // rotation, rotation), hadamard(rotation, w.device).T)
            w = w.reshape(rows, inputs)
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-30)
        layer = name[:-len(".weight")]
        return {name: torch.round(w / scale).clamp(-127, 127).to(torch.int8), layer + ".weight_scale": scale,
                layer + ".comfy_quant": config.clone()}

    return write_layers(src, out, quantize)

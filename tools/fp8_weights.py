"""A Z-Image transformer written as the scaled fp8 files ComfyUI makes and loads: every layer's five
big matrices in fp8 e4m3fn with a per-tensor scale (their largest magnitude over fp8's largest
value), in ComfyUI's legacy "scaled fp8" layout (a ``scaled_fp8`` marker, ``.scale_weight`` and a
``.scale_input`` of 1) or its mixed-precision quant layout (``.weight_scale`` and a ``.comfy_quant``
config per layer); everything else as stored. The files the scaled fp8 tests and benchmarks load.

    python3 -m tools fp8-weights SRC.safetensors OUT.safetensors [--mixed]
"""
from __future__ import annotations

import json

import torch

from zimage_core.checkpoint import COMFY_PREFIX, Checkpoint
from zimage_core.config import BIG_KEYS

BIG = tuple(f"{key}.weight" for key in BIG_KEYS.values())
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def write_layers(src, out, quantize, extra: dict | None = None):
    """``src`` as the safetensors file ``out``, keys behind ``model.diffusion_model.`` (as ComfyUI saves
    them): each layer's big matrices as ``quantize(key, float32 values)`` gives them ({key: tensor}),
    everything else as stored, and ``extra``'s tensors."""
    from safetensors.torch import save_file

    ck = Checkpoint(src)
    sd = dict(extra or {})
    try:
        for key in ck.keys():
            name = COMFY_PREFIX + key
            if key.endswith(BIG):
                sd.update(quantize(name, ck.tensor(key, dtype=torch.float32)))
            else:
                sd[name] = ck.tensor(key)
    finally:
        ck.close()
    save_file(sd, str(out))
    return out


def write_scaled_fp8(src, out, mixed: bool = False, formats: dict | None = None):
    """``src`` as a scaled fp8 file ``out``. ``formats``: {matrix key: format name} written instead of
    float8_e4m3fn in a mixed file (a test's unknown format)."""
    def quantize(name, w):
        scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12).reshape(())
        layer = name[:-len(".weight")]
        out = {name: (w / scale).to(torch.float8_e4m3fn)}
        if mixed:
            conf = json.dumps({"format": (formats or {}).get(name.removeprefix(COMFY_PREFIX), "float8_e4m3fn")}).encode()
            out.update({layer + ".weight_scale": scale, layer + ".comfy_quant": torch.tensor(list(conf), dtype=torch.uint8)})
        else:
            out.update({layer + ".scale_weight": scale, layer + ".scale_input": torch.ones(())})
        return out

    marker = None if mixed else {COMFY_PREFIX + "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    return write_layers(src, out, quantize, marker)

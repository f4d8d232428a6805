"""A Z-Image transformer file written as a GGUF in ComfyUI-GGUF's layout (architecture lumina2,
ComfyUI's key names), its layers' five big matrices quantized with the gguf package, every other
tensor as stored (bf16, fp16 or fp32): the files the GGUF tests and benchmarks load. The gguf
package quantizes no K-quants: Q4_K, Q5_K and Q6_K matrices are random valid blocks instead, their
scales set from the matrix's spread (values do not change speed; the images are noise).

    python3 -m tools gguf-weights SRC.safetensors OUT.gguf [--quant Q8_0|Q4_K_M|...] [--prefix]
"""
from __future__ import annotations

import numpy as np
import torch

from zimage_core import quants
from zimage_core.checkpoint import COMFY_PREFIX, Checkpoint
from zimage_core.config import BIG_KEYS

BIG = {f"{key}.weight": name for name, key in BIG_KEYS.items()}  # a matrix's key ending -> its name
PLAIN = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# a K-quant block's float16 scales: byte offsets, and how many steps of its codes a weight's spread spans
K_SCALES = {"Q4_K": ([0, 2], 32 * 8), "Q5_K": ([0, 2], 32 * 16), "Q6_K": ([208], 32 * 32)}
QUANTS = [*quants.TYPES, *quants.MIXES]


def random_k_blocks(values: np.ndarray, quant: str, seed: int) -> np.ndarray:
    """Random valid ``quant`` blocks ([rows, bytes]) for a matrix shaped like ``values``."""
    per, nbytes = quants.TYPES[quant].elements, quants.TYPES[quant].nbytes
    rows = values.shape[0]
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(rows * values.shape[1] // per, nbytes), dtype=np.uint8)
    offsets, steps = K_SCALES[quant]
    scale = np.float16(max(float(values.std()), 1e-4) / steps)
    for at in offsets:
        blocks[:, at:at + 2] = np.frombuffer(scale.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def as_f32(key, t) -> bool:
    """ComfyUI-GGUF's converter keeps 1-D and small tensors in F32, and its loader cannot read a BF16
    tensor that the model holds as a bare parameter (the pad tokens) into it."""
    return t.dim() == 1 or t.numel() <= 1024 or key.endswith("_pad_token")


def write_gguf(src, out, quant: str = "Q8_0", prefix: bool = False):
    """``src`` (any layout the loader reads) as the GGUF ``out``; ``prefix``: keys behind
    ``model.diffusion_model.``, as files saved from inside ComfyUI have them."""
    import gguf

    ck = Checkpoint(src)
    writer = gguf.GGUFWriter(str(out), "lumina2")
    try:
        for key in ck.keys():
            name = COMFY_PREFIX * prefix + key
            matrix = next((m for end, m in BIG.items() if key.endswith(end)), None)
            if matrix is not None:
                kind = quants.matrix_types(quant, [matrix])[matrix]
                values = ck.tensor(key, dtype=torch.float32).numpy()
                blocks = (random_k_blocks(values, kind, seed=len(name)) if kind in K_SCALES
                          else gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind)))
                writer.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
            else:
                t = ck.tensor(key)
                if t.dtype not in PLAIN or as_f32(key, t):
                    t = t.float()
                raw = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
                writer.add_tensor(name, np.ascontiguousarray(raw), raw_shape=list(t.shape),
                                  raw_dtype=getattr(gguf.GGMLQuantizationType, PLAIN[t.dtype]))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
        ck.close()
    return out

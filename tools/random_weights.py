"""Random Z-Image weights in the real key layouts, written tensor by tensor (no full copy in RAM).

These files measure speed and memory and exercise the loaders; they make no pictures. Values do
not change speed, but they decide how well the weights compress (``zimage_core.compression``), so
by default they are drawn closer to a trained DiT's than plain N(0, 0.02) (``realistic``). What it
assumes, from common initialisation schemes and the statistics of trained transformers:

- norm weights near 1 (1 + N(0, 0.05)); biases small (N(0, 0.01));
- each matrix its own scale: 0.02 times a log-uniform factor in [1/2, 2];
- output projections (attention out, feed-forward w2, the final linear) and adaLN modulation 4x
  smaller (scaled residual branches and near-zero modulation at initialisation);
- one weight in 10^4 an outlier, 20x its matrix's scale.

``plain`` draws N(0, 0.02) for every matrix (norms at 1), as earlier versions did.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from zimage_core.checkpoint import COMFY_PREFIX, diffusers_keys, expected_shapes
from zimage_core.config import BIG_KEYS, ZImageConfig
from zimage_core.safetensors_file import DTYPES

_NAMES = {v: k for k, v in DTYPES.items()}
OUTLIER_RATE = 1e-4
_SMALL = ("attention.out.weight", "feed_forward.w2.weight", "final_layer.linear.weight", "adaLN_modulation")


def _is_norm(key):
    return key.endswith(("norm1.weight", "norm2.weight")) or "_norm." in key or key == "cap_embedder.0.weight"


def random_tensor(key, shape, gen, device="cpu", realistic=True):
    if not realistic:
        if _is_norm(key):
            return torch.ones(shape)
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if _is_norm(key):
        return x.mul_(0.05).add_(1)
    if key.endswith("bias") or len(shape) < 2:
        return x.mul_(0.01)
    u = torch.rand((), generator=gen, device=device).item()
    scale = 0.02 * math.exp((2 * u - 1) * math.log(2)) / (4 if any(k in key for k in _SMALL) else 1)
    outliers = torch.rand(shape, generator=gen, device=device) < OUTLIER_RATE
    return x.mul_(torch.where(outliers, 20 * scale, scale))


def to_layout(key, layout):
    """Canonical key -> [(file key, row slice)] in ``layout`` ('comfyui', 'comfyui-prefixed', 'diffusers')."""
    if layout == "comfyui":
        return [(key, None)]
    if layout == "comfyui-prefixed":
        return [(COMFY_PREFIX + key, None)]
    return diffusers_keys(key)


def write_safetensors(path, tensors):
    """``tensors``: [(key, shape, dtype, make)] with ``make()`` giving the values; written in order."""
    header, offset = {}, 0
    for key, shape, dtype, _ in tensors:
        n = dtype.itemsize
        for s in shape:
            n *= s
        header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shape, dtype, make in tensors:
            t = make().to(dtype).contiguous().cpu()
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    os.replace(tmp, path)


def write_checkpoint(path, cfg: ZImageConfig, values=None, dtype=torch.bfloat16, layout="comfyui",
                     seed=0, device="cpu", shards=1, realistic=True):
    """Write a Z-Image checkpoint. ``values(key) -> tensor`` gives canonical values (random by default:
    ``random_tensor``, ``realistic`` or plain).
    Diffusers layout with ``shards`` > 1 writes ``*.safetensors.index.json`` beside the shards."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = expected_shapes(cfg)
    make_value = values or (lambda key: random_tensor(key, shapes[key], gen, device, realistic))
    entries = []
    for key in sorted(shapes):
        parts = to_layout(key, layout)
        if len(parts) == 1:
            entries.append((parts[0][0], shapes[key], dtype, lambda k=key: make_value(k)))
        else:  # q, k, v rows of a fused qkv
            cache = {}
            rows = shapes[key][0] // 3
            for name, i in parts:
                def piece(k=key, i=i):
                    if "v" not in cache:
                        cache["v"] = make_value(k)
                    out = cache["v"][i * rows:(i + 1) * rows]
                    if i == 2:
                        cache.clear()
                    return out
                entries.append((name, (rows,) + tuple(shapes[key][1:]), dtype, piece))
    if shards <= 1:
        write_safetensors(path, entries)
        return [path]
    base = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    per = -(-len(entries) // shards)
    weight_map, paths = {}, []
    for s in range(shards):
        name = f"{os.path.basename(base)}-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = entries[s * per:(s + 1) * per]
        write_safetensors(os.path.join(os.path.dirname(path), name), chunk)
        weight_map.update({e[0]: name for e in chunk})
        paths.append(os.path.join(os.path.dirname(path), name))
    index = base + ".safetensors.index.json"
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return [index]


def write_lora(path, layers: int, rank: int = 16, matrices=tuple(BIG_KEYS), seed: int = 3, cfg=ZImageConfig()):
    """A random rank-``rank`` LoRA on ``matrices`` (names of ``BIG_KEYS``) of the first ``layers`` main
    layers, in the key layout ComfyUI's stock LoRA loaders read (kohya's ``lora_unet_...``)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = cfg.big_shapes
    sd = {}
    for i in range(layers):
        for m in matrices:
            rows, cols = shapes[m]
            name = f"lora_unet_layers_{i}_{BIG_KEYS[m].replace('.', '_')}"
            sd[f"{name}.lora_up.weight"] = torch.randn(rows, rank, generator=g) * 0.02
            sd[f"{name}.lora_down.weight"] = torch.randn(rank, cols, generator=g) * 0.02
            sd[f"{name}.alpha"] = torch.tensor(float(rank))
    save_file(sd, path)
    return path

"""Random Z-Image weights in the real key layouts, written tensor by tensor (no full copy in RAM).

Values are random (normal * 0.02, norms at 1): these files measure speed and memory and
exercise the loaders; they make no pictures.
"""
from __future__ import annotations

import json
import os
import struct

import torch

from zimage_core.checkpoint import COMFY_PREFIX, diffusers_keys, expected_shapes
from zimage_core.config import ZImageConfig
from zimage_core.safetensors_file import DTYPES

_NAMES = {v: k for k, v in DTYPES.items()}


def random_tensor(key, shape, gen, device="cpu"):
    if key.endswith("norm1.weight") or key.endswith("norm2.weight") or "_norm." in key or key == "cap_embedder.0.weight":
        return torch.ones(shape)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)


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
                     seed=0, device="cpu", shards=1):
    """Write a Z-Image checkpoint. ``values(key) -> tensor`` gives canonical values (random by default).
    Diffusers layout with ``shards`` > 1 writes ``*.safetensors.index.json`` beside the shards."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = expected_shapes(cfg)
    make_value = values or (lambda key: random_tensor(key, shapes[key], gen, device))
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

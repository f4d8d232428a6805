"""End to end through a real ComfyUI server (see comfy_server.py): the official Z-Image template
with stock nodes, this pack's nodes, its example workflows, interrupt, errors, and parity.

Needs COMFYUI_PATH (skips otherwise). Random small weights: the images show nothing, but every
path (loaders, text encoder, sampler, VAE, saving) runs for real.
"""
import json
import os
import time

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import TE, UNET, VAE, comfy_base_dir, comfy_server  # noqa: F401  (fixtures)

pytestmark = needs_comfyui

PROMPT = "a lighthouse on a rocky coast at dusk, warm light, film grain"
SIZE = 128
STEPS = 2


def official_template(prompt=PROMPT, width=SIZE, height=SIZE, steps=STEPS, seed=42, prefix="official",
                      batch_size=1, unet=UNET):
    """The official Z-Image-Turbo template (ComfyUI's image_z_image_turbo), API format."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TE, "type": "lumina2", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["2", 0]}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height,
                                                              "batch_size": batch_size}},
        "7": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 3.0}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["7", 0], "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0],
            "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
            "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    }


def image_stats(img):
    import numpy as np

    a = np.asarray(img.convert("RGB"), dtype=np.float32)
    return a, f"{img.size[0]}x{img.size[1]} min {a.min():.0f} max {a.max():.0f} mean {a.mean():.1f} std {a.std():.2f}"


def test_official_template(comfy_server):
    t0 = time.monotonic()
    entry = comfy_server.run(official_template())
    dt = time.monotonic() - t0
    img = comfy_server.image(entry, "10")
    _, stats = image_stats(img)
    print(f"\nComfyUI {comfyui_version()}: official template {SIZE}x{SIZE}, {STEPS} steps: {dt:.1f} s; {stats}")
    assert img.size == (SIZE, SIZE)

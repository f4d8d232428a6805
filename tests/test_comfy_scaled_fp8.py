"""Scaled fp8 transformers (ComfyUI's legacy scaled_fp8 layout and its mixed-precision quant
layout) in the session's real ComfyUI server: the pack's loader streams every layer as its fp8
bytes and scales them where they land, and its image is ComfyUI's own UNETLoader's image of the
same file (the official template) to the pixel, as the bf16 file's is (on the CPU both compute in
fp32 with ComfyUI's dequantization, ``weight.to(dtype) * scale.to(dtype)``)."""
import os

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import scaled_fp8_weights
from test_comfy_server import PARITY_MAX_DIFF, image_stats, node_of, official_template, pack_workflow

pytestmark = needs_comfyui


@pytest.mark.parametrize("mixed", [False, True], ids=["scaled_fp8", "mixed"])
def test_a_scaled_fp8_file_makes_comfyuis_image(comfy_server, comfy_base_dir, mixed):
    import numpy as np

    name = f"z_image_turbo_fp8_{'mixed' if mixed else 'scaled'}.safetensors"
    link = os.path.join(comfy_base_dir, "models", "diffusion_models", name)
    os.symlink(scaled_fp8_weights(mixed), link)
    try:
        start = len(comfy_server.log_text())
        wf = pack_workflow(unet=name, prefix=f"fp8_{'mixed' if mixed else 'scaled'}",
                           loader={"vram": "max_resident_layers", "resident_layers": 0})
        ours, stats = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
        log = comfy_server.log_text()[start:]
        assert "loading the transformer from" in log and name in log, log[-3000:]
        theirs, _ = image_stats(comfy_server.image(comfy_server.run(official_template(unet=name, prefix="fp8_official")), "10"))
    finally:
        os.remove(link)
    diff = np.abs(ours - theirs)
    print(f"\nComfyUI {comfyui_version()}: {name}: pack vs ComfyUI's UNETLoader largest pixel difference "
          f"{int(diff.max())}, mean {diff.mean():.3f} ({stats})")
    assert theirs.std() > 1.0, "ComfyUI's image is flat: the comparison would prove nothing"
    assert int(diff.max()) <= PARITY_MAX_DIFF

"""Scaled fp8 transformers (ComfyUI's legacy scaled_fp8 layout and its mixed-precision quant
layout) in the session's real ComfyUI server: the pack's loader streams every layer as its fp8
bytes and scales them where they land, and its image is ComfyUI's own UNETLoader's image of the
same file (the official template) to the pixel, as the bf16 file's is (on the CPU both compute in
fp32 with ComfyUI's dequantization, ``weight.to(dtype) * scale.to(dtype)``). With a LoRA through
stock ``LoraLoaderModelOnly`` (the mixed layout), the pack patches the scaled weights where they land and keeps the sum
in the compute dtype, where ComfyUI rounds it back to fp8 (stochastically, seeded by the key): the
images differ by that rounding, far less than the LoRA moves them."""
import os

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_identity import write_lora
from comfy_server import model_file, transformer_weights
from test_comfy_server import PARITY_MAX_DIFF, image_stats, lora_workflow, node_of, official_template, pack_workflow

pytestmark = needs_comfyui
STRENGTH = 4.0  # the test LoRA (one layer's attention output) moves the image clearly at this strength


@pytest.mark.parametrize("mixed", [False, True], ids=["scaled_fp8", "mixed, with a LoRA"])
def test_a_scaled_fp8_file_makes_comfyuis_image(comfy_server, comfy_base_dir, mixed):
    """Both layouts against ComfyUI's own loader; the LoRA on one of them (the patch path is the
    same for both: four more images on a CPU are a minute of the suite)."""
    import numpy as np

    from tools.fp8_weights import write_scaled_fp8

    tag = "mixed" if mixed else "scaled"
    lora = os.path.join(comfy_base_dir, "models", "loras", "fp8_lora.safetensors")
    write_lora(lora, layers=1)
    streamed = {"vram": "max_resident_layers", "resident_layers": 0}
    try:
        with model_file(comfy_server, comfy_base_dir, f"z_image_turbo_fp8_{tag}.safetensors",
                        lambda out: write_scaled_fp8(transformer_weights(), out, mixed)) as name:
            start = len(comfy_server.log_text())
            wf = pack_workflow(unet=name, prefix=f"fp8_{tag}", loader=streamed)
            ours = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
            log = comfy_server.log_text()[start:]
            assert "loading the transformer from" in log and name in log, log[-3000:]
            theirs = image_stats(comfy_server.image(comfy_server.run(official_template(unet=name, prefix=f"fp8_{tag}_official")), "10"))
            if mixed:
                wf = lora_workflow("fp8_lora.safetensors", STRENGTH, unet=name, prefix=f"fp8_{tag}_lora", loader=streamed)
                ours_lora = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
                wf = official_template(unet=name, prefix=f"fp8_{tag}_official_lora")
                wf["100"] = {"class_type": "LoraLoaderModelOnly",
                             "inputs": {"model": ["1", 0], "lora_name": "fp8_lora.safetensors", "strength_model": STRENGTH}}
                wf["7"]["inputs"]["model"] = ["100", 0]
                theirs_lora = image_stats(comfy_server.image(comfy_server.run(wf), "10"))
    finally:
        os.remove(lora)
    diff = np.abs(ours[0] - theirs[0])
    print(f"\nComfyUI {comfyui_version()}: {name}: pack vs ComfyUI's UNETLoader largest pixel difference "
          f"{int(diff.max())}, mean {diff.mean():.3f} ({ours[1]})")
    assert theirs[0].std() > 1.0, "ComfyUI's image is flat: the comparison would prove nothing"
    assert int(diff.max()) <= PARITY_MAX_DIFF
    if mixed:
        diff_lora, moved = np.abs(ours_lora[0] - theirs_lora[0]), np.abs(ours_lora[0] - ours[0])
        print(f"ComfyUI {comfyui_version()}: with a LoRA at {STRENGTH}: largest pixel difference "
              f"{int(diff_lora.max())}, mean {diff_lora.mean():.3f}; the LoRA moved the image by up to "
              f"{int(moved.max())}, mean {moved.mean():.3f}")
        assert diff_lora.mean() < 0.25 * moved.mean()  # ComfyUI's fp8 rounding of the sum, not another LoRA

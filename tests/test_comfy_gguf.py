"""A GGUF transformer (ComfyUI-GGUF's layout, Q8_0) through the pack's loader in the session's real
ComfyUI server: listed beside the safetensors files, loaded with its layers streamed as their
blocks, and its image close to the bf16 file's (closer than another shift of the same seed is)."""
import os

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import gguf_weights
from test_comfy_server import image_stats, node_of, pack_run, pack_workflow  # noqa: F401 (pack_run: a fixture)

pytestmark = needs_comfyui
pytest.importorskip("gguf", reason="the gguf package (pip install gguf, as tests/comfy_venv.sh does) writes the file")
NAME = "z_image_turbo-Q8_0.gguf"


@pytest.fixture(scope="module")
def gguf_model(comfy_server, comfy_base_dir):
    link = os.path.join(comfy_base_dir, "models", "diffusion_models", NAME)
    os.symlink(gguf_weights("Q8_0"), link)
    yield NAME
    os.remove(link)


def test_a_gguf_is_listed_loaded_and_makes_the_image(comfy_server, gguf_model, pack_run):
    import numpy as np

    loader = comfy_server.get("/object_info/ZImageModelLoader")["ZImageModelLoader"]["input"]["required"]
    names = loader["unet_name"][0] if isinstance(loader["unet_name"][0], list) else loader["unet_name"][1]["options"]
    assert NAME in names, names
    start = len(comfy_server.log_text())
    # every layer streamed (its blocks in host memory, dequantized into the slots at each step): the
    # path a small card takes, and the least memory beside the session's other models
    wf = pack_workflow(unet=NAME, prefix="gguf", loader={"vram": "max_resident_layers", "resident_layers": 0})
    entry = comfy_server.run(wf)
    log = comfy_server.log_text()[start:]
    assert "loading the transformer from" in log and NAME in log, log[-3000:]
    a, stats = image_stats(comfy_server.image(entry, node_of(wf, "SaveImage")))
    b, _ = image_stats(pack_run[1])
    diff = np.abs(a - b)
    print(f"\nComfyUI {comfyui_version()}: Q8_0 GGUF against the bf16 file: largest pixel difference "
          f"{int(diff.max())}, mean {diff.mean():.3f} ({stats})")
    assert a.std() > 1.0 and diff.mean() < 2.0  # an image, and nearer than another shift (test_parity_is_sensitive)


def test_a_lora_on_a_gguf_patches_its_dequantized_weights(comfy_server, comfy_base_dir, gguf_model, tmp_path):
    """A LoRA (stock LoraLoaderModelOnly) on the GGUF's streamed layers gives ComfyUI's own image of
    the same LoRA on the weights the gguf package dequantizes (a safetensors file of them through
    the official template) to the pixel, and is gone once removed."""
    import numpy as np
    from safetensors.torch import save_file
    import torch

    from comfy_identity import sampled_again, write_lora
    from test_comfy_server import lora_workflow, official_template
    from test_gguf_file import reference

    folder = os.path.join(comfy_base_dir, "models")
    ref_name, lora_name = "gguf_dequantized.safetensors", "gguf_lora.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in reference(gguf_weights("Q8_0")).items()},
              os.path.join(folder, "diffusion_models", ref_name))
    write_lora(os.path.join(folder, "loras", lora_name), layers=1)
    streamed = {"vram": "max_resident_layers", "resident_layers": 0}
    try:
        wf = pack_workflow(unet=gguf_model, prefix="gguf_before_lora", loader=streamed)
        before = comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage"))
        wf = lora_workflow(lora_name, unet=gguf_model, prefix="gguf_lora", loader=streamed)
        ours = comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage"))
        wf = official_template(unet=ref_name, prefix="gguf_ref_lora")
        wf["100"] = {"class_type": "LoraLoaderModelOnly",
                     "inputs": {"model": ["1", 0], "lora_name": lora_name, "strength_model": 1.0}}
        wf["7"]["inputs"]["model"] = ["100", 0]
        theirs = comfy_server.image(comfy_server.run(wf), "10")
        wf = pack_workflow(unet=gguf_model, prefix="gguf_after_lora", loader=streamed)
        after = comfy_server.image(sampled_again(comfy_server, wf), node_of(wf, "SaveImage"))
    finally:
        os.remove(os.path.join(folder, "diffusion_models", ref_name))
        os.remove(os.path.join(folder, "loras", lora_name))
    (before, stats), (ours, _), (theirs, _), (after, _) = map(image_stats, (before, ours, theirs, after))
    diff = np.abs(ours - theirs)
    print(f"\nComfyUI {comfyui_version()}: LoRA on a Q8_0 GGUF against ComfyUI's LoRA on its dequantized "
          f"weights: largest pixel difference {int(diff.max())}, mean {diff.mean():.3f} ({stats})")
    assert theirs.std() > 1.0 and int(diff.max()) == 0
    assert np.abs(ours - before).max() > 0 and np.array_equal(after, before)  # it acted, and is gone

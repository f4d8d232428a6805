"""A GGUF transformer (ComfyUI-GGUF's layout, Q8_0) through the pack's loader in the session's real
ComfyUI server: listed beside the safetensors files, loaded with its layers streamed as their
blocks, and its image close to the bf16 file's (closer than another shift of the same seed is)."""
import os

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import model_file, transformer_weights
from test_comfy_server import image_stats, node_of, pack_run, pack_workflow  # noqa: F401 (pack_run: a fixture)

pytestmark = needs_comfyui
gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf, as tests/comfy_venv.sh does) writes the file")
NAME = "z_image_turbo-Q8_0.gguf"


def exact_in_bf16(path):
    """Requantize every Q8_0 block of the GGUF at ``path`` in place to a power-of-two scale, so that
    its dequantized weights (7-bit codes times a power of two) are exact in bf16: ComfyUI reads the
    reference of them as a bf16 file (1.8 GB) instead of a float32 one (3.7 GB). Each block still
    covers its values, its step at most twice the gguf package's."""
    import numpy as np

    for t in gguf.GGUFReader(path, "r+").tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        blocks = t.data.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        pow2 = np.where(d > 0, np.exp2(np.ceil(np.log2(np.where(d > 0, d, 1)))), 0).astype(np.float32)
        codes = np.clip(np.rint(q * d / np.where(pow2 > 0, pow2, 1)), -127, 127)
        blocks[:, :2] = pow2.astype(np.float16).view(np.uint8)
        blocks[:, 2:] = codes.astype(np.int8).view(np.uint8)
    return path


@pytest.fixture(scope="module")
def gguf_model(comfy_server, comfy_base_dir):
    from tools.gguf_weights import write_gguf

    with model_file(comfy_server, comfy_base_dir, NAME,
                    lambda out: exact_in_bf16(write_gguf(transformer_weights(), out, "Q8_0"))) as name:
        yield name


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


def test_a_lora_on_a_gguf_patches_its_dequantized_weights(comfy_server, comfy_base_dir, gguf_model):
    """A LoRA (stock LoraLoaderModelOnly) on the GGUF's streamed layers gives ComfyUI's own image of
    the same LoRA on the weights the gguf package dequantizes (a safetensors file of them through
    the official template) to the pixel, and is gone once removed."""
    import numpy as np
    from safetensors.torch import save_file
    import torch

    from comfy_identity import sampled_again, write_lora
    from test_comfy_server import lora_workflow, official_template
    from test_gguf_file import reference

    def write_reference(out):
        tensors = {}
        for key, values in reference(os.path.join(comfy_base_dir, "models", "diffusion_models", gguf_model)).items():
            t = torch.from_numpy(values)
            tensors[key] = t.bfloat16() if torch.equal(t.bfloat16().float(), t) else t
        assert sum(t.dtype == torch.bfloat16 for t in tensors.values()) >= 5 * 5  # every quantized matrix
        save_file(tensors, out)

    lora_name = "gguf_lora.safetensors"
    lora = os.path.join(comfy_base_dir, "models", "loras", lora_name)
    write_lora(lora, layers=1)
    streamed = {"vram": "max_resident_layers", "resident_layers": 0}
    try:
        wf = pack_workflow(unet=gguf_model, prefix="gguf_before_lora", loader=streamed)
        before = comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage"))
        wf = lora_workflow(lora_name, unet=gguf_model, prefix="gguf_lora", loader=streamed)
        ours = comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage"))
        wf = pack_workflow(unet=gguf_model, prefix="gguf_after_lora", loader=streamed)
        after = comfy_server.image(sampled_again(comfy_server, wf), node_of(wf, "SaveImage"))
        with model_file(comfy_server, comfy_base_dir, "gguf_dequantized.safetensors", write_reference) as ref_name:
            wf = official_template(unet=ref_name, prefix="gguf_ref_lora")
            wf["100"] = {"class_type": "LoraLoaderModelOnly",
                         "inputs": {"model": ["1", 0], "lora_name": lora_name, "strength_model": 1.0}}
            wf["7"]["inputs"]["model"] = ["100", 0]
            theirs = comfy_server.image(comfy_server.run(wf), "10")
    finally:
        os.remove(lora)
    (before, stats), (ours, _), (theirs, _), (after, _) = map(image_stats, (before, ours, theirs, after))
    diff = np.abs(ours - theirs)
    print(f"\nComfyUI {comfyui_version()}: LoRA on a Q8_0 GGUF against ComfyUI's LoRA on its dequantized "
          f"weights: largest pixel difference {int(diff.max())}, mean {diff.mean():.3f} ({stats})")
    assert theirs.std() > 1.0 and int(diff.max()) == 0
    assert np.abs(ours - before).max() > 0 and np.array_equal(after, before)  # it acted, and is gone

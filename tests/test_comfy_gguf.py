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

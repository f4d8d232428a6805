"""ComfyUI's int8_tensorwise transformers (int8 codes, a scale per row, ConvRot-rotated as its
quantizer writes them) in the session's real ComfyUI server: the pack's loader streams every layer
as its codes and dequantizes them where they land, to the bit as comfy-kitchen dequantizes them
(``tests/test_int8.py``). ComfyUI multiplies with int8 activations instead (each token's row
rotated and quantized on the fly, with or without the layer's ``full_precision_matrix_mult``), so
the images differ by that rounding: about as much as the int8 weights move the image from the bf16
file's, and far less than another image differs."""
import os

import pytest

from comfy_env import COMFYUI_PATH, comfyui_version, needs_comfyui
from comfy_server import model_file, transformer_weights
from test_comfy_server import image_stats, node_of, official_template, pack_run, pack_workflow  # noqa: F401 (pack_run: a fixture)


def _reads_int8() -> bool:
    path = os.path.join(COMFYUI_PATH or "", "comfy", "quant_ops.py")
    return os.path.isfile(path) and "int8_tensorwise" in open(path).read()


pytestmark = [needs_comfyui, pytest.mark.skipif(COMFYUI_PATH and not _reads_int8(),
                                                reason="this ComfyUI reads no int8_tensorwise files (v0.28 and later do)")]


def test_an_int8_convrot_file_makes_nearly_comfyuis_image(comfy_server, comfy_base_dir, pack_run):
    import numpy as np
    from tools.int8_weights import write_int8

    streamed = {"vram": "max_resident_layers", "resident_layers": 0}
    with model_file(comfy_server, comfy_base_dir, "z_image_turbo_int8_convrot.safetensors",
                    lambda out: write_int8(transformer_weights(), out, 256)) as name:
        start = len(comfy_server.log_text())
        wf = pack_workflow(unet=name, prefix="int8", loader=streamed)
        ours, stats = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
        log = comfy_server.log_text()[start:]
        assert "loading the transformer from" in log and name in log, log[-3000:]
        theirs, _ = image_stats(comfy_server.image(comfy_server.run(official_template(unet=name, prefix="int8_official")), "10"))
    bf16, _ = image_stats(pack_run[1])
    diff, moved = np.abs(ours - theirs), np.abs(ours - bf16)
    print(f"\nComfyUI {comfyui_version()}: int8 ConvRot: pack vs ComfyUI's UNETLoader (int8 activations) largest "
          f"pixel difference {int(diff.max())}, mean {diff.mean():.3f}; the pack's int8 image against its bf16 one: "
          f"up to {int(moved.max())}, mean {moved.mean():.3f} ({stats})")
    assert theirs.std() > 1.0, "ComfyUI's image is flat: the comparison would prove nothing"
    # the activations' rounding, not another image (another shift of the seed moves it by about 2 on average)
    assert int(diff.max()) <= 6 and diff.mean() < 0.5

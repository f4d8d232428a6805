"""ComfyUI's int8_tensorwise transformers (int8 codes, a scale per row, ConvRot-rotated as its
quantizer writes them) in the session's real ComfyUI server: the pack's loader streams every layer
as its codes and dequantizes them where they land. Where the file asks ComfyUI for full-precision
matrix products (its dequantized weights), the pack's image is ComfyUI's own UNETLoader's image to
the pixel; by default ComfyUI multiplies with int8 activations (each token's row quantized on the
fly) and the images differ by that quantization, less than the int8 weights move the image from
the bf16 one."""
import os

import pytest

from comfy_env import COMFYUI_PATH, comfyui_version, needs_comfyui
from comfy_server import model_file, transformer_weights
from test_comfy_server import PARITY_MAX_DIFF, image_stats, node_of, official_template, pack_run, pack_workflow  # noqa: F401 (pack_run: a fixture)


def _reads_int8() -> bool:
    path = os.path.join(COMFYUI_PATH or "", "comfy", "quant_ops.py")
    return os.path.isfile(path) and "int8_tensorwise" in open(path).read()


pytestmark = [needs_comfyui, pytest.mark.skipif(COMFYUI_PATH and not _reads_int8(),
                                                reason="this ComfyUI reads no int8_tensorwise files (v0.28 and later do)")]


@pytest.mark.parametrize("full_precision", [True, False], ids=["full-precision products", "int8 products"])
def test_an_int8_convrot_file_makes_comfyuis_image(comfy_server, comfy_base_dir, pack_run, full_precision):
    import numpy as np
    from tools.int8_weights import write_int8

    tag = "fp" if full_precision else "w8a8"
    streamed = {"vram": "max_resident_layers", "resident_layers": 0}
    with model_file(comfy_server, comfy_base_dir, f"z_image_turbo_int8_{tag}.safetensors",
                    lambda out: write_int8(transformer_weights(), out, 256, full_precision)) as name:
        start = len(comfy_server.log_text())
        wf = pack_workflow(unet=name, prefix=f"int8_{tag}", loader=streamed)
        ours, stats = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
        log = comfy_server.log_text()[start:]
        assert "loading the transformer from" in log and name in log, log[-3000:]
        theirs, _ = image_stats(comfy_server.image(comfy_server.run(official_template(unet=name, prefix=f"int8_{tag}_official")), "10"))
    bf16, _ = image_stats(pack_run[1])
    diff, moved = np.abs(ours - theirs), np.abs(ours - bf16)
    print(f"\nComfyUI {comfyui_version()}: int8 ConvRot ({'full-precision' if full_precision else 'int8'} products): "
          f"pack vs ComfyUI's UNETLoader largest pixel difference {int(diff.max())}, mean {diff.mean():.3f}; "
          f"int8 against the bf16 file: up to {int(moved.max())}, mean {moved.mean():.3f} ({stats})")
    assert theirs.std() > 1.0, "ComfyUI's image is flat: the comparison would prove nothing"
    if full_precision:
        assert int(diff.max()) <= PARITY_MAX_DIFF
    else:
        assert diff.mean() < moved.mean() and int(diff.max()) <= 4 * PARITY_MAX_DIFF

"""The pack's text encode streams Qwen3's decoder layers and gives exactly ComfyUI's conditioning (CPU)."""
import os

from comfy_env import needs_comfyui, run_check
from comfy_server import TE, te_vae_weights


@needs_comfyui
def test_streamed_text_encoder_matches_comfyui(tmp_path):
    weights = os.path.dirname(te_vae_weights()[TE])
    res = run_check(tmp_path, "comfy_te_check.py", weights)
    assert res["streamed"] == [True, True]
    assert res["equal"] == [True, True]          # torch.equal with ComfyUI's own encode
    assert res["params_untouched"] == [True, True]
    assert res["after_encode_on_device"] == ["cpu"]
    assert any("text encoder on the CPU: 36 layers in host memory" in m for m in res["log"])
    # where the RAM left cannot keep its file cached, the console says so once, and what would help
    disk = [m for m in res["log"] if "read from the disk for every new prompt" in m]
    assert len(disk) == 1 and "fp8" in disk[0] and "more RAM" in disk[0]
    # a weight patch on the text encoder (a LoRA) takes ComfyUI's path, and applies
    assert not res["streams_with_patches"] and res["patch_changed"]

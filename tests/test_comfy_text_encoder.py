"""The pack's text encode streams Qwen3's decoder layers and gives exactly ComfyUI's conditioning (CPU),
with a LoRA on them too."""
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
    # a LoRA on its layers (two stacked) streams with them, ComfyUI's conditioning to the bit; without
    # it the layers give their own values again
    assert res["streams_with_lora"] and res["lora_changed"] and res["lora_equal"]
    assert res["unpatched_equal"]
    assert any("weights of the text encoder patched" in m for m in res["log"]), res["log"]
    # a patch outside the layers takes ComfyUI's path, and applies
    assert not res["streams_outside_patch"] and res["outside_changed"]

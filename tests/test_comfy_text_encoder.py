"""The pack's text encode streams Qwen3's decoder layers and gives exactly ComfyUI's conditioning (CPU)."""
import json
import os
import subprocess
import sys

from comfy_env import COMFYUI_PATH, needs_comfyui
from comfy_server import TE, te_vae_weights

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_comfyui
def test_streamed_text_encoder_matches_comfyui(tmp_path):
    out = tmp_path / "te.json"
    weights = os.path.dirname(te_vae_weights()[TE])
    r = subprocess.run([sys.executable, os.path.join(HERE, "comfy_te_check.py"), COMFYUI_PATH, weights, str(out)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, MALLOC_PERTURB_="255"))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["streamed"] == [True, True]
    assert res["equal"] == [True, True]          # torch.equal with ComfyUI's own encode
    assert res["params_untouched"] == [True, True]
    assert res["after_encode_on_device"] == ["cpu"]
    assert any("text encoder streamed: 36 layers" in m for m in res["log"])
    # a weight patch on the text encoder (a LoRA) takes ComfyUI's path, and applies
    assert not res["streams_with_patches"] and res["patched_equal"] and res["patch_changed"]

"""The pack's decode runs the VAE from pinned masters (its unload is free) and gives exactly
ComfyUI's image, leaving ComfyUI's VAE as it found it (CPU)."""
import json
import os
import subprocess
import sys

from comfy_env import COMFYUI_PATH, needs_comfyui
from comfy_server import VAE, te_vae_weights

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_comfyui
def test_pinned_vae_matches_comfyui(tmp_path):
    out = tmp_path / "vae.json"
    weights = os.path.dirname(te_vae_weights()[VAE])
    r = subprocess.run([sys.executable, os.path.join(HERE, "comfy_vae_check.py"), COMFYUI_PATH, weights, str(out)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, MALLOC_PERTURB_="255"))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["equal"] == [True, True]  # torch.equal with a stock VAEDecode, two sizes
    assert res["pinned_loaded"] == [True, True]
    assert res["params_untouched"] == [True, True]
    assert res["dropped_when_comfy_loads"]  # a stock VAEDecode after it: one copy on the GPU
    assert res["unloaded"] and res["same_after_reload"]
    # a weight patch on the VAE takes ComfyUI's path, and applies
    assert not res["pinned_with_patches"] and res["patched_equal"] and res["patch_changed"]

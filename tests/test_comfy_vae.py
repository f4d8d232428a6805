"""The pack's decode runs the VAE from pinned masters (its unload is free) and gives exactly
ComfyUI's image, leaving ComfyUI's VAE as it found it (CPU)."""
import os

from comfy_env import needs_comfyui, run_check
from comfy_server import VAE, te_vae_weights


@needs_comfyui
def test_pinned_vae_matches_comfyui(tmp_path):
    weights = os.path.dirname(te_vae_weights()[VAE])
    res = run_check(tmp_path, "comfy_vae_check.py", weights)
    assert res["equal"] == [True, True]  # torch.equal with a stock VAEDecode, two sizes
    assert res["pinned_loaded"] == [True, True]
    assert res["params_untouched"] == [True, True]
    assert res["own_modules"] and res["same_tensors"]  # a tree of its own, no tensor copied
    assert res["dropped_when_comfy_loads"]  # a stock VAEDecode after it: one copy on the GPU
    assert res["unloaded"] and res["same_after_reload"]
    # a weight patch on the VAE takes ComfyUI's path, and applies
    assert not res["pinned_with_patches"] and res["patched_equal"] and res["patch_changed"]

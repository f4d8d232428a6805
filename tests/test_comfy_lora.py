"""fp8 and stock ComfyUI LoRA loading on the pack's MODEL: every layout ComfyUI places and every
patch kind its loaders make (lora, loha, lokr, glora, diff, set; strength 0 too), resident and
streamed layers alike, equals ComfyUI's native Z-Image with the same patches (fp32, CPU), and is
gone to the bit once removed; ten LoRA switches leave host memory as it was."""
import torch

from comfy_env import needs_comfyui, run_check
from conftest import TINY
from tools.random_weights import write_checkpoint


@needs_comfyui
def test_lora_matches_comfyui_native(tmp_path):
    weights = str(tmp_path / "tiny.safetensors")
    write_checkpoint(weights, TINY, dtype=torch.float32, seed=1)
    fp8 = str(tmp_path / "tiny_fp8.safetensors")
    write_checkpoint(fp8, TINY, dtype=torch.float8_e4m3fn, seed=1)
    res = run_check(tmp_path, "comfy_lora_check.py", weights, fp8, timeout=600)
    assert res["base_vs_native"] == 0.0
    for layout in ("comfyui", "diffusers", "trainer"):
        r = res[layout]
        assert r["not_loaded"] == [], (layout, r["not_loaded"])
        assert r["changed"] > 1e-3, f"{layout}: the LoRA changed nothing"
        assert r["vs_native"] == 0.0, (layout, r)
        assert r["vs_merged"] == 0.0, (layout, r)
        assert r["streamed_equal"], layout
    assert res["stacked_vs_native"] == 0.0
    assert res["unpatched_equal_base"]
    fp8 = res["fp8"]
    assert fp8["storage"] == "torch.float8_e4m3fn" and fp8["streamed_equal"]
    assert fp8["layer_bytes_ratio"] == 4.0  # fp32 against fp8 here; bf16 against fp8 is 2
    assert fp8["vs_native"] == 0.0, fp8
    assert fp8["lora_changed"] > 1e-3 and fp8["lora_vs_native"] == 0.0, fp8  # a LoRA on an fp8 file
    assert fp8["lora_fixed_vs_native"] == 0.0, fp8  # and on its fixed part (kept wider than fp8 by the pack)
    for kind in ("loha", "lokr", "glora", "diff", "set"):  # every patch kind ComfyUI's loaders make
        r = res[kind]
        assert r["not_loaded"] == [] and r["changed"] > 1e-3, (kind, r)
        assert r["vs_native"] == 0.0 and r["streamed_equal"], (kind, r)
        # strength 0 is no patch, as in ComfyUI, where "set" ignores the strength
        assert r["strength_0_vs_native"] == 0.0 and r["strength_0_equal"] == (kind != "set"), (kind, r)
        assert r["removed_equal"], (kind, r)
    # ten LoRA switches: no host copy of any layer per LoRA (the patches live where they are applied)
    assert res["switches_rss_growth"] < 32 << 20, res["switches_rss_growth"]
    assert res["switches_removed_equal"]

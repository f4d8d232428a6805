"""fp8 and stock ComfyUI LoRA loading on the pack's MODEL: every layout ComfyUI places, resident and
streamed layers alike, equals ComfyUI's native Z-Image with the same LoRA (fp32, CPU)."""
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

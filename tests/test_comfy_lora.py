"""fp8 and stock ComfyUI LoRA loading on the pack's MODEL: every layout ComfyUI places, resident and
streamed layers alike, equals ComfyUI's native Z-Image with the same LoRA (fp32, CPU)."""
import json
import os
import subprocess
import sys

import torch

from comfy_env import COMFYUI_PATH, needs_comfyui
from conftest import TINY
from zimage_core.random_weights import write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_comfyui
def test_lora_matches_comfyui_native(tmp_path):
    weights = str(tmp_path / "tiny.safetensors")
    write_checkpoint(weights, TINY, dtype=torch.float32, seed=1)
    fp8 = str(tmp_path / "tiny_fp8.safetensors")
    write_checkpoint(fp8, TINY, dtype=torch.float8_e4m3fn, seed=1)
    out = tmp_path / "lora.json"
    r = subprocess.run([sys.executable, os.path.join(HERE, "comfy_lora_check.py"), COMFYUI_PATH, weights, fp8, str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
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

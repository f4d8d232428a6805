"""Our transformer against ComfyUI's own NextDiT (Z-Image config) on the same random weights."""
import os
import subprocess
import sys

import pytest
import torch

from comfy_env import COMFYUI_PATH, needs_comfyui
from conftest import TINY, inputs
from zimage_core.transformer import ZImageTransformer

HERE = os.path.dirname(os.path.abspath(__file__))


def comfy_output(tmp_path, weights, x, t, ctx, dtype):
    torch.save((x, t, ctx), tmp_path / "in.pt")
    out = tmp_path / f"out_{dtype}.pt"
    r = subprocess.run([sys.executable, os.path.join(HERE, "comfy_reference.py"), COMFYUI_PATH, weights,
                        str(tmp_path / "in.pt"), dtype, str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@needs_comfyui
@pytest.mark.parametrize("dtype,limit", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_matches_comfyui_nextdit(tmp_path, tiny_file, dtype, limit):
    x, t, ctx = inputs(TINY, width=80, height=64, cap=9, batch=2)
    t = torch.tensor([0.3, 0.85])
    ref = comfy_output(tmp_path, tiny_file, x, t, ctx, dtype)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype=dtype)
    try:
        for resident in (TINY.n_blocks, 1):
            m.prepare(80, 64, 2, resident_layers=resident)
            out = m(x, t, ctx).float()
            assert out.shape == ref.shape
            rel = ((out - ref).norm() / ref.norm()).item()
            print(f"{dtype}: relative difference to ComfyUI {rel:.2e}, max abs {(out - ref).abs().max():.2e}")
            assert rel < limit
    finally:
        m.release()

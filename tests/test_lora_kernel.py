"""The fused LoRA patch's kernel (``zimage_core.triton_lora``) in Triton's interpreter on the CPU,
where Triton is installed: torch's bits for every LoRA dtype and weight dtype whose roundings the
interpreter makes as compiled code does (it rounds to bf16 toward zero; compiled code to nearest
even, which ``runs_on`` checks on each device and the GPU test proves against ComfyUI's own code)."""
import os
import subprocess
import sys

import pytest

_IN_THE_INTERPRETER = """
import sys, torch
from zimage_core import triton_lora
bad = []
cpu = torch.device("cpu")
for inter in (torch.float32, torch.float16):
    for dtype in (torch.float32, torch.float16):
        reason = triton_lora.check(cpu, inter, dtype)
        if reason:
            bad.append(reason)
    # bf16 weights read exactly; the sum rounded to the LoRA dtype
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5000, generator=g).to(torch.bfloat16)
    diff = torch.randn(5000, generator=g)
    want, got = torch.empty(5000, dtype=inter), torch.empty(5000, dtype=inter)
    triton_lora.torch_add_scaled(base, diff, 0.3, want, inter)
    triton_lora.add_scaled(base, diff, 0.3, got, inter)
    if not torch.equal(got, want):
        bad.append(f"bf16 weights patched in {inter}")
print(bad)
sys.exit(1 if bad else 0)
"""


def test_the_lora_kernel_gives_torchs_bits_in_tritons_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _IN_THE_INTERPRETER], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]

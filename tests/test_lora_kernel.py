"""The fused LoRA patch's kernel (``zimage_core.triton_lora``) in Triton's interpreter on the CPU,
where Triton is installed: torch's bits for every launch a patch makes, every LoRA dtype and weight
dtype whose roundings the interpreter makes as compiled code does (it rounds to bf16 toward zero;
compiled code to nearest even, which ``runs_on`` checks on each device and the GPU test proves
against ComfyUI's own code). The interpreter's fused multiply-add is a multiply and an add, so a
product of several terms is compared with those two roundings in the rank's order; a product of
one term has one rounding either way, and is compared with torch's own ``mm``."""
import os
import subprocess
import sys

import pytest

_IN_THE_INTERPRETER = """
import sys, torch
from zimage_core import triton_lora
bad = []
g = torch.Generator().manual_seed(1)
rows, cols = 3 * triton_lora.ROWS + 5, 2 * triton_lora.COLS + 16  # last tiles partly masked both ways


def unfused(up, down):  # the interpreter's product: each term rounded, then added, in the rank's order
    diff = torch.zeros(up.shape[0], down.shape[1])
    for k in range(up.shape[1]):
        diff = diff + up[:, k:k + 1] * down[k:k + 1]
    return diff


for inter in (torch.float32, torch.float16):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for base_dtype, out_dtype in triton_lora.launches(inter, dtype):
            if torch.bfloat16 in (inter, out_dtype):
                continue  # rounded to bf16 toward zero here
            for rank in (1, 5):
                base = torch.randn(rows, cols, generator=g).to(base_dtype)
                up, down = torch.randn(rows + 2, rank, generator=g), torch.randn(rank, cols, generator=g)
                want = torch.empty(rows, cols, dtype=out_dtype)
                if rank == 1:
                    triton_lora.torch_add_product(base, up[2:], down, 0.3, want, inter)
                else:
                    t = base.to(inter, copy=True)
                    t += (0.3 * unfused(up[2:], down)).to(inter)
                    want.copy_(t)
                got = torch.full_like(want, float("nan"))
                triton_lora.add_product(base, up, down, 0.3, got, inter, 2)
                if not torch.equal(got, want):
                    bad.append(f"{base_dtype} into {out_dtype} in {inter}, rank {rank}")
                flags = torch.zeros(2, dtype=torch.int32)
                triton_lora.add_product(base, up, down, 0.3, got, inter, 2, want, flags)
                if flags.tolist() != [0, 0]:
                    bad.append(f"{base_dtype} into {out_dtype} in {inter}, rank {rank}: checks {flags.tolist()}")
print(bad)
sys.exit(1 if bad else 0)
"""


def test_the_lora_kernel_gives_torchs_bits_in_tritons_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _IN_THE_INTERPRETER], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]

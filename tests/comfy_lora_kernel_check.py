"""The fused LoRA patch (``bridge.patches.LowRank``) against ComfyUI's own ``calculate_weight`` on
a CUDA device, in ComfyUI's process:

    python comfy_lora_kernel_check.py COMFYUI_PATH OUT.json
Writes, for each case, whether the kernel ran and whether its bits are ComfyUI's.
"""
import itertools
import json
import sys

import comfy_process

comfy_path, out_path = sys.argv[1:3]
comfy_process.start(comfy_path, cpu=False)
import torch  # noqa: E402
import comfy.model_management as mm  # noqa: E402
from comfy.weight_adapter.lora import LoRAAdapter  # noqa: E402

from zimage_pack.bridge import patches  # noqa: E402

device = torch.device("cuda")
g = torch.Generator(device=device).manual_seed(3)


def adapter(out_dim, in_dim, rank, alpha):
    up = torch.randn(out_dim, rank, generator=g, device=device).to(torch.bfloat16) * 0.05
    down = torch.randn(rank, in_dim, generator=g, device=device).to(torch.bfloat16) * 0.05
    return LoRAAdapter(set(), (up, down, alpha, None, None, None))


cases = {
    # (strength, alpha) of each stacked LoRA; alpha a CPU tensor as ComfyUI loads it, or None
    "strength 1, alpha = rank": [(1.0, torch.tensor(16.0))],
    "strength 0.8, bf16 alpha 8": [(0.8, torch.tensor(8.0, dtype=torch.bfloat16))],
    "no alpha, strength -0.37": [(-0.37, None)],
    "two stacked, 0.5 and 1.3": [(0.5, torch.tensor(4.0)), (1.3, torch.tensor(16.0))],
}
# Z-Image's matrices: the kernel makes the product in tiles, and stacked LoRAs a band of rows at a
# time; every tile and band must be those elements of ComfyUI's whole product
shapes = {"w1": (10240, 3840), "w2": (3840, 10240), "qkv": (11520, 3840), "out": (3840, 3840)}
results = {"lora_dtype": str(mm.lora_compute_dtype(device))}
for (name, loras), (matrix, (rows, cols)) in itertools.product(cases.items(), shapes.items()):
    for dtype in (torch.bfloat16, torch.float16):
        weight = (torch.randn(rows, cols, generator=g, device=device) * 0.02).to(dtype)
        entries = [(s, adapter(rows, cols, 16, a), 1.0, None, None) for s, a in loras]
        key = f"diffusion_model.layers.0.{matrix}.weight"
        _, want = patches._patched(entries, weight, key, dtype, 0)
        low_rank = patches.LowRank.of(entries, dtype, dtype, device)
        ran = low_rank is not None and low_rank.runs_on(weight)
        into_copy = low_rank(weight, torch.empty_like(weight)) if ran else None
        in_place, checked = weight.clone(), weight.clone()
        flags = torch.zeros(2, dtype=torch.int32, device=device)
        if ran:
            low_rank(in_place, in_place)
            low_rank(checked, checked, flags)  # a first result: checked as it is written
        bits = want.view(torch.int16) != weight.view(torch.int16)
        results[f"{name}, {matrix}, {dtype}"] = {
            "ran": ran,
            "same": ran and all(torch.equal(t.view(torch.int16), want.view(torch.int16))
                                for t in (into_copy, in_place, checked)),
            "changed": bool(bits.any()),
            "checks": flags.tolist() == [int(not torch.isfinite(want).all()), int(bits.any())],
        }
# a LoRA that makes a weight overflow: the checked patch says so
weight = torch.full((64, 3840), 6e4, device=device, dtype=torch.float16)
entries = [(1.0, adapter(64, 3840, 16, None), 1.0, None, None)]
for factor in entries[0][1].weights[:2]:  # each product element 16 * 400: 6e4 + 6400 is past fp16's 65504
    factor.fill_(20.0)
flags = torch.zeros(2, dtype=torch.int32, device=device)
low_rank = patches.LowRank.of(entries, torch.float16, torch.float16, device)
ran = low_rank is not None and low_rank.runs_on(weight)
if ran:
    low_rank(weight, weight, flags)
results["an overflow to infinity"] = {"ran": ran, "same": True, "changed": True,
                                      "checks": flags.tolist() == [1, 1]}
with open(out_path, "w") as f:
    json.dump(results, f, indent=1)

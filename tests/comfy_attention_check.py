"""Which attention the pack's transformer runs (bridge/model.py: attention), in ComfyUI's process:
torch's own choice only where ComfyUI runs its default SDPA and the card is one where torch puts
cuDNN's kernel first (the card's compute capability stood in for, as there is no GPU here).

    python comfy_attention_check.py COMFYUI_PATH FLAG... OUT.json
"""
import json
import sys

import comfy_process

comfy_path, flags, out_path = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
comfy_process.start(comfy_path, flags=flags)
import torch  # noqa: E402

from zimage_pack.bridge import model as zc  # noqa: E402
from zimage_pack.zimage_core.dit import sdpa_attention  # noqa: E402


def picks(device, capability=None):
    torch.cuda.get_device_capability = lambda device=None: capability
    fn = zc.attention(torch.device(device))
    return {sdpa_attention: "torch", zc.comfy_attention: "comfy"}[fn]


with open(out_path, "w") as f:
    json.dump({"cpu": picks("cpu"), **{f"{c[0]}.{c[1]}": picks("cuda", c) for c in
                                        ((7, 5), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))}}, f)

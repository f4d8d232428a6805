"""The pack's streamed text encoder against ComfyUI's own encode, in ComfyUI's process (CPU).

    python comfy_te_check.py COMFYUI_PATH WEIGHTS_DIR OUT.json
WEIGHTS_DIR holds qwen_3_4b.safetensors. Writes the measurements the test asserts on.
"""
import json
import logging
import os
import sys

import comfy_process

comfy_path, weights, out_path = sys.argv[1:4]
comfy_process.start(comfy_path)
import torch  # noqa: E402
import comfy.lora  # noqa: E402
import comfy.sd  # noqa: E402

from zimage_pack.bridge import text_encoder as zc  # noqa: E402
from zimage_pack.zimage_core import ram  # noqa: E402

messages = []


class Watch(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


logging.getLogger().addHandler(Watch())
logging.getLogger().setLevel(logging.INFO)
clip = comfy.sd.load_clip([os.path.join(weights, "qwen_3_4b.safetensors")],
                          clip_type=comfy.sd.CLIPType.LUMINA2)
# the second encode runs under a RAM cap; the same prompt lets ComfyUI's encode be made once
prompts = ["a lighthouse on a cliff at dawn"] * 2
params = {k: v.data_ptr() for k, v in clip.cond_stage_model.state_dict().items()}
res = {"streamed": [], "equal": [], "params_untouched": []}
first = stock = None
for i, prompt in enumerate(prompts):
    if i == 1:
        # RAM too short to keep the text encoder's file cached (here a 16 GB machine with 6 GiB
        # available, as /proc/meminfo would say; on a machine short of RAM already, it was said
        # before): said once, and the encode is still ComfyUI's. A ZIMAGE_PINNED_GIB cap alone
        # would not say it: the cap limits the pack's copies, not the page cache.
        os.environ["ZIMAGE_PINNED_GIB"] = "0.5"
        short = os.path.join(os.path.dirname(out_path), "meminfo")
        with open(short, "w") as f:
            f.write("MemTotal:       16777216 kB\nMemAvailable:    6291456 kB\n")
        real_meminfo, ram.MEMINFO = ram.MEMINFO, short
    ours = zc.encode(clip, prompt)
    first = first or ours
    res["streamed"].append(zc.streamed_text_encoder(clip) is not None)
    res["params_untouched"].append({k: v.data_ptr() for k, v in clip.cond_stage_model.state_dict().items()} == params)
    stock = stock or clip.encode_from_tokens_scheduled(clip.tokenize(prompt))
    res["equal"].append(len(ours) == len(stock) and all(
        torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() for a, b in zip(ours, stock)))
del os.environ["ZIMAGE_PINNED_GIB"]
ram.MEMINFO = real_meminfo
res["pinned"] = zc.streamed_text_encoder(clip).patcher.pinned_memory_size()


def conditioning(c):
    return c[0][0]


def lora(clip, suffixes, rank=4, seed=0):
    """A LoRA file's tensors (ComfyUI's key names for this text encoder) on the weights ending in
    ``suffixes``."""
    g = torch.Generator().manual_seed(seed)
    sd = clip.cond_stage_model.state_dict()
    names = {v: k for k, v in comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {}).items()}
    out = {}
    for key in (k for k in sd if k.endswith(suffixes)):
        rows, cols = sd[key].shape
        out[f"{names[key]}.lora_up.weight"] = torch.randn(rows, rank, generator=g).to(torch.bfloat16) * 0.05
        out[f"{names[key]}.lora_down.weight"] = torch.randn(rank, cols, generator=g).to(torch.bfloat16) * 0.05
        out[f"{names[key]}.alpha"] = torch.tensor(rank / 2)
    return out


# a LoRA on the text encoder's layers through ComfyUI's LoRA loader (two, stacked, at 0.8 and 0.5):
# the streamed layers get it as they arrive, with ComfyUI's arithmetic; its own encode of the same
# CLIP to the bit
_, patched = comfy.sd.load_lora_for_models(None, clip, lora(clip, ("layers.0.mlp.down_proj.weight",
                                                                   "layers.1.self_attn.q_proj.weight")), 0, 0.8)
_, patched = comfy.sd.load_lora_for_models(None, patched, lora(clip, ("layers.1.self_attn.q_proj.weight",), seed=1),
                                           0, 0.5)
tokens = clip.tokenize(prompts[0])
res["streams_with_lora"] = zc.streamed_text_encoder(patched) is not None
ours_patched = conditioning(zc.encode(patched, prompts[0]))  # each encode of the 36 layers takes seconds on a CPU
res["lora_changed"] = not torch.equal(ours_patched, conditioning(first))
res["lora_equal"] = torch.equal(ours_patched, conditioning(patched.encode_from_tokens_scheduled(tokens)))
# the CLIP without it again: the layers' own values
res["unpatched_equal"] = torch.equal(conditioning(zc.encode(clip, prompts[0])), conditioning(first))
# a patch outside the layers (the token embeddings; the final norm is not used: Z-Image takes the
# hidden states before it): ComfyUI's own path, which applies it
outside = clip.clone()
key = next(k for k in outside.patcher.model.state_dict() if k.endswith("embed_tokens.weight"))
outside.add_patches({key: (torch.full_like(outside.patcher.model.state_dict()[key], 0.01),)}, 1.0)
res["streams_outside_patch"] = zc.streamed_text_encoder(outside) is not None
res["outside_changed"] = not torch.equal(conditioning(zc.encode(outside, prompts[0])), conditioning(first))
res["log"] = [m for m in messages if "Z-Image" in m]
res["after_encode_on_device"] = sorted({str(p.device) for p in clip.cond_stage_model.parameters()})
with open(out_path, "w") as f:
    json.dump(res, f)

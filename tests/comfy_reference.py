"""Run ComfyUI's own NextDiT (Z-Image config) on a checkpoint: the parity reference.

    python comfy_reference.py COMFYUI_PATH WEIGHTS INPUTS.pt DTYPE OUT.pt
Runs in its own process because ComfyUI parses its command line at import.
"""
import sys

import comfy_process

comfy_path, weights, inputs, dtype_name, out_path = sys.argv[1:6]
comfy_process.start(comfy_path)
import torch  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.utils  # noqa: E402
from comfy.ldm.lumina.model import NextDiT  # noqa: E402

dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
sd = comfy.utils.load_torch_file(weights)
dim, cap_dim = sd["cap_embedder.1.weight"].shape
head_dim = sd["layers.0.attention.q_norm.weight"].shape[0]
n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
n_ref = len({k.split(".")[1] for k in sd if k.startswith("noise_refiner.")})
heads = dim // head_dim
a0 = head_dim // 4
model = NextDiT(patch_size=2, in_channels=16, dim=dim, n_layers=n_layers, n_refiner_layers=n_ref, n_heads=heads,
                n_kv_heads=heads, multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True,
                cap_feat_dim=cap_dim, axes_dims=[a0, (head_dim - a0) // 2, (head_dim - a0) // 2],
                axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True, time_scale=1000.0,
                pad_tokens_multiple=32, device="cpu", dtype=dtype, operations=comfy.ops.disable_weight_init)
model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
x, t, ctx = torch.load(inputs)
with torch.no_grad():
    out = model(x.to(dtype), t, context=ctx.to(dtype), num_tokens=ctx.shape[1], attention_mask=None,
                transformer_options={})
torch.save(out.float(), out_path)

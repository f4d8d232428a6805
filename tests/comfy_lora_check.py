"""LoRA and fp8 on the pack's MODEL against ComfyUI's native Z-Image, in ComfyUI's own process (CPU).

    python comfy_lora_check.py COMFYUI_PATH WEIGHTS FP8_WEIGHTS OUT.json
Writes the measurements the test asserts on.
"""
import json
import logging
import sys

import comfy_process

comfy_path, weights, fp8_weights, out_path = sys.argv[1:5]
comfy_process.start(comfy_path)
import torch  # noqa: E402
import comfy.model_base  # noqa: E402
import comfy.model_management as mm  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.supported_models  # noqa: E402
import comfy.utils  # noqa: E402

from zimage_pack.bridge import model as zc  # noqa: E402
from zimage_pack.zimage_core.checkpoint import Checkpoint  # noqa: E402
from zimage_pack.zimage_core.settings import Settings  # noqa: E402
from zimage_pack.zimage_core.transformer import ZImageTransformer  # noqa: E402

not_loaded = []


class Watch(logging.Handler):
    def emit(self, record):
        if "NOT LOADED" in record.getMessage() or "lora key not loaded" in record.getMessage():
            not_loaded.append(record.getMessage())


logging.getLogger().addHandler(Watch())
ck = Checkpoint(weights)
cfg = ck.config
shapes = {k: tuple(v.shape) for k, v in [(k, ck.tensor(k)) for k in ck.keys()]}
ck.close()
g = torch.Generator().manual_seed(5)
R = 4


def pair(out_dim, in_dim):
    return (torch.randn(out_dim, R, generator=g) * 0.05, torch.randn(R, in_dim, generator=g) * 0.05)


def lora_comfy(keys, alpha=2.0):
    sd, merged = {}, {}
    for k in keys:
        up, down = pair(*shapes[k])
        name = "lora_unet_" + k[:-len(".weight")].replace(".", "_")
        sd[name + ".lora_up.weight"], sd[name + ".lora_down.weight"] = up, down
        sd[name + ".alpha"] = torch.tensor(alpha)
        merged[k] = (alpha / R) * (up @ down)
    return sd, merged


def lora_diffusers(layer, prefix):
    """PEFT layout of the official / diffusers model: to_q, to_k, to_v land in the fused qkv."""
    sd, merged = {}, {}
    d = cfg.dim
    qkv = torch.zeros(3 * d, d)
    for j, n in enumerate(("to_q", "to_k", "to_v")):
        up, down = pair(d, d)
        sd[f"{prefix}layers.{layer}.attention.{n}.lora_B.weight"] = up
        sd[f"{prefix}layers.{layer}.attention.{n}.lora_A.weight"] = down
        qkv[j * d:(j + 1) * d] = up @ down
    merged[f"layers.{layer}.attention.qkv.weight"] = qkv
    up, down = pair(d, d)
    sd[f"{prefix}layers.{layer}.attention.to_out.0.lora_B.weight"] = up
    sd[f"{prefix}layers.{layer}.attention.to_out.0.lora_A.weight"] = down
    merged[f"layers.{layer}.attention.out.weight"] = up @ down
    return sd, merged


def native_model(path=weights, unet_dtype=torch.float32, manual_cast=None):
    """What UNETLoader builds (its detection wants the full-size dim, so it is built directly)."""
    uc = {k: v for k, v in zc.unet_config(cfg).items() if k != "disable_unet_model_creation"}
    mc = comfy.supported_models.ZImage(uc)
    mc.set_inference_dtype(unet_dtype, manual_cast)
    base = comfy.model_base.Lumina2(mc, device=None)
    sd = comfy.utils.load_torch_file(path)
    base.load_model_weights(sd, "")
    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())


x = torch.randn(1, 16, 8, 10, generator=g)
ctx = torch.randn(1, 7, cfg.cap_feat_dim, generator=g)
sigma = torch.tensor([0.6])


def run(patcher):
    with torch.no_grad():  # as ComfyUI's executor loads and runs (comfy-kitchen's fp8 rounding needs it)
        mm.load_models_gpu([patcher])
        return patcher.model.apply_model(x, sigma, c_crossattn=ctx, num_tokens=7).float()


def rel(a, b):
    return float((a - b).norm() / b.norm())


pack = zc.load_model(weights)
every_layer_streamed = zc.load_model(weights, settings=Settings(max_resident=0))
native = native_model()
results = {"dtype": str(pack.model_dtype())}
base_out = run(pack)
results["base_vs_native"] = rel(base_out, run(native))

layers = [f"layers.{i}.{m}.weight" for i in range(cfg.n_layers) for m in
          ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
others = ["layers.0.adaLN_modulation.0.weight", "x_embedder.weight", "noise_refiner.0.feed_forward.w2.weight",
          "context_refiner.0.attention.qkv.weight"]
variants = {
    "comfyui": lora_comfy(layers + others),
    "diffusers": lora_diffusers(0, "diffusion_model."),
    "trainer": lora_diffusers(cfg.n_layers - 1, "transformer."),
}
reference = ZImageTransformer.load(weights, device="cpu", dtype="fp32", attention=zc.comfy_attention)
for name, (sd, merged) in variants.items():
    not_loaded.clear()
    strength = 0.8
    p = comfy.sd.load_lora_for_models(pack, None, sd, strength, 0)[0]
    n = comfy.sd.load_lora_for_models(native, None, sd, strength, 0)[0]
    out = run(p)
    r = {"not_loaded": list(not_loaded), "vs_native": rel(out, run(n)), "changed": rel(out, base_out)}
    for k, delta in merged.items():  # base + merged weights, computed here
        reference.weights.set(k, reference.weights.base(k) + strength * delta)
    reference.prepare(80, 64, resident_layers=cfg.n_blocks)
    ref_out = reference(x, sigma, ctx, 7).float()
    r["vs_merged"] = rel(out, x - ref_out * sigma)  # apply_model returns the denoised latent
    for k in merged:
        reference.weights.set(k, reference.weights.base(k))
    streamed = run(comfy.sd.load_lora_for_models(every_layer_streamed, None, sd, strength, 0)[0])
    r["streamed_equal"] = bool(torch.equal(streamed, out))
    results[name] = r

# stacking two LoRAs, then removing them
sd1, _ = variants["comfyui"]
sd2, _ = variants["diffusers"]
p2 = comfy.sd.load_lora_for_models(comfy.sd.load_lora_for_models(pack, None, sd1, 0.5, 0)[0], None, sd2, 1.0, 0)[0]
n2 = comfy.sd.load_lora_for_models(comfy.sd.load_lora_for_models(native, None, sd1, 0.5, 0)[0], None, sd2, 1.0, 0)[0]
results["stacked_vs_native"] = rel(run(p2), run(n2))
results["unpatched_equal_base"] = bool(torch.equal(run(pack), base_out))
# fp8 e4m3fn storage: streamed as fp8, upcast for compute, against ComfyUI's fp8 + manual cast
f8 = zc.load_model(fp8_weights)
t8 = f8.zimage
n8 = native_model(fp8_weights, torch.float8_e4m3fn, t8.dtype)
out8 = run(f8)
streamed8 = run(zc.load_model(fp8_weights, settings=Settings(max_resident=0)))
results["fp8"] = {"storage": str(t8.storage_dtype), "compute": str(t8.dtype), "vs_native": rel(out8, run(n8)),
                  "streamed_equal": bool(torch.equal(streamed8, out8)),
                  "layer_bytes_ratio": pack.zimage.streamer.layout.nbytes / t8.streamer.layout.nbytes}
# a LoRA on the fp8 file: patched in fp32, rounded back to fp8 as ComfyUI rounds it (streamed, max_resident 0)
sd_big, _ = lora_comfy(layers)
sd1_8 = comfy.sd.load_lora_for_models(f8, None, sd_big, 0.8, 0)[0]
n8_lora = comfy.sd.load_lora_for_models(n8, None, sd_big, 0.8, 0)[0]
out8_lora = run(sd1_8)
results["fp8"]["lora_vs_native"] = rel(out8_lora, run(n8_lora))
results["fp8"]["lora_changed"] = rel(out8_lora, out8)
sd1_8b = comfy.sd.load_lora_for_models(f8, None, sd1, 0.8, 0)[0]
n8_lorab = comfy.sd.load_lora_for_models(n8, None, sd1, 0.8, 0)[0]
results["fp8"]["lora_fixed_vs_native"] = rel(run(sd1_8b), run(n8_lorab))


def kind_sd(kind, key):
    """A patch of ``kind`` for transformer ``key`` in the layout ComfyUI's LoRA loader reads."""
    out_dim, in_dim = shapes[key]
    name = "lora_unet_" + key[:-len(".weight")].replace(".", "_")

    def rn(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale
    parts = {
        "loha": {"hada_w1_a": rn(out_dim, R, scale=0.4), "hada_w1_b": rn(R, in_dim, scale=0.4),
                 "hada_w2_a": rn(out_dim, R, scale=0.4), "hada_w2_b": rn(R, in_dim, scale=0.4), "alpha": torch.tensor(2.0)},
        "lokr": {"lokr_w1": rn(2, 2, scale=0.5), "lokr_w2": rn(out_dim // 2, in_dim // 2)},
        "glora": {"a1.weight": rn(in_dim, R), "a2.weight": rn(R, in_dim), "b1.weight": rn(out_dim, R),
                  "b2.weight": rn(R, in_dim), "alpha": torch.tensor(2.0)},
        "diff": {"diff": rn(out_dim, in_dim, scale=0.01)},
        "set": {"set_weight": rn(out_dim, in_dim)},
    }[kind]
    return {f"{name}.{k}": v for k, v in parts.items()}


# every patch kind ComfyUI's loaders make, on a resident and a streamed layer's matrix and a refiner's
# (max_resident 0: all streamed), strength 1 and 0, and each removed again
kind_keys = ["layers.0.feed_forward.w1.weight", f"layers.{cfg.n_layers - 1}.attention.out.weight",
             "noise_refiner.0.feed_forward.w2.weight"]
for kind in ("loha", "lokr", "glora", "diff", "set"):
    sd = {k: v for key in kind_keys for k, v in kind_sd(kind, key).items()}
    not_loaded.clear()
    p = comfy.sd.load_lora_for_models(pack, None, sd, 0.7, 0)[0]
    n = comfy.sd.load_lora_for_models(native, None, sd, 0.7, 0)[0]
    out, ref = run(p), run(n)
    streamed = run(comfy.sd.load_lora_for_models(every_layer_streamed, None, sd, 0.7, 0)[0])
    zero = run(comfy.sd.load_lora_for_models(pack, None, sd, 0.0, 0)[0])
    zero_native = run(comfy.sd.load_lora_for_models(native, None, sd, 0.0, 0)[0])
    results[kind] = {"not_loaded": list(not_loaded), "vs_native": rel(out, ref), "changed": rel(out, base_out),
                     "streamed_equal": bool(torch.equal(streamed, out)), "strength_0_equal": bool(torch.equal(zero, base_out)),
                     "strength_0_vs_native": rel(zero, zero_native),
                     "removed_equal": bool(torch.equal(run(pack), base_out))}


def anon_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) * 1024


# ten switches between two LoRAs (and none): no host copy per LoRA, so nothing grows
sd_a, sd_b = lora_comfy(layers)[0], lora_comfy(layers)[0]
run(comfy.sd.load_lora_for_models(pack, None, sd_a, 1.0, 0)[0])
run(pack)
before = anon_rss()
for i in range(10):
    run(comfy.sd.load_lora_for_models(pack, None, sd_a if i % 2 else sd_b, 1.0, 0)[0])
results["switches_rss_growth"] = anon_rss() - before
results["switches_removed_equal"] = bool(torch.equal(run(pack), base_out))
with open(out_path, "w") as f:
    json.dump(results, f)

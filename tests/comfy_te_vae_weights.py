"""Write a small random Qwen3-4B text encoder (the first layers and every norm) and a random Flux AE in the exact key layout that
ComfyUI's own classes have (built on the meta device, so nothing big is allocated).

    python comfy_te_vae_weights.py COMFYUI_PATH OUT_DIR [--te-layers 2] [--device cuda]

Writes OUT_DIR/qwen_3_4b.safetensors and OUT_DIR/ae.safetensors (bf16 text encoder, fp32 VAE).
Values: normalization weights 1 (biases 0), everything else normal * 0.02. They make no pictures:
they exercise the loaders and the graph. Runs in its own process because ComfyUI parses its
command line at import.
"""
import argparse
import os
import time

import comfy_process


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("comfy")
    ap.add_argument("out")
    ap.add_argument("--te-layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is faster)")
    a = ap.parse_args()

    comfy_process.start(a.comfy)
    import torch
    from safetensors.torch import save_file

    import comfy.ops
    from comfy.ldm.models.autoencoder import AutoencodingEngine
    from comfy.text_encoders.llama import Qwen3_4B

    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator(a.device).manual_seed(a.seed)

    def is_norm(key, shape):
        parts = key.split(".")
        return len(shape) == 1 and len(parts) >= 2 and "norm" in parts[-2]

    def value(key, shape, dtype):
        if is_norm(key, shape):
            return (torch.ones if key.endswith("weight") else torch.zeros)(shape, dtype=dtype)
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=a.device).mul_(0.02).to("cpu", dtype)

    def dump(model, path, dtype, keep=lambda key, shape: True):
        t0 = time.time()
        sd = {k: value(k, tuple(v.shape), dtype) for k, v in model.state_dict().items() if keep(k, tuple(v.shape))}
        tmp = f"{path}.{os.getpid()}.partial"
        save_file(sd, tmp)
        os.replace(tmp, path)
        n = sum(v.numel() for v in sd.values())
        print(f"{os.path.basename(path)}: {len(sd)} tensors, {n / 1e6:.0f} M params, {time.time() - t0:.1f} s",
              flush=True)

    def first_layers_and_every_norm(key, shape):
        """The first --te-layers layers whole, and the norms of all 36: ComfyUI leaves a key the file
        lacks uninitialised, and a norm weight from reused memory is often NaN, which makes the
        output NaN at random. The big matrices it lacks are fresh pages from the OS: zeros."""
        parts = key.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
        return layer < a.te_layers or len(shape) == 1

    with torch.device("meta"):
        te = Qwen3_4B({}, dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init)
    dump(te, os.path.join(a.out, "qwen_3_4b.safetensors"), torch.bfloat16, keep=first_layers_and_every_norm)
    del te

    # Flux AE (16 latent channels), the key layout of ae.safetensors.
    dd = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
          "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        ae = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": dd},
            decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": dd})
    dump(ae, os.path.join(a.out, "ae.safetensors"), torch.float32)


if __name__ == "__main__":
    main()

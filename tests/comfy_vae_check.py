"""The pack's decode with the VAE run from pinned masters, against ComfyUI's own VAEDecode, in
ComfyUI's process (CPU).

    python comfy_vae_check.py COMFYUI_PATH WEIGHTS_DIR OUT.json
WEIGHTS_DIR holds ae.safetensors. Writes the measurements the test asserts on.
"""
import importlib
import json
import os
import sys

import comfy_process

comfy_path, weights, out_path = sys.argv[1:4]
comfy_process.start(comfy_path)
import torch  # noqa: E402
import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
import nodes  # noqa: E402

pack = importlib.import_module("zimage_pack.nodes")
zc = importlib.import_module("zimage_pack.bridge.vae")

vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(os.path.join(weights, "ae.safetensors")))
own = {k: v.data_ptr() for k, v in vae.first_stage_model.state_dict().items()}
latents = [{"samples": torch.randn(1, 16, 8, s, generator=torch.Generator().manual_seed(s))} for s in (8, 12)]
res = {"equal": [], "params_untouched": [], "pinned_loaded": []}
with torch.inference_mode():  # as ComfyUI's executor runs nodes
    for latent in latents:
        ours = pack.ZImageDecode.execute(vae, latent).result[0]
        pinned = zc.pinned_vae(vae)
        res["pinned_loaded"].append(pinned is not None and pinned.loaded_size() == pinned.model_size() > 0)
        res["params_untouched"].append({k: v.data_ptr() for k, v in vae.first_stage_model.state_dict().items()} == own)
        # the pack runs modules of its own (what ComfyUI sets on its modules as it loads them stays
        # off them) over the model's own tensors
        res.setdefault("own_modules", {id(m) for m in pinned.model.modules()}.isdisjoint(
            id(m) for m in vae.first_stage_model.modules()))
        res.setdefault("same_tensors", {k: v.data_ptr() for k, v in pinned.model.state_dict().items()} == own)
        res["equal"].append(torch.equal(ours, nodes.VAEDecode().decode(vae, latent)[0]))
        # ComfyUI's own first load of the VAE drops the pack's copies (later ones, on the CPU,
        # find its weights still in place and load nothing)
        res.setdefault("dropped_when_comfy_loads", pinned.loaded_size() == 0)
    # the model manager making room unloads the pack's VAE copies; the next decode loads them again
    pack.ZImageDecode.execute(vae, latents[0])
    mm.free_memory(1e30, mm.get_torch_device())
    res["unloaded"] = pinned.loaded_size() == 0
    res["same_after_reload"] = torch.equal(pack.ZImageDecode.execute(vae, latents[0]).result[0],
                                           nodes.VAEDecode().decode(vae, latents[0])[0])
    # a weight patch on the VAE takes ComfyUI's path, and applies
    patched = comfy.sd.VAE(sd=comfy.utils.load_torch_file(os.path.join(weights, "ae.safetensors")))
    key = next(k for k in patched.patcher.model.state_dict() if k.endswith("decoder.conv_out.weight"))
    patched.patcher.add_patches({key: (torch.randn_like(patched.patcher.model.state_dict()[key]) * 0.01,)}, 1.0)
    res["pinned_with_patches"] = zc.pinned_vae(patched) is not None
    res["patched_equal"] = torch.equal(pack.ZImageDecode.execute(patched, latents[0]).result[0],
                                       nodes.VAEDecode().decode(patched, latents[0])[0])
    res["patch_changed"] = not torch.equal(pack.ZImageDecode.execute(patched, latents[0]).result[0],
                                           pack.ZImageDecode.execute(vae, latents[0]).result[0])
with open(out_path, "w") as f:
    json.dump(res, f)

"""The workflows a server benchmark (``server_bench.py``) posts: the pack's API workflow, ComfyUI's
official Z-Image template, and the images of an evening (``SESSION``: LoRAs on, off, switched,
stacked and at another strength, a second size, the stock-nodes workflow, a second checkpoint)."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TE, VAE = "qwen_3_4b.safetensors", "ae.safetensors"


def set_inputs(wf, class_types, **values):
    nodes = [n for n in wf.values() if n.get("class_type") in class_types]
    for name, value in values.items():
        targets = [n for n in nodes if name in n["inputs"]]
        if not targets:
            raise SystemExit(f"the workflow has no {'/'.join(class_types)} node with an input {name!r}")
        for n in targets:
            n["inputs"][name] = value


def pack_workflow(a, prompt, unet=None, width=None, height=None):
    with open(os.path.join(ROOT, "workflows", "api", "z_image_turbo.json")) as f:
        wf = json.load(f)
    set_inputs(wf, ("ZImageModelLoader",), unet_name=unet or a.unet)
    set_inputs(wf, ("ZImageTextEncode",), text=prompt)
    set_inputs(wf, ("ZImageSampler",), width=width or a.size, height=height or a.size, batch_size=a.batch,
               seed=a.seed, steps=a.steps)
    return wf


def official_workflow(a, prompt, unet=None, width=None, height=None):
    """ComfyUI's official Z-Image-Turbo template, in API format."""
    width, height = width or a.size, height or a.size
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet or a.unet, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TE, "type": "lumina2", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": prompt}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": a.batch}},
        "7": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 3.0}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["7", 0], "seed": a.seed, "steps": a.steps, "cfg": 1.0, "sampler_name": "res_multistep",
            "scheduler": "simple", "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0],
            "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "official"}},
    }


def gguf_workflow(a, prompt, unet=None, width=None, height=None):
    """The official template with ComfyUI-GGUF's loader (``UnetLoaderGGUF``) for the .gguf file."""
    wf = official_workflow(a, prompt, unet, width, height)
    wf["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet or a.unet}}
    return wf


WORKFLOWS = {"pack": pack_workflow, "official": official_workflow, "gguf": gguf_workflow}


# --session: the images of an evening, in order (a new prompt each): LoRAs on, off, switched, stacked
# and at another strength, a second size, the stock-nodes workflow, a second checkpoint and back.
# loras: [(index into --loras, strength)]; unet 2: --unet2
SESSION = [dict(label=label, loras=loras, wide=wide, stock=stock, unet=unet)
           for label, loras, wide, stock, unet in [
               ("first image", [], False, False, 1), ("warm", [], False, False, 1), ("warm", [], False, False, 1),
               ("first with LoRA A", [(0, 1.0)], False, False, 1), ("LoRA A", [(0, 1.0)], False, False, 1),
               ("LoRA A at 0.5", [(0, 0.5)], False, False, 1), ("switch to LoRA B", [(1, 1.0)], False, False, 1),
               ("LoRA B", [(1, 1.0)], False, False, 1), ("A and B stacked", [(0, 0.5), (1, 0.5)], False, False, 1),
               ("no LoRA again", [], False, False, 1), ("other size", [], True, False, 1),
               ("other size", [], True, False, 1), ("other size, LoRA A", [(0, 1.0)], True, False, 1),
               ("stock nodes", [], False, True, 1), ("stock nodes, LoRA A", [(0, 1.0)], False, True, 1),
               ("second checkpoint", [], False, False, 2), ("second checkpoint", [], False, False, 2),
               ("second checkpoint, LoRA A", [(0, 1.0)], False, False, 2), ("first checkpoint again", [], False, False, 1),
               ("LoRA B", [(1, 1.0)], False, False, 1), ("no LoRA", [], False, False, 1), ("no LoRA", [], False, False, 1)]]


def with_loras(wf, loras, names):
    """Stock LoraLoaderModelOnly nodes, one per LoRA, between the model loader and what it fed."""
    loader = next(k for k, n in wf.items() if n["class_type"] in ("ZImageModelLoader", "UNETLoader"))
    users = [(n, name) for n in wf.values() for name, v in n["inputs"].items() if v == [loader, 0]]
    model = [loader, 0]
    for j, (index, strength) in enumerate(loras):
        node = f"lora{j}"
        wf[node] = {"class_type": "LoraLoaderModelOnly",
                    "inputs": {"model": model, "lora_name": names[index], "strength_model": strength}}
        model = [node, 0]
    for n, name in users:
        n["inputs"][name] = model
    return wf


def stock_nodes(wf):
    """The pack's workflow with stock ModelSamplingAuraFlow, KSampler and VAEDecode after its loader and
    encode (workflows/z_image_turbo_stock_nodes.json)."""
    by = {n["class_type"]: k for k, n in wf.items()}
    sampler = wf.pop(by["ZImageSampler"])["inputs"]
    decode = wf.pop(by["ZImageDecode"])["inputs"]
    wf["msa"] = {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": sampler["model"], "shift": 3.0}}
    wf["zero"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": sampler["positive"]}}
    wf["latent"] = {"class_type": "EmptySD3LatentImage",
                    "inputs": {k: sampler[k] for k in ("width", "height", "batch_size")}}
    wf["ks"] = {"class_type": "KSampler", "inputs": {
        "model": ["msa", 0], "seed": sampler["seed"], "steps": sampler["steps"], "cfg": 1.0,
        "sampler_name": "res_multistep", "scheduler": "simple", "positive": sampler["positive"],
        "negative": ["zero", 0], "latent_image": ["latent", 0], "denoise": 1.0}}
    wf["vd"] = {"class_type": "VAEDecode", "inputs": {"samples": ["ks", 0], "vae": decode["vae"]}}
    wf[by["SaveImage"]]["inputs"]["images"] = ["vd", 0]
    return wf


def session_workflow(a, pipeline, step, prompt):
    """One image of ``SESSION`` for ``pipeline`` (the official template is stock nodes already)."""
    width, height = a.wide if step["wide"] else (a.size, a.size)
    unet = a.unet2 if step["unet"] == 2 else a.unet
    build = pack_workflow if pipeline == "pack" else official_workflow
    wf = build(a, prompt, unet=unet, width=width, height=height)
    if step["stock"] and pipeline == "pack":
        wf = stock_nodes(wf)
    return with_loras(wf, step["loras"], a.loras)

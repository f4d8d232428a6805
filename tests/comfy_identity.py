"""One session of images that must be the same to the bit wherever it runs (issue: the same prompt
and seed give the same image on every card, at every point of a session): four prompts, cfg 2 with
a negative prompt through stock KSampler, a LoRA, a LoRA on the text encoder, batch 2, another
size, and the first prompt again at the end. ``run_session`` posts them to one server and returns
each image's pixel hash; the GPU test runs it on several simulated cards, the CPU test at several
forced splits."""
import hashlib
import io
import os

from comfy_server import TE
from tools import random_weights

from test_comfy_server import clip_lora_workflow, lora_workflow, node_of, pack_workflow, write_text_encoder_lora

PROMPTS = ["A weathered lighthouse on a rocky headland at golden hour, waves breaking in white spray",
           "A red fox curled up asleep in fresh snow under a pine tree, soft morning light",
           "A busy night market in the rain, neon signs reflected in puddles, 35mm photograph",
           "An astronaut tending a small greenhouse on the moon, earth rising behind the dome"]
NEGATIVE = "blurry, low quality, watermark"
LORA = "identity_lora.safetensors"
TE_LORA = "identity_te_lora.safetensors"


def write_lora(path, layers):
    """A rank-16 LoRA on every main layer's attention output, in ComfyUI's layout."""
    random_weights.write_lora(path, layers, matrices=("out",))


def write_loras(base, layers):
    """The session's LoRAs in ``base``'s models/loras: ``LORA`` (``write_lora``) and one on the
    text encoder's first two layers (``TE_LORA``)."""
    models = os.path.join(base, "models")
    write_lora(os.path.join(models, "loras", LORA), layers)
    write_text_encoder_lora(os.path.join(models, "loras", TE_LORA), os.path.join(models, "text_encoders", TE))


def ksampler_workflow(prompt, width, height, steps, loader, prefix):
    """The pack's loader and encode with stock ModelSamplingAuraFlow, KSampler (cfg 2, a negative
    prompt: the cond and uncond batch) and VAEDecode."""
    wf = pack_workflow(prompt, width, height, steps, prefix=prefix, loader=loader)
    load, enc = node_of(wf, "ZImageModelLoader"), node_of(wf, "ZImageTextEncode")
    clip, vae = wf[enc]["inputs"]["clip"], wf[node_of(wf, "ZImageDecode")]["inputs"]["vae"]
    for k in (node_of(wf, "ZImageSampler"), node_of(wf, "ZImageDecode")):
        del wf[k]
    wf.update({
        "101": {"class_type": "ZImageTextEncode", "inputs": {"clip": clip, "text": NEGATIVE}},
        "102": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "103": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": [load, 0], "shift": 3.0}},
        "104": {"class_type": "KSampler", "inputs": {
            "model": ["103", 0], "positive": [enc, 0], "negative": ["101", 0], "latent_image": ["102", 0],
            "seed": 7, "steps": steps, "cfg": 2.0, "sampler_name": "res_multistep", "scheduler": "simple",
            "denoise": 1.0}},
        "105": {"class_type": "VAEDecode", "inputs": {"samples": ["104", 0], "vae": vae}},
    })
    wf[node_of(wf, "SaveImage")]["inputs"]["images"] = ["105", 0]
    return wf


def session(size, wide, steps, loader, tag, prompts=4):
    """[(name, workflow)] in the order a user might make them: ``prompts`` prompts, each prompt's
    variations after it, those with the plain text encoder first (ComfyUI reuses the last prompt's
    conditioning: a CPU's text encode takes seconds), and the first prompt again at the end."""
    kw = dict(steps=steps, loader=loader)
    p0, p1 = PROMPTS[0], PROMPTS[1]
    jobs = [("prompt 0", pack_workflow(p0, size, size, prefix=f"{tag}_p0", **kw)),
            ("LoRA", lora_workflow(LORA, 1.0, prompt=p0, width=size, height=size, prefix=f"{tag}_lora", **kw)),
            (f"{wide[0]}x{wide[1]}", pack_workflow(p0, *wide, prefix=f"{tag}_wide", **kw)),
            ("text encoder LoRA", clip_lora_workflow(TE_LORA, prompt=p0, width=size, height=size,
                                                     prefix=f"{tag}_te_lora", **kw)),
            ("prompt 1", pack_workflow(p1, size, size, prefix=f"{tag}_p1", **kw)),
            ("batch 2", pack_workflow(p1, size, size, prefix=f"{tag}_b2", batch_size=2, **kw)),
            ("cfg 2, negative, KSampler", ksampler_workflow(p1, size, size, steps, loader, f"{tag}_cfg2"))]
    jobs += [(f"prompt {i}", pack_workflow(PROMPTS[i], size, size, prefix=f"{tag}_p{i}", **kw))
             for i in range(2, prompts)]
    return jobs + [("prompt 0 again", pack_workflow(p0, size, size, prefix=f"{tag}_p0_again", **kw))]


def pixels(client, entry, node):
    """SHA-256 of each saved image's pixels."""
    from PIL import Image
    out = []
    for ref in client.image_refs(entry, node):
        img = Image.open(io.BytesIO(client.image_bytes(ref)))
        out.append(hashlib.sha256(img.convert("RGB").tobytes()).hexdigest()[:16])
    return tuple(out)


def run_session(client, jobs, timeout=900):
    """{name: pixel hashes} for ``jobs`` on one server; asserts that the repeat really sampled again."""
    return {name: pixels(client, sampled_again(client, wf, timeout, name), node_of(wf, "SaveImage"))
            for name, wf in jobs}


def sampled_again(client, wf, timeout=900, name="the image"):
    """``wf``'s history entry, asserting that its sampler ran (its result not ComfyUI's cached one)."""
    entry = client.run(wf, timeout)
    cached = dict(entry["status"].get("messages", [])).get("execution_cached", {}).get("nodes", [])
    sampler = next(k for k, n in wf.items() if n["class_type"] in ("ZImageSampler", "KSampler"))
    assert sampler not in cached, f"{name}: the sampler's result came from ComfyUI's cache"
    return entry


def differences(by_run: dict) -> list:
    """The jobs whose images differ between runs (``{run: {job: hashes}}``), and the repeat that
    differs from the first image of its prompt."""
    runs = list(by_run)
    bad = [job for job in by_run[runs[0]] if len({by_run[r][job] for r in runs}) > 1]
    bad += [f"prompt 0 again ({r})" for r in runs if by_run[r]["prompt 0 again"] != by_run[r]["prompt 0"]]
    return bad


def table(by_run: dict) -> str:
    runs = list(by_run)
    lines = [f"{'':28}" + "".join(f"{r:>20}" for r in runs)]
    for job in by_run[runs[0]]:
        lines.append(f"{job:28}" + "".join(f"{','.join(h[:8] for h in by_run[r][job]):>20}" for r in runs))
    return "\n".join(lines)

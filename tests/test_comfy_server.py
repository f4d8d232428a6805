"""End to end through a real ComfyUI server (see comfy_server.py): the official Z-Image template
with stock nodes, this pack's nodes, its example workflows, interrupt, errors, and parity.

Needs COMFYUI_PATH (skips otherwise). Random small weights: the images show nothing, but every
path (loaders, text encoder, sampler, VAE, saving) runs for real.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import TE, UNET, VAE

pytestmark = needs_comfyui

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = os.path.join(ROOT, "workflows")
API_WORKFLOW = os.path.join(WORKFLOWS, "api", "z_image_turbo.json")
UI_WORKFLOWS = ("z_image_turbo", "z_image_turbo_stock_nodes")
PACK_NODES = ("ZImageModelLoader", "ZImageTextEncode", "ZImageSampler", "ZImageDecode")
FRONTEND_ONLY = ("Note", "MarkdownNote")  # nodes the frontend draws; the server does not know them
# Largest pixel difference (0-255) allowed between the pack's workflow and the official template.
PARITY_MAX_DIFF = 0

PROMPT = "a lighthouse on a rocky coast at dusk, warm light, film grain"
SIZE = 128
STEPS = 2


def official_template(prompt=PROMPT, width=SIZE, height=SIZE, steps=STEPS, seed=42, prefix="official",
                      batch_size=1, unet=UNET):
    """The official Z-Image-Turbo template (ComfyUI's image_z_image_turbo), API format."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": TE, "type": "lumina2", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["2", 0]}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}},
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": width, "height": height,
                                                              "batch_size": batch_size}},
        "7": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 3.0}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": ["7", 0], "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0],
            "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
            "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    }


def pack_workflow(prompt=PROMPT, width=SIZE, height=SIZE, steps=STEPS, seed=42, prefix="pack", unet=None,
                  batch_size=1, loader=None):
    """workflows/api/z_image_turbo.json with the test's prompt, size, steps, seed and file prefix
    (and ``loader``: inputs of the model loader)."""
    with open(API_WORKFLOW) as f:
        wf = json.load(f)
    by_type = {n["class_type"]: n["inputs"] for n in wf.values()}
    by_type["ZImageTextEncode"]["text"] = prompt
    by_type["ZImageSampler"].update(width=width, height=height, steps=steps, seed=seed, batch_size=batch_size)
    by_type["SaveImage"]["filename_prefix"] = prefix
    if unet:
        by_type["ZImageModelLoader"]["unet_name"] = unet
    by_type["ZImageModelLoader"].update(loader or {})
    return wf


def lora_workflow(lora, strength=1.0, **kw):
    """The pack's workflow with a stock LoraLoaderModelOnly between its loader and its sampler."""
    wf = pack_workflow(**kw)
    loader = node_of(wf, "ZImageModelLoader")
    wf["100"] = {"class_type": "LoraLoaderModelOnly",
                 "inputs": {"model": [loader, 0], "lora_name": lora, "strength_model": strength}}
    wf[node_of(wf, "ZImageSampler")]["inputs"]["model"] = ["100", 0]
    return wf


def node_of(wf, class_type):
    return next(k for k, n in wf.items() if n["class_type"] == class_type)


def image_stats(img):
    import numpy as np

    a = np.asarray(img.convert("RGB"), dtype=np.float32)
    return a, f"{img.size[0]}x{img.size[1]} min {a.min():.0f} max {a.max():.0f} mean {a.mean():.1f} std {a.std():.2f}"


def messages(entry):
    return {event: data for event, data in entry["status"].get("messages", [])}


def failing_run(server, prompt, timeout=600):
    """Post a prompt that must fail in a node: its execution_error data. The error is one message,
    not a traceback, and the server lives on."""
    pid, _ = server.post(prompt)
    entry = server.wait(pid, timeout)
    assert entry["status"]["status_str"] == "error", entry["status"]
    err = messages(entry).get("execution_error")
    assert err is not None, entry["status"]
    assert "Traceback" not in err["exception_message"], err["exception_message"]
    assert server.proc.poll() is None, server.log_tail()
    return err


@pytest.fixture(scope="session")
def object_info(comfy_server):
    return comfy_server.get("/object_info")


@pytest.fixture(scope="session")
def official_run(comfy_server):
    """The official template at 128x128, 2 steps: (history entry, PIL image, seconds)."""
    t0 = time.monotonic()
    entry = comfy_server.run(official_template())
    return entry, comfy_server.image(entry, "10"), time.monotonic() - t0


@pytest.fixture(scope="session")
def pack_run(comfy_server):
    """workflows/api/z_image_turbo.json at 128x128, 2 steps: (history entry, PIL image, seconds)."""
    wf = pack_workflow()
    t0 = time.monotonic()
    entry = comfy_server.run(wf)
    return entry, comfy_server.image(entry, node_of(wf, "SaveImage")), time.monotonic() - t0


# -- stock nodes only ----------------------------------------------------------------------------

def test_official_template(official_run):
    entry, img, dt = official_run
    _, stats = image_stats(img)
    print(f"\nComfyUI {comfyui_version()}: official template {SIZE}x{SIZE}, {STEPS} steps: {dt:.1f} s; {stats}")
    assert img.size == (SIZE, SIZE)
    assert entry["status"]["completed"]


# -- the pack's nodes ------------------------------------------------------------------------------

def widget_inputs(info):
    """[(name, has control_after_generate)] for the widget inputs of a node, in the frontend's order."""
    out = []
    for section in ("required", "optional"):
        specs = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(specs)):
            spec = specs[name]
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if opts.get("forceInput"):
                continue
            if isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"):
                out.append((name, kind == "INT" and bool(opts.get("control_after_generate"))))
    return out


def input_type(info, name):
    for section in ("required", "optional"):
        spec = info["input"].get(section, {}).get(name)
        if spec is not None:
            return "COMBO" if isinstance(spec[0], list) else spec[0]
    return None


def ui_to_api(wf, object_info):
    """A UI-format (LiteGraph) workflow as API format, checking it on the way: node types known,
    widgets_values matching each node's widget inputs, links consistent on both ends and typed as
    the node definitions say."""
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = {l[0]: l for l in wf["links"]}
    assert len(links) == len(wf["links"]), "duplicate link ids"
    assert wf.get("version") == 0.4 and wf["last_node_id"] >= max(nodes) and wf["last_link_id"] >= max(links)
    for lid, (_, src, src_slot, dst, dst_slot, ltype) in links.items():
        assert lid in nodes[src]["outputs"][src_slot]["links"], f"link {lid} missing at node {src}"
        assert nodes[dst]["inputs"][dst_slot]["link"] == lid, f"link {lid} missing at node {dst}"
        assert nodes[src]["outputs"][src_slot]["type"] == ltype == nodes[dst]["inputs"][dst_slot]["type"]
        assert object_info[nodes[src]["type"]]["output"][src_slot] == ltype
    api = {}
    for n in wf["nodes"]:
        if n["type"] in FRONTEND_ONLY:
            continue
        assert n["type"] in object_info, f"node type {n['type']} unknown to the server"
        info = object_info[n["type"]]
        widgets, values = widget_inputs(info), list(n.get("widgets_values", []))
        expected = len(widgets) + sum(c for _, c in widgets)
        assert len(values) == expected, (f"{n['type']} (node {n['id']}): {len(values)} widgets_values, "
                                         f"expected {expected} for {widgets}")
        inputs = {}
        for name, control in widgets:
            inputs[name] = values.pop(0)
            if control:
                assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
        for i, inp in enumerate(n.get("inputs", [])):
            assert input_type(info, inp["name"]) in (inp["type"], "COMBO" if "widget" in inp else None), inp
            if inp.get("link") is not None:
                _, src, slot, _, dst_slot, _ = links[inp["link"]]
                assert dst_slot == i
                inputs[inp["name"]] = [str(src), slot]
        for slot, o in enumerate(n.get("outputs", [])):
            assert info["output"][slot] == o["type"], (n["type"], o)
        api[str(n["id"])] = {"class_type": n["type"], "inputs": inputs}
    return api


def load_ui(name):
    with open(os.path.join(WORKFLOWS, name + ".json")) as f:
        return json.load(f)


def test_object_info_lists_pack_nodes(object_info):
    for name in PACK_NODES:
        assert name in object_info, f"{name} not registered (see the server log for an import error)"
        assert object_info[name]["category"].startswith("Z-Image"), object_info[name]["category"]
    loader = object_info["ZImageModelLoader"]["input"]["required"]
    assert set(loader) >= {"unet_name", "weight_dtype", "vram", "resident_layers", "leave_free_gb"}
    assert UNET in loader["unet_name"][0] or UNET in loader["unet_name"][1].get("options", [])
    sampler = object_info["ZImageSampler"]["input"]
    assert set(sampler["required"]) >= {"model", "positive", "width", "height", "batch_size", "seed", "steps",
                                        "cfg", "shift", "sampler_name", "scheduler"}
    assert "negative" in sampler.get("optional", {})
    assert object_info["ZImageSampler"]["output"] == ["LATENT"]
    assert object_info["ZImageTextEncode"]["output"] == ["CONDITIONING"]
    assert object_info["ZImageDecode"]["output"] == ["IMAGE"]
    assert object_info["ZImageModelLoader"]["output"] == ["MODEL"]


def test_workflow_templates_lists_examples(comfy_server):
    from comfy_server import PACK

    listed = comfy_server.get("/workflow_templates")
    assert sorted(listed.get(PACK, [])) == sorted(UI_WORKFLOWS), listed.get(PACK)
    for name in UI_WORKFLOWS:  # served to the frontend's template browser
        served = comfy_server.get(f"/api/workflow_templates/{PACK}/{name}.json")
        served = json.loads(served) if isinstance(served, bytes) else served
        assert served == load_ui(name)


def test_ui_workflows_are_valid(object_info):
    api = {}
    for name in UI_WORKFLOWS:
        api[name] = ui_to_api(load_ui(name), object_info)
    # the main UI workflow and its API twin are the same graph with the same values
    with open(API_WORKFLOW) as f:
        twin = json.load(f)
    strip = lambda wf: {k: {"class_type": n["class_type"], "inputs": n["inputs"]} for k, n in wf.items()}
    assert strip(twin) == api["z_image_turbo"]
    # every API input is a known input of its node
    for n in twin.values():
        info = object_info[n["class_type"]]["input"]
        known = set(info.get("required", {})) | set(info.get("optional", {}))
        assert set(n["inputs"]) <= known, (n["class_type"], set(n["inputs"]) - known)


def test_api_workflow(pack_run):
    entry, img, dt = pack_run
    _, stats = image_stats(img)
    print(f"\nComfyUI {comfyui_version()}: pack API workflow {SIZE}x{SIZE}, {STEPS} steps: {dt:.1f} s; {stats}")
    assert img.size == (SIZE, SIZE)


def test_api_workflow_other_size(comfy_server):
    """Width and height reach the image (non-square, batch of 2)."""
    wf = pack_workflow(width=160, height=96, seed=3, batch_size=2, prefix="pack_size")
    entry = comfy_server.run(wf)
    refs = comfy_server.image_refs(entry, node_of(wf, "SaveImage"))
    assert len(refs) == 2
    for i in range(2):
        assert comfy_server.image(entry, node_of(wf, "SaveImage"), i).size == (160, 96)
    # the one-line status names the split for the image being made
    status = [line for line in comfy_server.log_text().splitlines()
              if "layers on the GPU" in line or "Z-Image: on the CPU" in line]
    assert status and "(160x96, batch 2)" in status[-1], status[-3:]


def test_parity_with_official_template(official_run, pack_run):
    import numpy as np

    a, sa = image_stats(official_run[1])
    b, sb = image_stats(pack_run[1])
    diff = int(np.abs(a - b).max())
    print(f"\nComfyUI {comfyui_version()}: PARITY largest pixel difference pack vs official template: {diff} "
          f"(mean {np.abs(a - b).mean():.3f}); official {sa}; pack {sb}")
    assert a.std() > 1.0, "the reference image is flat: the test would prove nothing"
    assert diff <= PARITY_MAX_DIFF


def test_parity_is_sensitive(comfy_server, pack_run):
    """The transformer's output shapes the image (random weights could leave the noise as it is):
    another shift, same seed and prompt, gives a clearly different image."""
    import numpy as np

    wf = pack_workflow(prefix="pack_shift")
    wf[node_of(wf, "ZImageSampler")]["inputs"]["shift"] = 1.0
    entry = comfy_server.run(wf)
    a, _ = image_stats(comfy_server.image(entry, node_of(wf, "SaveImage")))
    b, _ = image_stats(pack_run[1])
    print(f"\nComfyUI {comfyui_version()}: shift 1 vs 3, same seed: largest pixel difference "
          f"{int(np.abs(a - b).max())}, mean {np.abs(a - b).mean():.2f}")
    assert np.abs(a - b).mean() > 2.0


def test_stock_nodes_workflow(comfy_server, object_info, pack_run):
    """workflows/z_image_turbo_stock_nodes.json: the pack's loader feeding ModelSamplingAuraFlow, KSampler,
    VAEDecode and SaveImage, with CLIPTextEncode."""
    import numpy as np

    wf = ui_to_api(load_ui("z_image_turbo_stock_nodes"), object_info)
    by_type = {n["class_type"]: n["inputs"] for n in wf.values()}
    by_type["EmptySD3LatentImage"].update(width=SIZE, height=SIZE)
    by_type["KSampler"].update(steps=STEPS, seed=42)
    by_type["CLIPTextEncode"]["text"] = PROMPT
    by_type["SaveImage"]["filename_prefix"] = "pack_stock"
    assert by_type["ModelSamplingAuraFlow"]["model"][0] == node_of(wf, "ZImageModelLoader")
    t0 = time.monotonic()
    entry = comfy_server.run(wf)
    img = comfy_server.image(entry, node_of(wf, "SaveImage"))
    a, stats = image_stats(img)
    b, _ = image_stats(pack_run[1])
    diff = int(np.abs(a - b).max())
    print(f"\nComfyUI {comfyui_version()}: pack loader + stock KSampler/VAEDecode: {time.monotonic() - t0:.1f} s; "
          f"{stats}; largest pixel difference to the pack's own nodes: {diff}")
    assert img.size == (SIZE, SIZE)
    assert diff <= PARITY_MAX_DIFF


def write_text_encoder_lora(path, te_file, rank=4):
    """A LoRA for the text encoder alone (ComfyUI's generic ``text_encoders.`` keys) on its first two
    layers' attention and MLP, as a trainer of Qwen3-4B LoRAs writes them."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    out = {}
    with safe_open(te_file, "pt") as f:
        for key in f.keys():
            if key.startswith(("model.layers.0.", "model.layers.1.")) and key.endswith(("q_proj.weight", "down_proj.weight")):
                rows, cols = f.get_slice(key).get_shape()
                name = f"text_encoders.qwen3_4b.transformer.{key[:-len('.weight')]}"
                out[f"{name}.lora_up.weight"] = (torch.randn(rows, rank, generator=g) * 0.05).to(torch.bfloat16)
                out[f"{name}.lora_down.weight"] = (torch.randn(rank, cols, generator=g) * 0.05).to(torch.bfloat16)
                out[f"{name}.alpha"] = torch.tensor(float(rank))
    assert len(out) == 12, sorted(out)
    save_file(out, path)


def clip_lora_workflow(lora, encode="ZImageTextEncode", strength_clip=0.8, prompt=PROMPT, **kw):
    """The pack's workflow with a stock LoraLoader on its loader's MODEL and the CLIP, the prompt
    encoded by ``encode`` (the pack's node, or ComfyUI's CLIPTextEncode) from the LoRA'd CLIP."""
    wf = pack_workflow(prompt=prompt, **kw)
    loader, enc = node_of(wf, "ZImageModelLoader"), node_of(wf, "ZImageTextEncode")
    wf["100"] = {"class_type": "LoraLoader", "inputs": {
        "model": [loader, 0], "clip": wf[enc]["inputs"]["clip"], "lora_name": lora,
        "strength_model": 1.0, "strength_clip": strength_clip}}
    wf[node_of(wf, "ZImageSampler")]["inputs"]["model"] = ["100", 0]
    wf[enc] = {"class_type": encode, "inputs": {"clip": ["100", 1], "text": prompt}}
    return wf


def test_a_lora_on_the_text_encoder(comfy_server, comfy_base_dir, pack_run):
    """Stock LoraLoader on the pack's loader and the CLIP: the pack's encode streams the text
    encoder's layers with the LoRA applied as they arrive, and gives ComfyUI's own encode of the
    LoRA'd CLIP (CLIPTextEncode) to the pixel; the LoRA changes the image."""
    import numpy as np

    models = os.path.join(comfy_base_dir, "models")
    write_text_encoder_lora(os.path.join(models, "loras", "te_lora.safetensors"),
                            os.path.join(models, "text_encoders", TE))
    images = {}
    for encode in ("ZImageTextEncode", "CLIPTextEncode"):
        wf = clip_lora_workflow("te_lora.safetensors", encode, prefix=f"te_lora_{encode}")
        images[encode], _ = image_stats(comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")))
    plain, _ = image_stats(pack_run[1])
    log = comfy_server.log_text()
    assert "Z-Image: 4 weights of the text encoder patched" in log, comfy_server.log_tail()
    assert "changes none of this model's weights" in log  # the LoRA has no keys for the transformer
    assert int(np.abs(images["ZImageTextEncode"] - images["CLIPTextEncode"]).max()) == 0
    assert np.abs(images["ZImageTextEncode"] - plain).mean() > 0.5, "the text encoder's LoRA changed nothing"


def test_run_script(comfy_server, tmp_path, pack_run):
    out = tmp_path / "images"
    r = subprocess.run([sys.executable, os.path.join(WORKFLOWS, "api", "run.py"), "--server", comfy_server.url,
                        "--out", str(out), "--prompt", "a small red boat", "--seed", "7", "--width", "112",
                        "--height", "80", "--steps", "1", "--timeout", "600"],
                       capture_output=True, text=True, timeout=660)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n--- server log ---\n{comfy_server.log_tail()}"
    files = sorted(out.iterdir())
    assert len(files) == 1 and files[0].suffix == ".png", (files, r.stdout)
    from PIL import Image

    with Image.open(files[0]) as img:
        assert img.size == (112, 80)


def test_interrupt(comfy_server, pack_run):
    """POST /interrupt while the sampler runs stops the prompt; the next prompt still works."""
    steps = 37  # a count no other test uses: its progress bar in the log says the sampler is running
    wf = pack_workflow(width=256, height=256, steps=steps, seed=11, prefix="interrupted")
    log_start = len(comfy_server.log_text())
    pid, _ = comfy_server.post(wf)
    end = time.monotonic() + 300
    while f"1/{steps} [" not in comfy_server.log_text()[log_start:]:  # one sampling step done
        assert time.monotonic() < end, f"the sampler never started:\n{comfy_server.log_tail()}"
        assert not comfy_server.history(pid), f"finished before the interrupt: {comfy_server.history(pid)}"
        time.sleep(0.2)
    t0 = time.monotonic()
    comfy_server.interrupt()
    entry = comfy_server.wait(pid, 300)
    stop = time.monotonic() - t0
    status = entry["status"]
    print(f"\nComfyUI {comfyui_version()}: interrupted after {stop:.1f} s; {[m[0] for m in status['messages']]}")
    assert status["status_str"] == "error" and not status["completed"], status
    msgs = messages(entry)
    assert "execution_interrupted" in msgs, status
    assert "execution_error" not in msgs, msgs.get("execution_error")
    assert msgs["execution_interrupted"]["node_type"] == "ZImageSampler", msgs["execution_interrupted"]
    assert not entry.get("outputs"), entry.get("outputs")
    # the server still works, and the model survived the interrupt
    entry = comfy_server.run(pack_workflow(seed=12, prefix="after_interrupt"))
    assert comfy_server.image(entry, node_of(pack_workflow(), "SaveImage")).size == (SIZE, SIZE)


def write_truncated(src, dst, keep=1 << 20):
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(keep))


@pytest.mark.parametrize("kind", ["truncated", "text"])
def test_broken_model_file(comfy_server, comfy_base_dir, kind):
    name = "broken.safetensors" if kind == "truncated" else "broken_text.safetensors"
    folder = os.path.join(comfy_base_dir, "models", "diffusion_models")
    path = os.path.join(folder, name)
    if kind == "truncated":
        write_truncated(os.path.join(folder, UNET), path)
    else:
        with open(path, "w") as f:
            f.write("this is not a model, it is a note somebody saved with the wrong name\n")
    wf = pack_workflow(unet=name, prefix="broken")
    pid, _ = comfy_server.post(wf)
    entry = comfy_server.wait(pid, 300)
    status = entry["status"]
    assert status["status_str"] == "error", status
    err = messages(entry).get("execution_error")
    assert err is not None, status
    msg = err["exception_message"]
    print(f"\nComfyUI {comfyui_version()}: {kind} model file -> {err['node_type']}: {err['exception_type']}: {msg}")
    assert err["node_type"] == "ZImageModelLoader"
    assert err["exception_type"] == "zimage.CheckpointError", err["exception_type"]  # not the pack's folder path
    assert name in msg, msg
    lower = msg.lower()
    assert any(w in lower for w in ("truncated", "not a safetensors", "not a .safetensors")), msg
    assert any(w in lower for w in ("download", "copy", "use a", "pick", "replace")), f"no fix suggested: {msg}"
    assert "Traceback" not in msg


def test_the_loader_runs_first_so_the_checkpoint_is_read_while_the_prompt_is_encoded(comfy_server):
    """ComfyUI runs a ready async node before the others: the pack's loader, whose load starts
    reading the checkpoint's layers (``read_ahead``), runs at the prompt's start, before the text
    encoder is loaded and the prompt encoded."""
    start = len(comfy_server.log_text())
    wf = pack_workflow(prompt="the loader first, then this prompt", prefix="loader_first",
                       loader={"vram": "leave_free_gb", "leave_free_gb": 0.5})  # a load of its own
    assert comfy_server.run(wf)["status"]["completed"]
    log = comfy_server.log_text()[start:]
    loading, encoding = log.find("Z-Image: loading the transformer"), log.find("Z-Image: encoding the prompt")
    assert 0 <= loading < encoding, log[-3000:]


def test_switching_checkpoints_leaves_one_models_memory(comfy_server, comfy_base_dir):
    """bf16 with a LoRA, fp8, and bf16 with the LoRA again in one server, their layers streamed: the
    bf16 model's memory is gone before the fp8 one plans (where ComfyUI keeps the model cached the
    pack lets it go; where ComfyUI drops it, it goes at once: its patch set holds it by a weak
    reference, no cycle waits for Python's collection), and back on the bf16 file its LoRA image is
    the first one's to the bit."""
    import torch

    from comfy_identity import write_lora
    from comfy_server import model_file, transformer_weights
    from tools.fp8_weights import write_layers

    streamed = {"vram": "max_resident_layers", "resident_layers": 2}
    lora = os.path.join(comfy_base_dir, "models", "loras", "switch_lora.safetensors")
    write_lora(lora, layers=1)
    image = lambda wf: comfy_server.image(comfy_server.run(wf), node_of(wf, "SaveImage")).tobytes()  # noqa: E731
    as_fp8 = lambda out: write_layers(transformer_weights(), out, lambda k, v: {k: v.to(torch.float8_e4m3fn)})  # noqa: E731
    try:
        with model_file(comfy_server, comfy_base_dir, "z_image_turbo_switch_fp8.safetensors", as_fp8) as fp8:
            first = image(lora_workflow("switch_lora.safetensors", 4.0, prefix="switch_bf16", loader=streamed))
            start = len(comfy_server.log_text())
            image(pack_workflow(unet=fp8, prefix="switch_fp8", loader=streamed))
            log = comfy_server.log_text()[start:]
            # the bf16 model's memory went before the fp8 one planned its first image
            assert "Z-Image: released" in log[:log.index("Z-Image: on the CPU")], log[-3000:]
            again = image(lora_workflow("switch_lora.safetensors", 4.0, prefix="switch_bf16_again", loader=streamed))
            assert again == first
    finally:
        os.remove(lora)


def test_free_releases_host_memory(comfy_server):
    """'Unload models' + 'Free model and node cache' drops the MODEL: its pinned host memory goes
    (the log says so), and the next prompt loads it again. Runs last: it empties the caches."""
    released = lambda: comfy_server.log_text().count("Z-Image: released")  # noqa: E731
    comfy_server.run(pack_workflow(prefix="before_free"))  # a MODEL in the cache, whatever ran before
    before = released()
    status, raw, _ = comfy_server.request("POST", "/free", {"unload_models": True, "free_memory": True})
    assert status == 200, raw[:300]
    deadline = time.monotonic() + 90  # ComfyUI frees between prompts and collects garbage within ~10 s
    while released() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert released() > before, comfy_server.log_tail()
    entry = comfy_server.run(pack_workflow(prefix="after_free"))
    assert entry["status"]["completed"]


def test_the_model_survives_prompts_and_the_budget_keeps_comfyuis_headroom(comfy_server):
    """A new prompt text: the MODEL stays cached (the transformer is not loaded again; twenty new
    prompts in a row on a GPU: docs/benchmarks.md) and, where ComfyUI has a RAM-pressure cache
    (v0.28), the pack's host budget keeps the headroom the server was started with."""
    from comfy_server import CACHE_RAM_HEADROOM, has_cache_ram
    loads = lambda: comfy_server.log_text().count("Z-Image: loading the transformer")  # noqa: E731
    comfy_server.run(pack_workflow(prefix="survive"))  # the tests' prompt: often encoded already
    before = loads()
    entry = comfy_server.run(pack_workflow(prompt="a second prompt, new words", prefix="survive"))
    assert entry["status"]["completed"]
    assert loads() == before, comfy_server.log_tail()
    said = [line for line in comfy_server.log_text().splitlines() if "Z-Image: host RAM:" in line]
    assert said, comfy_server.log_tail()
    if has_cache_ram():
        assert f"ComfyUI keeps {CACHE_RAM_HEADROOM:.1f} GiB of it free" in said[-1], said[-1]


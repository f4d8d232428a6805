"""Side by side in ComfyUI: the pack's workflow and the official Z-Image template, whole images.

    python -m zimage_core.comfy_bench --comfy $COMFYUI_PATH --weights DIR [--cards 11.5,7.5,5.5]
                                      [--dynamic on,off] [--size 1024] [--steps 8]

DIR holds z_image_turbo_bf16.safetensors, qwen_3_4b.safetensors and ae.safetensors. Each card
size and Dynamic VRAM setting runs in its own process (ComfyUI keeps global state), in which a
second process holds all GPU memory but the card's. Per process: the pack's nodes make two
images with different prompts (the second is the "warm image, new prompt"), a stock VAEDecode
decodes a pack latent once, then the official template (UNETLoader, CLIPLoader, VAELoader,
CLIPTextEncode, KSampler, VAEDecode) makes the same two images. Seconds per phase, the split,
how much of the text encoder was on the GPU, tiled fallbacks, and the largest pixel difference
between the two pipelines are reported.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

# the first image loads; the others are warm images, each with a new prompt (reported as a median)
PROMPTS = ["a lighthouse on a cliff at dawn, oil painting", "a red fox in fresh snow, photograph",
           "a glass teapot on a wooden table, morning light", "a city street at night in the rain, neon signs"]
PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _comfy_init(comfy_path, dynamic, cpu):
    """What ComfyUI's main.py does before nodes can run in-process."""
    sys.path.insert(0, comfy_path)
    with open(os.path.join(comfy_path, "comfy", "cli_args.py")) as f:
        has_dynamic = "--disable-dynamic-vram" in f.read()  # v0.20 and later
    sys.argv = [sys.argv[0]] + (["--disable-dynamic-vram"] if has_dynamic and not dynamic else []) + (
        ["--cpu"] if cpu else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    from comfy.cli_args import args
    try:  # v0.20: Dynamic VRAM needs comfy-aimdo set up before torch initialises CUDA
        from comfy.cli_args import enables_dynamic_vram
        import comfy_aimdo.control
        if enables_dynamic_vram():
            comfy_aimdo.control.init()
    except ImportError:
        enables_dynamic_vram = None
    import comfy.model_management as mm
    import comfy.model_patcher
    if enables_dynamic_vram is not None and (args.enable_dynamic_vram or (
            enables_dynamic_vram() and mm.is_nvidia() and not mm.is_wsl())):
        import comfy.memory_management
        if comfy_aimdo.control.init_device(mm.get_torch_device().index):
            comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
            comfy.memory_management.aimdo_enabled = True
    return getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher).__name__


def _write_lora(folder, rank):
    """A random ComfyUI-layout LoRA on the five matrices of every main layer of the file."""
    import torch
    from safetensors.torch import save_file
    from .checkpoint import Checkpoint
    ck = Checkpoint(os.path.join(folder, "z_image_turbo_bf16.safetensors"))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k in ck.keys():
        if k.startswith("layers.") and k.endswith(("qkv.weight", "out.weight", "w1.weight", "w2.weight", "w3.weight")):
            out_dim, in_dim = ck.tensor(k).shape
            name = "lora_unet_" + k[:-len(".weight")].replace(".", "_")
            sd[name + ".lora_up.weight"] = (torch.randn(out_dim, rank, generator=g) * 0.01).to(torch.bfloat16)
            sd[name + ".lora_down.weight"] = (torch.randn(rank, in_dim, generator=g) * 0.01).to(torch.bfloat16)
            sd[name + ".alpha"] = torch.tensor(float(rank))
    ck.close()
    name = f"zimage_bench_lora_r{rank}.safetensors"
    save_file(sd, os.path.join(folder, name))
    return name


def _breakdown(pack, model, clip, vae, a, timed):
    """One more pack image with a new prompt, its sampling timed on the GPU's own clock (events on
    the compute stream, no synchronisation, so the overlap is what it is in the measured images):
    the model manager loading the transformer, the sampler's setup before the first step, each
    step, the gaps between steps, and the copy stream's busy time."""
    import torch
    import comfy.model_management as mm
    cuda = torch.cuda.is_available() and not a.cpu

    def mark():
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def span(x, y):
        return x.elapsed_time(y) / 1e3 if cuda else y - x

    t = model.zimage
    cond, te = timed(lambda: pack.ZImageTextEncode.execute(clip, "a bowl of ramen, studio light").result[0])
    shape = (1, 16, a.size // 8, a.size // 8)
    _, load = timed(lambda: mm.load_models_gpu([model], memory_required=model.model.memory_required(shape)))
    # where the card's memory went once the transformer is loaded (GiB): what its plan saw as free,
    # its own buffers, everything torch holds in this process, and what the device has left
    memory = dict(plan_free=t.plan.free_bytes / 2**30, transformer=t.device_bytes() / 2**30,
                  allocated=torch.cuda.memory_allocated() / 2**30 if cuda else 0,
                  reserved=torch.cuda.memory_reserved() / 2**30 if cuda else 0,
                  device_free=torch.cuda.mem_get_info()[0] / 2**30 if cuda else 0)
    pre, post = [], []
    hooks = [t.register_forward_pre_hook(lambda *_: pre.append(mark())),
             t.register_forward_hook(lambda *_: post.append(mark()))]
    t.streamer.profile, t.streamer.copy_events = True, []
    try:
        start = mark()
        lat, ts = timed(lambda: pack.ZImageSampler.execute(model, cond, a.size, a.size, 1, 42, a.steps, 1.0, 3.0,
                                                           "res_multistep", "simple").result[0])
        end = mark()
    finally:
        for h in hooks:
            h.remove()
        t.streamer.profile = False
    if cuda:
        torch.cuda.synchronize()
    copies = [span(x, y) for x, y in t.streamer.copy_events] if cuda else []
    _, td = timed(lambda: pack.ZImageDecode.execute(vae, lat).result[0])
    return dict(encode=te, load=load, sample=ts, setup=span(start, pre[0]), steps=[span(x, y) for x, y in zip(pre, post)],
                gaps=[span(x, y) for x, y in zip(post, pre[1:])], tail=span(post[-1], end), uploads=len(copies),
                copy_busy=sum(copies), decode=td, memory=memory)


def _decode_alone(vae, lat, tiled, timed):
    """A stock VAEDecode with nothing else loaded, then ComfyUI's decoder called directly in the
    room ComfyUI asks for, with its real peak: whether a tiled fallback is ComfyUI's own."""
    import torch
    import comfy.model_management as mm
    import nodes
    mm.unload_all_models()
    mm.soft_empty_cache()
    before = len(tiled)
    _, s = timed(lambda: nodes.VAEDecode().decode(vae, lat)[0])
    out = dict(s=s, tiled=len(tiled) > before)
    x = lat["samples"]
    dev = mm.get_torch_device()
    mm.load_models_gpu([vae.patcher], memory_required=vae.memory_used_decode(x.shape, vae.vae_dtype))
    out["free_gib"] = mm.get_free_memory(dev) / 2**30
    out["asked_gib"] = vae.memory_used_decode(x.shape, vae.vae_dtype) / 2**30
    out["vae_dtype"] = str(vae.vae_dtype)
    if torch.cuda.is_available() and dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        try:
            with torch.no_grad():
                vae.first_stage_model.decode(x.to(device=vae.device, dtype=vae.vae_dtype))
            out["direct"] = "fits"
        except torch.OutOfMemoryError as e:
            out["direct"] = "out of memory: " + str(e)[:400]
        out["peak_gib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
    return out


def worker(a):
    from .bench import simulated_card
    with simulated_card(a.card):
        patcher_kind = _comfy_init(a.comfy, a.dynamic == "on", a.cpu)
        import torch
        with torch.inference_mode():  # as ComfyUI's executor runs every node
            result = _images(a, patcher_kind)
    print(json.dumps(result))


def _images(a, patcher_kind):
    """Both pipelines' images in ComfyUI's process on the simulated card, and the probes."""
    import torch
    import comfy.model_management as mm
    import folder_paths
    import nodes
    for kind in ("diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(kind, a.weights)
    tiled = []

    class TiledWatch(logging.Handler):
        def emit(self, record):
            if "tiled" in record.getMessage():
                tiled.append(record.getMessage())

    logging.getLogger().addHandler(TiledWatch())
    sys.path.insert(0, os.path.dirname(PACK_DIR))
    import importlib
    pack = importlib.import_module(os.path.basename(PACK_DIR) + ".nodes")

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        r = fn()
        sync()
        return r, time.perf_counter() - t

    clip = nodes.CLIPLoader().load_clip("qwen_3_4b.safetensors", type="lumina2")[0]
    vae = nodes.VAELoader().load_vae("ae.safetensors")[0]
    rows, images = [], {}

    zcomfy = importlib.import_module(os.path.basename(PACK_DIR) + ".zimage_core.comfy")  # the nodes' instance

    def encode(node, pack_node):
        """The encode node's time and where the text encoder ran: streamed (its GiB on the GPU)
        or loaded by ComfyUI (the share of it on the GPU)."""
        cond, t = timed(node)
        te = zcomfy._pinned.get(clip.patcher)
        if pack_node and te is not None and te.loaded_size():
            te_where.append(f"streamed, {te.loaded_size() / 2**30:.2f} GiB on GPU")
        else:
            te_where.append(f"ComfyUI, {clip.patcher.loaded_size() / clip.patcher.model_size():.0%} on GPU")
        return cond, t

    te_where = []

    def row(pipeline, i, te, ts, td, split):
        rows.append(dict(pipeline=pipeline, image=i + 1, encode=te, sample=ts, decode=td, total=te + ts + td,
                         text_encoder=te_where[-1], split=split, tiled=len(tiled)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    model, load_s = timed(lambda: pack.ZImageModelLoader.execute(
        "z_image_turbo_bf16.safetensors", "default", "auto", 30, 0.0).result[0])
    for i, prompt in enumerate(PROMPTS):
        cond, te = encode(lambda: pack.ZImageTextEncode.execute(clip, prompt).result[0], True)
        lat, ts = timed(lambda: pack.ZImageSampler.execute(model, cond, a.size, a.size, 1, 42, a.steps, 1.0, 3.0,
                                                           "res_multistep", "simple").result[0])
        s = model.zimage.streamer
        split = f"{s.n_resident} resident, {len(s.slots)} slots"
        images[("pack", i)], td = timed(lambda: pack.ZImageDecode.execute(vae, lat).result[0])
        row("pack", i, te, ts, td, split)
    breakdown = _breakdown(pack, model, clip, vae, a, timed)
    free_before = mm.get_free_memory(mm.get_torch_device())
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage()[:200])

    watch = Seen(level=logging.DEBUG)
    root = logging.getLogger()
    level = root.level
    root.addHandler(watch)
    root.setLevel(logging.DEBUG)
    try:
        stock, stock_s = timed(lambda: nodes.VAEDecode().decode(vae, lat)[0])
    finally:
        root.removeHandler(watch)
        root.setLevel(level)
    stock_log = [f"free before {free_before / 2**30:.2f} GiB"] + seen
    stock_same = bool(torch.equal(stock, images[("pack", len(PROMPTS) - 1)]))
    pinned = model.zimage.streamer.pinned_layers
    if a.lora_rank:
        # a LoRA on every main layer's five matrices, through the stock loader: the first image
        # computes the patched weights, the others are warm images to hold against no LoRA
        folder_paths.add_model_folder_path("loras", a.weights)
        name = _write_lora(a.weights, a.lora_rank)
        lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
        for i, prompt in enumerate(reversed(PROMPTS)):
            cond, te = encode(lambda: pack.ZImageTextEncode.execute(clip, prompt).result[0], True)
            lat, ts = timed(lambda: pack.ZImageSampler.execute(lora_model, cond, a.size, a.size, 1, 42, a.steps,
                                                               1.0, 3.0, "res_multistep", "simple").result[0])
            _, td = timed(lambda: pack.ZImageDecode.execute(vae, lat).result[0])
            row("pack+lora", i, te, ts, td, "")
        del lora_model
    del model, lat
    mm.unload_all_models()
    mm.soft_empty_cache()

    unet = nodes.UNETLoader().load_unet("z_image_turbo_bf16.safetensors", "default")[0]
    for i, prompt in enumerate(PROMPTS):
        cond, te = encode(lambda: nodes.CLIPTextEncode().encode(clip, prompt)[0], False)
        negative = nodes.ConditioningZeroOut().zero_out(cond)[0]
        latent = {"samples": torch.zeros([1, 16, a.size // 8, a.size // 8], device=mm.intermediate_device())}
        # ZImage samples with shift 3 by default: what ModelSamplingAuraFlow(3) installs
        lat, ts = timed(lambda: nodes.KSampler().sample(unet, 42, a.steps, 1.0, "res_multistep", "simple",
                                                        cond, negative, latent)[0])
        images[("official", i)], td = timed(lambda: nodes.VAEDecode().decode(vae, lat)[0])
        row("official", i, te, ts, td, "")
    diff = [float((images[("pack", i)] - images[("official", i)]).abs().nan_to_num(0).max()) * 255
            for i in range(len(PROMPTS))]
    del unet
    alone = _decode_alone(vae, lat, tiled, timed)
    return dict(card=a.card, dynamic=a.dynamic, patcher=patcher_kind, load_s=load_s, pinned_layers=pinned,
                pack_breakdown=breakdown, stock_vaedecode_s=stock_s, stock_vaedecode_same=stock_same,
                stock_vaedecode_log=stock_log, decode_alone=alone, rows=rows, tiled=tiled, max_pixel_diff=diff)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zimage_core.comfy_bench")
    ap.add_argument("--comfy", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI source tree")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--cards", default="11.5,7.5,5.5", help="GiB left free, comma separated; 0: the whole GPU")
    ap.add_argument("--dynamic", default="on,off")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also make two images with a random LoRA of this rank on every main layer")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per card and setting")
    ap.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (a functional check, no card)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--card", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.comfy:
        sys.exit("give --comfy or set COMFYUI_PATH to a ComfyUI source tree")
    if a.worker:
        a.card = a.card or None
        return worker(a)
    results = []
    for card in a.cards.split(","):
        for dyn in a.dynamic.split(","):
            cmd = [sys.executable, "-m", "zimage_core.comfy_bench", "--worker", "--comfy", a.comfy, "--weights",
                   a.weights, "--card", card, "--dynamic", dyn, "--size", str(a.size), "--steps", str(a.steps),
                   "--lora-rank", str(a.lora_rank)] + (["--cpu"] if a.cpu else [])
            try:
                r = subprocess.run(cmd, cwd=PACK_DIR, capture_output=True, text=True, timeout=a.timeout)
            except subprocess.TimeoutExpired:
                print(f"card {card} GiB, Dynamic VRAM {dyn}: timed out after {a.timeout} s", flush=True)
                continue
            if r.returncode:
                print(f"card {card} GiB, Dynamic VRAM {dyn}: failed\n{r.stderr[-3000:]}", flush=True)
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            results.append(res)
            for w in res["rows"]:
                print(f"{card:>5} GiB  dynamic {dyn:3}  {w['pipeline']:8} image {w['image']}  encode {w['encode']:.2f}  "
                      f"sample {w['sample']:.2f}  decode {w['decode']:.2f}  total {w['total']:.2f}  "
                      f"TE {w['text_encoder']}  tiled so far {w['tiled']}  {w['split']}", flush=True)
            warm = {p: {k: statistics.median(w[k] for w in res["rows"] if w["pipeline"] == p and w["image"] > 1)
                        for k in ("encode", "sample", "decode", "total")} for p in ("pack", "official")}
            print(f"      warm image, median of {len(PROMPTS) - 1}: pack {warm['pack']['total']:.2f} "
                  f"({warm['pack']['encode']:.2f} / {warm['pack']['sample']:.2f} / {warm['pack']['decode']:.2f}), "
                  f"official {warm['official']['total']:.2f} ({warm['official']['encode']:.2f} / "
                  f"{warm['official']['sample']:.2f} / {warm['official']['decode']:.2f}); pack faster "
                  f"{warm['official']['total'] / warm['pack']['total']:.2f}x", flush=True)
            print(f"      stock VAEDecode of a pack latent {res['stock_vaedecode_s']:.2f} s, same as the pack's "
                  f"decode: {res['stock_vaedecode_same']}; pack vs official max pixel difference "
                  f"{', '.join(f'{d:.2f}' for d in res['max_pixel_diff'])} / 255; {res['pinned_layers']} layers "
                  "have pinned host copies", flush=True)
            d = res["decode_alone"]
            print(f"      stock VAEDecode with nothing else loaded: {d['s']:.2f} s, tiled: {d['tiled']}; ComfyUI asks "
                  f"{d['asked_gib']:.2f} GiB ({d['vae_dtype']}), {d['free_gib']:.2f} GiB free after loading the VAE; the "
                  f"decoder called directly: {d.get('direct', 'not on a GPU')}, peak {d.get('peak_gib', 0):.2f} GiB",
                  flush=True)
            b = res["pack_breakdown"]
            print(f"      pack breakdown: encode {b['encode']:.3f}  load {b['load']:.3f}  sample {b['sample']:.3f} = setup "
                  f"{b['setup']:.3f} + steps {' '.join(f'{x * 1e3:.0f}' for x in b['steps'])} ms + gaps "
                  f"{sum(b['gaps']) * 1e3:.0f} ms + tail {b['tail']:.3f}; {b['uploads']} uploads, copy stream busy "
                  f"{b['copy_busy']:.3f} s; decode {b['decode']:.3f}", flush=True)
            print("      memory after loading the transformer, GiB: " + ", ".join(
                f"{k.replace('_', ' ')} {v:.2f}" for k, v in b["memory"].items()), flush=True)
            if not res["stock_vaedecode_same"]:
                print("      stock VAEDecode log: " + " | ".join(res["stock_vaedecode_log"])[:3000], flush=True)
    return results


if __name__ == "__main__":
    main()

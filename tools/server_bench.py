#!/usr/bin/env python3
"""Time whole images through a real ComfyUI server, as users run it: this pack's API workflow
against ComfyUI's official Z-Image template, each in its own server process, on one or more
simulated cards and (optionally) a simulated smaller host RAM. Standard library only; Linux.

    python tools/server_bench.py --comfy PATH/TO/ComfyUI --weights DIR [--python PY] \\
        [--card full --card 7.5] [--ram-gib 28] [--images 4] [--size 1024] [--steps 8] \\
        [--pipelines pack,official] [--dynamic on|off] [--env ZIMAGE_PINNED_GIB=8] [--json out.json]

    python tools/server_bench.py ... --session --loras A.safetensors,B.safetensors --unet2 FP8_FILE

--weights DIR holds z_image_turbo_bf16.safetensors (or --unet NAME), qwen_3_4b.safetensors and
ae.safetensors (and with --session the two LoRAs and the second checkpoint). --session makes the
images of an evening instead of --images alike (SESSION: LoRAs on, off, switched, stacked and at
another strength, a second size, the stock-nodes workflow, the second checkpoint and back) and
reports each pipeline's total for the whole run beside the warm and first image. Per card, per pipeline: read the weight files once (every server starts with them
in the page cache as far as the RAM holds them, not with what the server before it left there),
start the ballasts, start `main.py` on a free port with a temporary base directory (this
repository linked into custom_nodes/, the weights linked into models/), post --images prompts (a
new prompt text each, so the text encoder runs every time), stop the server, stop the ballasts.
Time per image is the executor's own, from the history entry's execution_start to
execution_success. Each server's log is kept, every line stamped with the seconds since the server
started; its path is printed. With --server-arg=--verbose --server-arg=DEBUG each image's row also
says where the pack's time went (encode, sample, decode, split set) and how much it evicted to make
room for the other models.

Simulated machine:
  --card GIB     leave GIB of GPU memory free (tools/ballast.py, needs torch+CUDA in --python);
                 "full" holds nothing. Repeatable or comma separated: --card full,11.5,7.5
  --ram-gib G    hold host RAM (tools/ram_ballast.py) so that only G GiB stay available.
  --cache-ram "A B"  ComfyUI's --cache-ram headroom (GB). The values a machine of T GB gets are
                 A = min(10, max(2, T/10)), B = T: a 32 GB machine `3.2 32`, a 16 GB one `2 16`.
                 With --ram-gib or --machine-gib T and no --cache-ram they are derived from T
                 (default T: --ram-gib rounded up to 16, 32, 64, ...).
--cpu runs everything on the CPU (plumbing checks with small weights, no ballast).
"""
import argparse
import ctypes
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACK = "zimage_turbo_streaming"
TE, VAE = "qwen_3_4b.safetensors", "ae.safetensors"
PROMPTS = [
    "A weathered lighthouse on a rocky headland at golden hour, waves breaking in white spray",
    "A red fox curled up asleep in fresh snow under a pine tree, soft morning light",
    "A busy night market in the rain, neon signs reflected in puddles, 35mm photograph",
    "An astronaut tending a small greenhouse on the moon, earth rising behind the dome",
    "A bowl of ramen on a wooden counter, steam rising, shallow depth of field",
    "A watercolor of a canal in Venice with gondolas and laundry lines between old houses",
]
PIN_RE = re.compile(r"Z-Image: pinned ([0-9.]+) GiB")
ZLOAD_RE = re.compile(r"Z-Image: loading the transformer")
# where an image's time goes (the pack's debug lines: --server-arg=--verbose --server-arg=DEBUG)
PHASES = {"encode_s": re.compile(r"Z-Image: prompt encoded in ([0-9.]+) s"),
          "decode_s": re.compile(r"Z-Image: decoded in ([0-9.]+) s"),
          "sample_s": re.compile(r"Z-Image: sampled \d+ steps in ([0-9.]+) s"),
          "step_s": re.compile(r"Z-Image: sampled .* then ([0-9.]+) s a step"),
          "split_s": re.compile(r"Z-Image: split set in ([0-9.]+) s")}
EVICT_RE = re.compile(r"Z-Image: made room for another model: ([0-9.]+) GiB freed")
COMFY_LOADS = {"requested": "Requested to load", "completely": "loaded completely", "partially": "loaded partially"}
GIB = 2**30


def mem_available_gib():
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 / GIB for l in f if l.startswith("MemAvailable:"))


def rss_gib(pid):
    """RssAnon and RssFile of one process: main.py runs the whole server in one process."""
    with open(f"/proc/{pid}/status") as f:
        kb = {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("RssAnon", "RssFile"))}
    return kb["RssAnon"] * 1024 / GIB, kb["RssFile"] * 1024 / GIB


def _child_setup():
    # a process group of its own, so stop() ends it and anything it started with one signal (the
    # same session, so whatever ends this session's processes ends these too), and SIGKILL when
    # this script dies, however it dies: a server or ballast left behind holds GBs of RAM or GPU
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(cmd, log_path, env=None, cwd=None):
    """Start ``cmd`` with its output in ``log_path``, each line stamped with the seconds since the
    start (ComfyUI's own lines carry no time: the stamps show where an image's seconds went)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            preexec_fn=_child_setup)
    threading.Thread(target=_stamp, args=(proc.stdout, log_path, time.monotonic()), daemon=True).start()
    return proc


def _stamp(out, log_path, start):
    with out, open(log_path, "ab", buffering=0) as log:
        for line in out:
            log.write(b"%9.3f " % (time.monotonic() - start) + line)


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def tail(path, n=40):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def start_ballast(a, script, leave_gib, flag, log, timeout=600):
    """Start tools/<script> holding all but leave_gib, and wait for its flag file (memory held)."""
    proc = spawn([a.python, os.path.join(HERE, script), "--leave-gib", str(leave_gib), "--flag", flag], log)
    end = time.monotonic() + timeout
    while not os.path.exists(flag):
        if proc.poll() is not None or time.monotonic() > end:
            stop(proc)
            raise SystemExit(f"{script} exited with {proc.returncode} or was not ready in {timeout} s:\n{tail(log)}")
        time.sleep(0.5)
    return proc


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.url, self.log, self.offset = proc, f"http://127.0.0.1:{port}", log, 0

    def call(self, path, body=None, timeout=60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:4000]}") from None
        except OSError:
            self.check_alive()  # a dead server says why in its log; otherwise the caller decides
            raise

    def check_alive(self):
        if self.proc.poll() is not None:
            raise SystemExit(f"ComfyUI exited with {self.proc.returncode}; log {self.log}:\n{tail(self.log)}")

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check_alive()
            try:
                return self.call("/system_stats", timeout=5)
            except (OSError, ValueError):  # not listening yet
                time.sleep(1)
        raise SystemExit(f"ComfyUI did not answer within {timeout} s; log {self.log}:\n{tail(self.log)}")

    def run(self, workflow, timeout):
        """Queue one prompt and wait; the executor's own seconds from start to success."""
        resp = self.call("/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
        if resp.get("node_errors") or "prompt_id" not in resp:
            raise SystemExit(f"ComfyUI rejected the prompt: {json.dumps(resp, indent=1)[:4000]}")
        pid, end = resp["prompt_id"], time.monotonic() + timeout
        while True:
            status = (self.call(f"/history/{pid}").get(pid) or {}).get("status", {})
            events = {name: data for name, data in status.get("messages", [])}
            if status.get("status_str") == "error" or "execution_error" in events:
                e = events.get("execution_error", {})
                raise SystemExit(f"the prompt failed in {e.get('node_type')} (node {e.get('node_id')}): "
                                 f"{e.get('exception_type')}: {e.get('exception_message')}\n"
                                 f"{''.join(e.get('traceback', []))[-3000:]}log: {self.log}")
            if status.get("status_str") == "success":
                return (events["execution_success"]["timestamp"] - events["execution_start"]["timestamp"]) / 1000
            self.check_alive()
            if time.monotonic() > end:
                raise SystemExit(f"the prompt did not finish within {timeout} s; log {self.log}")
            time.sleep(0.2)

    def new_log(self):
        """Counts of the pack's and ComfyUI's load lines in the log since the last call."""
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            raw = f.read()
        self.offset += len(raw)
        text = raw.decode(errors="replace")
        pins = [float(g) for g in PIN_RE.findall(text)]
        out = dict(pin_calls=len(pins), pinned_gib=sum(pins), zimage_loads=len(ZLOAD_RE.findall(text)),
                   evicted_gib=round(sum(float(g) for g in EVICT_RE.findall(text)), 2))
        out.update({k: round(sum(float(g) for g in r.findall(text)), 3) for k, r in PHASES.items() if r.search(text)})
        out.update({f"comfy_{k}": text.count(v) for k, v in COMFY_LOADS.items()})
        return out


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


def weight_files(a) -> list:
    """[(models/ folder, file in --weights)] of every weight file the run uses."""
    files = [("diffusion_models", a.unet), ("text_encoders", TE), ("vae", VAE)]
    if a.session:
        files += [("diffusion_models", a.unet2)] + [("loras", name) for name in a.loras]
    return files


def make_base(a):
    """A ComfyUI base directory: this repository as a custom node, the weights linked into models/."""
    files = weight_files(a)
    for _, name in files:
        if not os.path.isfile(os.path.join(a.weights, name)):
            raise SystemExit(f"missing weight file {os.path.join(os.path.abspath(a.weights), name)}")
    base = tempfile.mkdtemp(prefix="zimage_server_bench_")
    for sub in ("custom_nodes", "user", "input", "output", "temp", "frontend", "logs",
                *dict.fromkeys("models/" + f for f, _ in files)):
        os.makedirs(os.path.join(base, sub))
    os.symlink(ROOT, os.path.join(base, "custom_nodes", PACK), target_is_directory=True)
    for folder, name in files:
        os.symlink(os.path.join(os.path.abspath(a.weights), name), os.path.join(base, "models", folder, name))
    return base


def server_flags(a):
    flags = []
    if a.cache_ram:
        flags += ["--cache-ram", *a.cache_ram.split()]
    if a.dynamic == "off":
        with open(os.path.join(a.comfy, "comfy", "cli_args.py")) as f:
            if "--disable-dynamic-vram" in f.read():  # older trees have only the classic path
                flags.append("--disable-dynamic-vram")
            else:
                print("note: this ComfyUI has no --disable-dynamic-vram (classic memory manager only)")
    return flags + (["--cpu"] if a.cpu else []) + a.server_arg


def read_through(paths):
    """Read each file once before the ballasts start, so that every server starts with the weights
    in the page cache as far as the simulated RAM holds them (a user's machine after an earlier
    run), not with what the server before it happened to leave there. Dirty pages are written out
    first (weights written just before): the RAM ballast cannot reclaim them, so the kernel would
    drop the clean pages just read instead, and the first image would read the disk."""
    os.sync()
    buf = bytearray(64 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def one_server(a, base, pipeline, card, tag):
    """Ballasts -> server -> images -> stop server -> stop ballasts; the record of this server."""
    logs = os.path.join(base, "logs")
    log = os.path.join(logs, f"{tag}-{pipeline}-card{card}.log")
    procs, server = [], None
    try:
        read_through(os.path.join(a.weights, name) for _, name in weight_files(a))
        # the GPU ballast first: its CUDA context takes host RAM that the RAM ballast then accounts for
        if card != "full":
            procs.append(start_ballast(a, "ballast.py", card, f"{log}.gpu.ready", f"{log}.ballast"))
        if a.ram_gib:
            procs.append(start_ballast(a, "ram_ballast.py", a.ram_gib, f"{log}.ram.ready", f"{log}.ballast"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [a.python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
               "--base-directory", base, "--front-end-root", os.path.join(base, "frontend"), *a.flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # log lines arrive with the image they belong to
        if pipeline == "pack":
            env.update(kv.split("=", 1) for kv in a.env)
        avail = mem_available_gib()  # after the ballasts, before the server
        print(f"--- {pipeline}, card {card}: {avail:.1f} GiB RAM available; log {log}", flush=True)
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
        server = Server(spawn(cmd, log, env=env, cwd=a.comfy), port, log)
        server.wait_ready(a.start_timeout)
        server.new_log()  # start-up lines are not an image's
        rec = dict(pipeline=pipeline, card=card, ram_available_gib=round(avail, 2), log=log, server_cmd=cmd,
                   env=a.env if pipeline == "pack" else [], images=[])
        build = pack_workflow if pipeline == "pack" else official_workflow
        steps = SESSION if a.session else [None] * a.images
        for i, step in enumerate(steps):
            prompt = PROMPTS[i % len(PROMPTS)] + (f", variation {i // len(PROMPTS)}" if i >= len(PROMPTS) else "")
            wf = session_workflow(a, pipeline, step, prompt) if step else build(a, prompt)
            sec = server.run(wf, a.timeout)
            anon, file = rss_gib(server.proc.pid)
            row = dict(image=i + 1, label=step["label"] if step else "", seconds=round(sec, 3),
                       rss_anon_gib=round(anon, 2), rss_file_gib=round(file, 2), **server.new_log())
            rec["images"].append(row)
            print(f"{pipeline:8} card {card:>5} image {i + 1}{' ' + row['label'] if row['label'] else ''}: {sec:7.2f} s  RSS {anon:5.1f} + {file:5.1f} GiB  "
                  f"pins {row['pin_calls']} ({row['pinned_gib']:.1f} GiB)  loads: Z-Image {row['zimage_loads']}, "
                  f"ComfyUI {row['comfy_requested']} requested"
                  + "".join(f"  {k[:-2]} {row[k]:.2f} s" for k in PHASES if k in row)
                  + (f"  evicted {row['evicted_gib']:.2f} GiB" if row["evicted_gib"] else ""), flush=True)
        return rec
    finally:
        stop(server.proc if server else None)
        for p in reversed(procs):
            stop(p)


def summarize(rec):
    im = rec["images"]
    warm = im[1:]
    return dict(first_s=im[0]["seconds"], total_s=round(sum(r["seconds"] for r in im), 2), warm_median_s=statistics.median(r["seconds"] for r in warm) if warm else None,
                max_rss_anon_gib=max(r["rss_anon_gib"] for r in im), max_rss_file_gib=max(r["rss_file_gib"] for r in im),
                rss_anon_first_warm_gib=warm[0]["rss_anon_gib"] if warm else None,
                rss_anon_last_warm_gib=warm[-1]["rss_anon_gib"] if warm else None,
                pin_calls_after_first=sum(r["pin_calls"] for r in warm),
                zimage_loads_after_first=sum(r["zimage_loads"] for r in warm),
                comfy_requested_after_first=sum(r["comfy_requested"] for r in warm),
                totals={k: sum(r[k] for r in im) for k in im[0] if k not in ("image", "label", "seconds") and "rss" not in k})


def report(runs):
    f = lambda v, w=6, p=2: f"{v:{w}.{p}f}" if v is not None else " " * (w - 1) + "-"
    print("\npipeline  card   RAM avail  first s  warm s  anon max  file max  anon warm 1st->last  pins>1  "
          "loads>1 (Z-Image/ComfyUI)")
    for r in runs:
        s = r["summary"]
        print(f"{r['pipeline']:8} {r['card']:>5}  {f(r['ram_available_gib'], 9, 1)}  {f(s['first_s'], 7)}  "
              f"{f(s['warm_median_s'])}  {f(s['max_rss_anon_gib'], 8, 1)}  {f(s['max_rss_file_gib'], 8, 1)}  "
              f"{f(s['rss_anon_first_warm_gib'], 9, 1)} -> {f(s['rss_anon_last_warm_gib'], 6, 1)}  "
              f"{s['pin_calls_after_first']:6d}  {s['zimage_loads_after_first']:7d} / {s['comfy_requested_after_first']}")
    ratios = {}
    for card in dict.fromkeys(r["card"] for r in runs):
        by = {r["pipeline"]: r["summary"] for r in runs if r["card"] == card}
        if "pack" in by and "official" in by:
            div = lambda k: (round(by["official"][k] / by["pack"][k], 3)
                             if by["official"][k] and by["pack"][k] else None)
            ratios[card] = dict(warm=div("warm_median_s"), first=div("first_s"), total=div("total_s"))
            print(f"card {card}: official / pack = {f(ratios[card]['warm'], 5)} warm, {f(ratios[card]['first'], 5)} first, "
                  f"{f(ratios[card]['total'], 5)} the whole run ({by['official']['total_s']:.1f} / {by['pack']['total_s']:.1f} s)")
    return ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--comfy", required=True, help="the ComfyUI source tree (main.py); the servers run there")
    ap.add_argument("--python", default=sys.executable, help="python for the servers and ballasts (default: this one)")
    ap.add_argument("--weights", required=True, help="folder with the transformer, qwen_3_4b and ae files")
    ap.add_argument("--unet", default="z_image_turbo_bf16.safetensors", help="transformer file in --weights")
    ap.add_argument("--pipelines", default="pack,official", help="comma separated: pack, official")
    ap.add_argument("--card", action="append", help='GiB of GPU memory left free, or "full" (repeatable, commas)')
    ap.add_argument("--ram-gib", type=float, help="hold host RAM so that only this many GiB are available")
    ap.add_argument("--machine-gib", type=float, help="nominal RAM of the simulated machine (for --cache-ram)")
    ap.add_argument("--cache-ram", help='ComfyUI --cache-ram values, e.g. "3.2 32" (32 GB) or "2 16" (16 GB)')
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--session", action="store_true",
                    help=f"instead of --images alike, the {len(SESSION)} images of an evening (SESSION): needs --loras and --unet2")
    ap.add_argument("--loras", help="--session: two LoRA files in --weights, comma separated (A,B)")
    ap.add_argument("--unet2", help="--session: the second checkpoint in --weights (e.g. the fp8 file)")
    ap.add_argument("--wide", default="1344x768", help="--session: the other size, WxH")
    ap.add_argument("--size", type=int, default=1024, help="width = height, a multiple of 16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--dynamic", choices=("on", "off"), default="on", help="off: --disable-dynamic-vram")
    ap.add_argument("--cpu", action="store_true", help="run the servers with --cpu (plumbing checks)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the pack's server")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more main.py argument for every server (repeatable), e.g. --server-arg=--verbose "
                         "--server-arg=DEBUG for the pack's timings")
    ap.add_argument("--json", help="write every record and the summary here (rewritten after each server)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one image")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for a server to answer")
    a = ap.parse_args(argv)
    a.comfy = os.path.abspath(a.comfy)
    if not os.path.isfile(os.path.join(a.comfy, "main.py")):
        raise SystemExit(f"{a.comfy} has no main.py: --comfy takes a ComfyUI source tree")
    cards = [c.strip() for v in (a.card or ["full"]) for c in v.split(",") if c.strip()]
    if any(c != "full" and not re.fullmatch(r"[0-9]+(\.[0-9]*)?", c) for c in cards):
        raise SystemExit(f'--card takes GiB left free (e.g. 7.5) or "full", not {cards}')
    if a.cpu and cards != ["full"] * len(cards):
        raise SystemExit("--card needs a GPU; with --cpu use --card full")
    pipelines = [p.strip() for p in a.pipelines.split(",")]
    if set(pipelines) - {"pack", "official"} or any("=" not in kv for kv in a.env):
        raise SystemExit("--pipelines takes pack and/or official; --env takes K=V")
    if a.images < 1:
        raise SystemExit("--images takes 1 or more")
    if a.session:
        a.loras = [n.strip() for n in (a.loras or "").split(",") if n.strip()]
        if len(a.loras) != 2 or not a.unet2:
            raise SystemExit("--session needs --loras A,B (two LoRA files in --weights) and --unet2 (a second checkpoint)")
        try:
            a.wide = tuple(int(v) for v in a.wide.lower().split("x"))
            assert len(a.wide) == 2 and all(v > 0 and v % 16 == 0 for v in a.wide)
        except (ValueError, AssertionError):
            raise SystemExit(f"--wide takes WxH in multiples of 16 (e.g. 1344x768), not {a.wide!r}") from None
    if (a.ram_gib or a.machine_gib) and not a.cache_ram:
        t = a.machine_gib or next(n for n in (16, 32, 64, 128, 256, 512, 1024, 2**20) if n >= a.ram_gib)
        a.cache_ram = f"{min(10.0, max(2.0, t / 10)):g} {min(t, 96.0):g}"  # ComfyUI's own defaults for T GB
    base, a.flags = make_base(a), server_flags(a)
    print(f"base directory {base}; ComfyUI flags: {' '.join(a.flags)}", flush=True)
    runs, tag = [], time.strftime("%Y%m%d-%H%M%S")
    out = dict(args=vars(a), base=base, runs=runs)
    for card in cards:
        for pipeline in pipelines:
            rec = one_server(a, base, pipeline, card, tag)
            rec["summary"] = summarize(rec)
            runs.append(rec)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
    out["ratios_official_over_pack"] = report(runs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    # a plain `kill` or a timeout: unwind, so the finally blocks stop the server and the ballasts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit("hung up"))
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally blocks have stopped the server and the ballasts
        sys.exit("interrupted")

#!/usr/bin/env python3
"""Time whole images through a real ComfyUI server, as users run it: this pack's API workflow
against ComfyUI's official Z-Image template, each in its own server process, on one or more
simulated cards and (optionally) a simulated smaller host RAM. Standard library only; Linux.

    python tools/server_bench.py --comfy PATH/TO/ComfyUI --weights DIR [--python PY] \\
        [--card full --card 7.5] [--ram-gib 28] [--images 4] [--size 1024] [--steps 8] \\
        [--pipelines pack,official] [--dynamic on|off] [--env ZIMAGE_PINNED_GIB=8] [--json out.json]

    python tools/server_bench.py ... --unet MODEL.gguf --pipelines pack,gguf --gguf-nodes PATH/TO/ComfyUI-GGUF

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
says where the pack's time went (encode, sample and its first step, decode, split set), how many
of the sample's layer uploads read the checkpoint rather than a master (layers coming back from the
page cache), how much it evicted to make room for the other models, the seconds from the decode's
end to the prompt's (ComfyUI's SaveImage writing the PNG, and the pack setting its split back), and
the image's floor: its steps at the bound the planner simulated for its split, plus its encode and
decode, and the image's seconds over that floor.

Simulated machine:
  --card GIB     leave GIB of GPU memory free (tools/ballast.py, needs torch+CUDA in --python);
                 "full" holds nothing. Repeatable or comma separated: --card full,11.5,7.5
  --gpus N       ballast the first N GPUs alike (two small cards: --gpus 2 --card 7.5; the pack's
                 loader spans them, auto; --pack-devices cuda:0 keeps it on one)
  --ram-gib G    hold host RAM (tools/ram_ballast.py) so that only G GiB stay available.
  --cache-ram "A B"  ComfyUI's --cache-ram headroom (GB). The values a machine of T GB gets are
                 A = min(10, max(2, T/10)), B = T: a 32 GB machine `3.2 32`, a 16 GB one `2 16`.
                 With --ram-gib or --machine-gib T and no --cache-ram they are derived from T
                 (default T: --ram-gib rounded up to 16, 32, 64, ...).
--cpu runs everything on the CPU (plumbing checks with small weights, no ballast).

Pipelines: pack (this pack's workflow), official (ComfyUI's template), gguf (the official template
with ComfyUI-GGUF's `Unet Loader (GGUF)` in place of UNETLoader: --gguf-nodes is a checkout of
city96/ComfyUI-GGUF, linked into custom_nodes beside the pack). Every other pipeline is compared with
the pack's.
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import sys
import tempfile
import time

from bench_workflows import SESSION, TE, VAE, WORKFLOWS, session_workflow
from server_processes import PHASES, Server, mem_available_gib, read_through, rss_gib, spawn, start_ballast, stop

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACK = "zimage_turbo_streaming"
PROMPTS = [
    "A weathered lighthouse on a rocky headland at golden hour, waves breaking in white spray",
    "A red fox curled up asleep in fresh snow under a pine tree, soft morning light",
    "A busy night market in the rain, neon signs reflected in puddles, 35mm photograph",
    "An astronaut tending a small greenhouse on the moon, earth rising behind the dome",
    "A bowl of ramen on a wooden counter, steam rising, shallow depth of field",
    "A watercolor of a canal in Venice with gondolas and laundry lines between old houses",
]


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
    if a.gguf_nodes:
        os.symlink(os.path.abspath(a.gguf_nodes), os.path.join(base, "custom_nodes", "ComfyUI-GGUF"),
                   target_is_directory=True)
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


def one_server(a, base, pipeline, card, tag):
    """Ballasts -> server -> images -> stop server -> stop ballasts; the record of this server."""
    logs = os.path.join(base, "logs")
    log = os.path.join(logs, f"{tag}-{pipeline}-card{card}.log")
    procs, server = [], None
    clock = [("start", time.monotonic())]  # what each part of the server's setup and teardown took
    try:
        read_through(os.path.join(a.weights, name) for _, name in weight_files(a))
        clock.append(("files read", time.monotonic()))
        # the GPU ballast first: its CUDA context takes host RAM that the RAM ballast then accounts for
        if card != "full":
            for gpu in range(a.gpus):  # each card the servers see, as small as the others
                procs.append(start_ballast(a, "ballast.py", card, f"{log}.gpu{gpu}.ready", f"{log}.ballast",
                                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))))
        if a.ram_gib:
            procs.append(start_ballast(a, "ram_ballast.py", a.ram_gib, f"{log}.ram.ready", f"{log}.ballast"))
        clock.append(("ballasts", time.monotonic()))
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
        clock.append(("server start", time.monotonic()))
        server.new_log()  # start-up lines are not an image's
        rec = dict(pipeline=pipeline, card=card, ram_available_gib=round(avail, 2), log=log, server_cmd=cmd,
                   env=a.env if pipeline == "pack" else [], images=[])
        steps = SESSION if a.session else [None] * a.images
        for i, step in enumerate(steps):
            prompt = PROMPTS[i % len(PROMPTS)] + (f", variation {i // len(PROMPTS)}" if i >= len(PROMPTS) else "")
            wf = session_workflow(a, pipeline, step, prompt) if step else WORKFLOWS[pipeline](a, prompt)
            if a.pack_devices:
                for n in wf.values():
                    if n.get("class_type") == "ZImageModelLoader":
                        n["inputs"]["devices"] = a.pack_devices
            sec = server.run(wf, a.timeout)
            anon, file = rss_gib(server.proc.pid)
            row = dict(image=i + 1, label=step["label"] if step else "", seconds=round(sec, 3),
                       rss_anon_gib=round(anon, 2), rss_file_gib=round(file, 2), **server.new_log())
            if {"step_bound_s", "encode_s", "decode_s"} <= set(row):
                # the image's floor: its steps at their planned bound, its encode and decode as they took
                row["floor_s"] = round(a.steps * row["step_bound_s"] + row["encode_s"] + row["decode_s"], 3)
            rec["images"].append(row)
            print(f"{pipeline:8} card {card:>5} image {i + 1}{' ' + row['label'] if row['label'] else ''}: {sec:7.2f} s  RSS {anon:5.1f} + {file:5.1f} GiB  "
                  f"pins {row['pin_calls']} ({row['pinned_gib']:.1f} GiB)  loads: Z-Image {row['zimage_loads']}, "
                  f"ComfyUI {row['comfy_requested']} requested"
                  + "".join(f"  {k[:-2]} {row[k]:.2f} s" for k in PHASES if k in row)
                  + (f"  {row['file_uploads']} uploads from the file" if "file_uploads" in row else "")
                  + (f"  after the decode {row['after_decode_s']:.2f} s" if "after_decode_s" in row else "")
                  + (f"  evicted {row['evicted_gib']:.2f} GiB" if row["evicted_gib"] else "")
                  + (f"  floor {row['floor_s']:.2f} s ({sec / row['floor_s']:.2f}x)" if "floor_s" in row else ""),
                  flush=True)
        clock.append(("images", time.monotonic()))
        return rec
    finally:
        stop(server.proc if server else None)
        for p in reversed(procs):
            stop(p)
        clock.append(("stop", time.monotonic()))
        # a lent GPU's time is short: where a server's minutes went, so the next run can be planned
        print(f"--- {pipeline}, card {card}: " + ", ".join(f"{name} {t - before:.0f} s" for (_, before), (name, t)
                                                          in zip(clock, clock[1:])), flush=True)


def _over_floor(images, less):
    """The median of the images' seconds, less their phases ``less``, over their floors."""
    rows = [r for r in images if {"floor_s", *less} <= set(r)]
    return statistics.median((r["seconds"] - sum(r[k] for k in less)) / r["floor_s"] for r in rows) if rows else None


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
                warm_over_floor_median=_over_floor(warm, ()),
                # up to the decode's end: the pack's part of the image over its floor
                warm_to_decode_over_floor_median=_over_floor(warm, ("after_decode_s",)),
                totals={k: round(sum(r.get(k, 0) for r in im), 3) for k in dict.fromkeys(k for r in im for k in r)
                        if k not in ("image", "label", "seconds", "step_bound_s", "floor_s") and "rss" not in k})


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
        for other in [p for p in by if p != "pack" and "pack" in by]:
            div = lambda k: (round(by[other][k] / by["pack"][k], 3) if by[other][k] and by["pack"][k] else None)
            r = ratios.setdefault(card, {})[other] = dict(warm=div("warm_median_s"), first=div("first_s"), total=div("total_s"))
            print(f"card {card}: {other} / pack = {f(r['warm'], 5)} warm, {f(r['first'], 5)} first, "
                  f"{f(r['total'], 5)} the whole run ({by[other]['total_s']:.1f} / {by['pack']['total_s']:.1f} s)")
    return ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--comfy", required=True, help="the ComfyUI source tree (main.py); the servers run there")
    ap.add_argument("--python", default=sys.executable, help="python for the servers and ballasts (default: this one)")
    ap.add_argument("--weights", required=True, help="folder with the transformer, qwen_3_4b and ae files")
    ap.add_argument("--unet", default="z_image_turbo_bf16.safetensors", help="transformer file in --weights")
    ap.add_argument("--pipelines", default="pack,official", help="comma separated: pack, official, gguf")
    ap.add_argument("--gguf-nodes", help="a checkout of city96/ComfyUI-GGUF (the gguf pipeline's loader)")
    ap.add_argument("--card", action="append", help='GiB of GPU memory left free, or "full" (repeatable, commas)')
    ap.add_argument("--gpus", type=int, default=1,
                    help="with --card, ballast this many GPUs (cuda:0 ...), each left --card GiB free")
    ap.add_argument("--pack-devices", help='the pack loader\'s devices input (default: its own, "auto"), '
                                           'e.g. cuda:0 for the pack on one of --gpus cards')
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
    if set(pipelines) - set(WORKFLOWS) or any("=" not in kv for kv in a.env):
        raise SystemExit(f"--pipelines takes {', '.join(WORKFLOWS)}; --env takes K=V")
    if "gguf" in pipelines and not (a.gguf_nodes and os.path.isfile(os.path.join(a.gguf_nodes, "nodes.py"))):
        raise SystemExit("the gguf pipeline needs --gguf-nodes: a checkout of city96/ComfyUI-GGUF (with its nodes.py)")
    if "gguf" in pipelines and (a.session or not a.unet.endswith(".gguf")):
        raise SystemExit("the gguf pipeline runs --images of a .gguf --unet (not --session)")
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
    out["ratios_over_pack"] = report(runs)
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

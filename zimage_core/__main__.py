"""python -m zimage_core plan | bench | random-weights"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from . import host_memory
from .config import FULL, ZImageConfig
from .errors import ZImageError

GiB = 1 << 30
MAX_SIDE = 4096  # the largest image side, as in the ComfyUI sampler node
MAX_BATCH = 64
MAX_GIB = 4096
DOES_NOT_FIT = 3  # plan's exit status when the transformer does not fit (argparse uses 2 for bad input)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line instead of argparse's usage block: the usage is one --help away."""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _number(text, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def side(text):
    """An image side in pixels: Z-Image's VAE downscales by 8 and the transformer patches by 2."""
    v = _number(text, int)
    if v <= 0 or v % 16 or v > MAX_SIDE:
        near = min(max(16, round(v / 16) * 16), MAX_SIDE)
        raise argparse.ArgumentTypeError(f"{v}: give one of the multiples of 16 from 16 to {MAX_SIDE} (try {near})")
    return v


def count(lo, hi=None):
    def parse(text):
        v = _number(text, int)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: give {lo} to {hi}" if hi is not None else
                                             f"{v} is out of range: give {lo} or more")
        return v
    return parse


def gib(lo_exclusive=False):
    def parse(text):
        v = _number(text, float)
        if v < 0 or (lo_exclusive and v == 0) or v > MAX_GIB:
            raise argparse.ArgumentTypeError(f"{text} GiB is out of range: give a number of GiB "
                                             f"{'above' if lo_exclusive else 'from'} 0 up to {MAX_GIB}")
        return v
    return parse


def layer_list(text):
    """--resident-layers: 30 or 30,18,0."""
    try:
        return [count(0)(v) for v in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; give layer counts separated by commas, e.g. 30,18,0") from None


def device(text):
    try:
        d = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here: give cpu or leave --device out")
    return text


def weights_file(text):
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def checkpoint_out(text):
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name in it, e.g. "
                                         f"{os.path.join(text, 'z_image_turbo_bf16.safetensors')}")
    if not text.endswith((".safetensors", ".sft")):
        raise argparse.ArgumentTypeError(f"{text}: name it .safetensors (ComfyUI lists only .safetensors and .sft files)")
    return text


def _plan(a):
    from . import planner
    if a.vram_gib is not None:
        free = int(a.vram_gib * GiB)
    elif torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        sys.exit("error: no CUDA device here: give --vram-gib (the free GPU memory to plan for)")
    storage = torch.float8_e4m3fn if a.fp8 else torch.bfloat16
    ram = int(a.ram_gib * GiB) if a.ram_gib is not None else host_memory.available_ram()
    host = None if ram is None else planner.host_room(FULL, ram, storage=storage)
    p = planner.plan(FULL, free, a.width, a.height, a.batch, storage=storage,
                     host_room=None if host is None else host.layers)
    if a.json:
        print(json.dumps(dict(p.as_dict(), host=None if host is None else host.as_dict())))
    else:
        g = lambda b: f"{b / GiB:.2f} GiB"
        print(p.summary())
        print(f"  free device memory   {g(p.free_bytes)}")
        print(f"  resident layers      {p.resident_layers}")
        print(f"  streamed layers      {p.streamed_layers}")
        print(f"  slots                {p.slots} x {g(p.layer_bytes)}")
        print(f"  activation estimate  {g(p.activation_bytes)}")
        print(f"  fixed part           {g(p.fixed_bytes)}")
        print(f"  device bytes         {g(p.device_bytes)}")
        print(f"  pinned host bytes    {g(p.pinned_host_bytes)} (the streamed layers)")
        if host is not None:
            print(f"  host RAM available   {g(host.available)}: ComfyUI keeps {g(host.headroom)} free, a run "
                  f"needs {g(host.working)}, staging and fixed part {g(host.fixed)}")
            print(f"  streamed layers      {p.pinned_layers} pinned, {p.file_layers} read from the page cache")
            left = max(0, host.layers - p.pinned_host_bytes)
            print(f"  text encoder         {g(left)} left for its pinned layers (all of them: "
                  f"{g(planner.TEXT_ENCODER_LAYERS_BYTES)}; the rest are read from its file at each prompt)")
        print(f"  smallest card        {g(p.needed_bytes)} free at {p.width}x{p.height} (every layer streamed)")
    if not p.fits:
        sys.exit(DOES_NOT_FIT)


def _random(a):
    from .random_weights import write_checkpoint
    cfg = ZImageConfig(n_layers=a.layers)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "fp8_e4m3fn": torch.float8_e4m3fn}[a.dtype]
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        try:
            os.makedirs(folder)
        except OSError as e:
            sys.exit(f"error: cannot create the folder {folder}: {e.strerror}")
        print(f"created {folder}")
    out = write_checkpoint(a.out, cfg, dtype=dtype, seed=a.seed, device=a.device)
    print(f"wrote {out[0]} ({cfg.n_layers} layers, {a.dtype}, {cfg.total_params() / 1e9:.2f} B parameters)")


def _bench(a):
    from . import bench
    results = bench.run(a.weights, a.width, a.height, a.steps, a.seed, a.resident_layers or [None], a.device,
                        a.resident, card_gib=a.simulate_card_gib)
    for r in results:
        if a.json:
            print(json.dumps(r))
        else:
            _print_bench(r)


def _print_bench(r):
    ms = lambda s: f"{s * 1e3:.1f} ms"
    gbs = lambda b: f"{b / 1e9:.1f} GB/s" if b else "n/a"
    card = f"  card {r['card_gib']} GiB free" if r["card_gib"] else ""
    print(f"{r['device']}{card}  {r['width']}x{r['height']}  {r['steps']} steps")
    print(f"  resident layers     {r['resident_layers']} ({r['streamed_layers']} streamed, {r['slots']} slots)")
    if "load_s" in r:
        print(f"  load                {r['load_s']:.2f} s")
    print(f"  first forward       {r['first_forward_s']:.2f} s ({r['prepare_s']:.2f} s setting the split; masters packed: "
          f"{r['pinned_layers']} pinned, {r['file_layers']} from the file)")
    print(f"  median step         {ms(r['median_step_s'])} (first {ms(r['first_step_s'])}; "
          f"{r['pin_calls_in_steps']} pin calls)")
    print(f"  compute alone       {ms(r['compute_step_s'])}")
    print(f"  streamed per step   {r['streamed_bytes_per_step'] / 1e9:.2f} GB")
    print(f"  copy bandwidth      {gbs(r['copy_bandwidth_Bps'])} (pinned alone {gbs(r['pinned_bandwidth_Bps'])})")
    print(f"  bound               {ms(r['bound_s'])}  ratio {r['ratio_to_bound']:.3f}")
    if "resident_median_step_s" in r:
        print(f"  resident step       {ms(r['resident_median_step_s'])}  ratio {r['ratio_to_resident']:.3f}")
    if "measured_activation_bytes" in r:
        print(f"  activations         {r['measured_activation_bytes'] / GiB:.2f} GiB measured, "
              f"{r['planned_activation_bytes'] / GiB:.2f} GiB planned")
    print(f"  output_sha256       {r['output_sha256']}")
    if "resident_output_sha256" in r:
        same = "identical" if r["resident_output_sha256"] == r["output_sha256"] else "DIFFERENT"
        print(f"  resident sha256     {r['resident_output_sha256']} ({same})")


def main(argv=None):
    ap = _Parser(prog="python -m zimage_core")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="plan|random-weights|bench")
    p = sub.add_parser("plan", help="how many layers stay on the GPU for a card and image size",
                       description=f"Plan the split for a card and image size. Exit status {DOES_NOT_FIT} when "
                                   "the transformer does not fit, 2 for bad arguments.")
    p.add_argument("--vram-gib", type=gib(), help="free GPU memory to plan for, in GiB (default: measured)")
    p.add_argument("--width", type=side, default=1024,
                   help=f"image width in pixels, a multiple of 16 up to {MAX_SIDE} (default 1024)")
    p.add_argument("--height", type=side, default=1024,
                   help=f"image height in pixels, a multiple of 16 up to {MAX_SIDE} (default 1024)")
    p.add_argument("--batch", type=count(1, MAX_BATCH), default=1,
                   help=f"images made at once, 1 to {MAX_BATCH} (default 1)")
    p.add_argument("--ram-gib", type=gib(), help="host RAM available, in GiB (default: measured)")
    p.add_argument("--fp8", action="store_true", help="plan for an fp8 e4m3fn checkpoint")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(fn=_plan)
    r = sub.add_parser("random-weights", help="write a full-size random checkpoint (ComfyUI layout)")
    r.add_argument("out", type=checkpoint_out,
                   help="the .safetensors file to write (its folder is created if missing)")
    r.add_argument("--layers", type=count(1, 64), default=30, help="main transformer layers (default 30)")
    r.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3fn"])
    r.add_argument("--seed", type=count(0, 2**64 - 1), default=0)
    r.add_argument("--device", type=device, default="cpu", help="where to draw the random numbers (cuda is faster)")
    r.set_defaults(fn=_random)
    b = sub.add_parser("bench", help="median step time against its bound")
    b.add_argument("--weights", type=weights_file, required=True,
                   help="a Z-Image transformer .safetensors file (e.g. from random-weights)")
    b.add_argument("--width", type=side, default=1024,
                   help=f"image width in pixels, a multiple of 16 up to {MAX_SIDE} (default 1024)")
    b.add_argument("--height", type=side, default=1024,
                   help=f"image height in pixels, a multiple of 16 up to {MAX_SIDE} (default 1024)")
    b.add_argument("--steps", type=count(1, 200), default=8, help="timed steps (default 8)")
    b.add_argument("--seed", type=count(0, 2**64 - 1), default=0)
    b.add_argument("--resident-layers", type=layer_list,
                   help="force the split; a comma list (e.g. 30,18,0) runs several in one process")
    b.add_argument("--simulate-card-gib", type=gib(lo_exclusive=True),
                   help="hold the rest of the GPU in another process so only this much stays free")
    b.add_argument("--resident", action="store_true", help="also run everything resident, same process")
    b.add_argument("--device", type=device, help="cpu or cuda[:N] (default: cuda where there is one)")
    b.add_argument("--json", action="store_true", help="print each result as one JSON object per line")
    b.set_defaults(fn=_bench)
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ZImageError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

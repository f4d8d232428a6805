"""python -m zimage_core plan: the split a card and a RAM size get (benchmarks and the random-weight
generator are in tools/: python -m tools bench | random-weights)."""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from . import environment, quants, ram
from .config import FULL
from .errors import ZImageError
from .image_size import MAX_SIDE, is_side, nearest_side

GiB = 1 << 30
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
    if not is_side(v):
        raise argparse.ArgumentTypeError(f"{v}: give one of the multiples of 16 from 16 to {MAX_SIDE} "
                                         f"(try {nearest_side(v)})")
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


def size_arguments(p):
    """--width and --height, as every command that takes an image size reads them."""
    for name in ("width", "height"):
        p.add_argument(f"--{name}", type=side, default=1024,
                       help=f"image {name} in pixels, a multiple of 16 up to {MAX_SIDE} (default 1024)")


def run(ap, argv):
    """Parse ``argv`` and run the chosen command; the pack's errors end it with one line."""
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ZImageError, OSError) as e:
        sys.exit(f"error: {e}")


def _plan(a):
    from . import planner, plans
    from .layout import ALIGN
    if a.vram_gib is not None:
        free = int(a.vram_gib * GiB)
    elif torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        sys.exit("error: no CUDA device here: give --vram-gib (the free GPU memory to plan for)")
    env = environment.read()  # the server's settings, read as the server reads them
    storage = torch.float8_e4m3fn if a.fp8 else torch.bfloat16
    available = int(a.ram_gib * GiB) if a.ram_gib is not None else ram.available_ram()
    host = None if available is None else planner.host_room(FULL, available, storage=storage)
    if host is not None:
        layers_room = host.for_masters(env.pinned_cap)
    else:  # RAM that cannot be read leaves the masters unbounded, but for the cap
        unbounded = planner.host_room(FULL, 1 << 62, storage=storage)
        layers_room = None if env.pinned_cap is None else unbounded.for_masters(env.pinned_cap)
    stored = None
    if a.quant:  # the layers stream as the file stores them (a GGUF's blocks, an int8 or scaled fp8 file's bytes)
        shapes = FULL.big_shapes
        stored = (sum(-(-h * w // ALIGN) * ALIGN for h, w in shapes.values()) if a.quant == "int8"
                  else quants.stored_bytes(shapes, a.quant, ALIGN))
    p = planner.plan(FULL, free, a.width, a.height, a.batch, plans.Limits(host_room=layers_room), storage=storage,
                     compress="on" if a.compress else env.compression, stored=stored)
    if a.json:
        print(json.dumps(dict(p.as_dict(), host=None if host is None else host.as_dict())))
    else:
        g = lambda b: f"{b / GiB:.2f} GiB"
        print(p.summary())
        print(f"  free device memory   {g(p.free_bytes)}")
        print(f"  resident layers      {p.resident_layers}")
        print(f"  streamed layers      {p.streamed_layers}"
              + (f", {p.block_layers} of them kept on the GPU as their blocks ({g(p.block_layers * p.master_bytes)})"
                 if p.block_layers else ""))
        print(f"  slots                {p.slots} x {g(p.layer_bytes)}")
        print(f"  activation estimate  {g(p.activation_bytes)}")
        print(f"  fixed part           {g(p.fixed_bytes)}")
        print(f"  device bytes         {g(p.device_bytes)}")
        print(f"  pinned host bytes    {g(p.pinned_host_bytes)} (the streamed layers"
              f"{', compressed' if p.compressed else ', as stored' if p.quantized else ''})")
        if host is not None:
            print(f"  host RAM available   {g(host.available)}: ComfyUI keeps {g(host.headroom)} free, a run "
                  f"needs {g(host.working)}, staging and fixed part {g(host.fixed)}")
            print(f"  streamed layers      {p.pinned_layers} pinned, {p.file_layers} read from the page cache")
            if env.pinned_cap is not None:
                print(f"  pinned cap           {g(env.pinned_cap)} (ZIMAGE_PINNED_GIB): {g(layers_room)} for the layers")
            left = max(0, host.layers - p.pinned_host_bytes)
            te = planner.TEXT_ENCODER_LAYERS_BYTES
            where = "it stays in the page cache" if left >= te else "it is read from the disk at each new prompt"
            print(f"  text encoder         {g(te)} uploaded from its file at each prompt; {g(left)} of RAM "
                  f"left: {where}")
        print(f"  smallest card        {g(p.needed_bytes)} free at {p.width}x{p.height} (every layer streamed)")
    if not p.fits:
        sys.exit(DOES_NOT_FIT)


def main(argv=None):
    ap = _Parser(prog="python -m zimage_core")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="plan")
    p = sub.add_parser("plan", help="how many layers stay on the GPU for a card and image size",
                       description=f"Plan the split for a card and image size. Exit status {DOES_NOT_FIT} when "
                                   "the transformer does not fit, 2 for bad arguments.")
    p.add_argument("--vram-gib", type=gib(), help="free GPU memory to plan for, in GiB (default: measured)")
    size_arguments(p)
    p.add_argument("--batch", type=count(1, MAX_BATCH), default=1,
                   help=f"images made at once, 1 to {MAX_BATCH} (default 1)")
    p.add_argument("--ram-gib", type=gib(), help="host RAM available, in GiB (default: measured)")
    p.add_argument("--fp8", action="store_true", help="plan for an fp8 e4m3fn checkpoint")
    p.add_argument("--quant", choices=[*quants.TYPES, *quants.MIXES, "int8"],
                   help="plan for a GGUF of this type (Q4_K_M: Q4_K with w2 in Q6_K), or int8 for ComfyUI's int8 "
                        "and scaled fp8 files (a byte a weight): the layers stream as stored, and the card keeps "
                        "those it has room for as their blocks")
    p.add_argument("--compress", action="store_true",
                   help="with the streamed layers' masters stored compressed, as ZIMAGE_COMPRESSION=on (default: "
                        "ZIMAGE_COMPRESSION, as the nodes read it; ZIMAGE_PINNED_GIB caps the pinned masters)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(fn=_plan)
    run(ap, argv)


if __name__ == "__main__":
    main()

"""python -m zimage_core plan | bench | random-weights"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .config import FULL, ZImageConfig
from .errors import ZImageError

GiB = 1 << 30


def _plan(a):
    from . import planner
    if a.vram_gib is not None:
        free = int(a.vram_gib * GiB)
    elif torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        sys.exit("no CUDA device here: give --vram-gib (the free GPU memory to plan for)")
    if a.width % 16 or a.height % 16 or a.width <= 0 or a.height <= 0:
        sys.exit(f"width and height must be positive multiples of 16 (got {a.width}x{a.height})")
    storage = torch.float8_e4m3fn if a.fp8 else torch.bfloat16
    p = planner.plan(FULL, free, a.width, a.height, a.batch, storage=storage)
    if a.json:
        print(json.dumps(p.as_dict()))
        return
    g = lambda b: f"{b / GiB:.2f} GiB"
    print(p.summary())
    print(f"  free device memory   {g(p.free_bytes)}")
    print(f"  resident layers      {p.resident_layers}")
    print(f"  streamed layers      {p.streamed_layers}")
    print(f"  slots                {p.slots} x {g(p.layer_bytes)}")
    print(f"  activation estimate  {g(p.activation_bytes)}")
    print(f"  fixed part           {g(p.fixed_bytes)}")
    print(f"  device bytes         {g(p.device_bytes)}")
    print(f"  pinned host bytes    {g(p.pinned_host_bytes)}")


def _random(a):
    from .random_weights import write_checkpoint
    cfg = ZImageConfig(n_layers=a.layers)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "fp8_e4m3fn": torch.float8_e4m3fn}[a.dtype]
    out = write_checkpoint(a.out, cfg, dtype=dtype, seed=a.seed, device=a.device)
    print(f"wrote {out[0]} ({cfg.n_layers} layers, {a.dtype}, {cfg.total_params() / 1e9:.2f} B parameters)")


def _bench(a):
    from . import bench
    splits = [int(v) for v in a.resident_layers.split(",")] if a.resident_layers else [None]
    results = bench.run(a.weights, a.width, a.height, a.steps, a.seed, splits, a.device, a.resident,
                        card_gib=a.simulate_card_gib)
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
    print(f"  median step         {ms(r['median_step_s'])} (first {ms(r['first_step_s'])})")
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
    ap = argparse.ArgumentParser(prog="python -m zimage_core")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="how many layers stay on the GPU for a card and image size")
    p.add_argument("--vram-gib", type=float, help="free GPU memory to plan for (default: measured)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="plan for an fp8 e4m3fn checkpoint")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_plan)
    r = sub.add_parser("random-weights", help="write a full-size random checkpoint (ComfyUI layout)")
    r.add_argument("out")
    r.add_argument("--layers", type=int, default=30)
    r.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_e4m3fn"])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is faster)")
    r.set_defaults(fn=_random)
    b = sub.add_parser("bench", help="median step time against its bound")
    b.add_argument("--weights", required=True)
    b.add_argument("--width", type=int, default=1024)
    b.add_argument("--height", type=int, default=1024)
    b.add_argument("--steps", type=int, default=8)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--resident-layers", help="force the split; a comma list runs several in one process")
    b.add_argument("--simulate-card-gib", type=float,
                   help="hold the rest of the GPU in another process so only this much stays free")
    b.add_argument("--resident", action="store_true", help="also run everything resident, same process")
    b.add_argument("--device")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench)
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except ZImageError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

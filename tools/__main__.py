"""python -m tools bench | dequant | random-weights | random-lora | gguf-weights | fp8-weights | int8-weights | ratio: the core benchmark (median step against its bound,
in one process), the random-weight generator, and how well a checkpoint's layers compress. Run from
the repository's root."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from zimage_core import environment
from zimage_core.__main__ import GiB, _Parser, count, gib, run, size_arguments
from zimage_core.config import BIG_KEYS, ZImageConfig
from zimage_core.settings import STORAGE_DTYPES

from . import bench, ratio
from .fp8_weights import write_scaled_fp8
from .gguf_weights import QUANTS, write_gguf
from .int8_weights import write_int8
from . import random_weights
from .random_weights import write_checkpoint


def layer_list(text):
    """--resident-layers: 30 or 30,18,0."""
    try:
        return [count(0)(v) for v in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; give layer counts separated by commas, e.g. 30,18,0") from None


def rotation(text):
    """--convrot: a power of 4."""
    from zimage_core.int8_rows import is_rotation
    n = count(0)(text)
    if n and not is_rotation(n):
        raise argparse.ArgumentTypeError(f"{text}: a ConvRot group is a power of 4 (16, 64, 256, ...)")
    return n


def whole_blocks(text):
    """--cols: whole K-quant blocks a row."""
    n = count(256)(text)
    if n % 256:
        raise argparse.ArgumentTypeError(f"{n} is not a multiple of 256 (a K-quant block's weights)")
    return n


def device(text):
    try:
        d = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here: give cpu or leave --device out")
    return text


def weights_file(text):
    """A checkpoint as the loader takes it: a file, a .safetensors.index.json, or a folder of either."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return text


def checkpoint_out(text):
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name in it, e.g. "
                                         f"{os.path.join(text, 'z_image_turbo_bf16.safetensors')}")
    if not text.endswith((".safetensors", ".sft")):
        raise argparse.ArgumentTypeError(f"{text}: name it .safetensors (ComfyUI lists only .safetensors and .sft files)")
    return text


def _random(a):
    cfg = ZImageConfig(n_layers=a.layers)
    dtype = STORAGE_DTYPES[a.dtype]
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        try:
            os.makedirs(folder)
        except OSError as e:
            sys.exit(f"error: cannot create the folder {folder}: {e.strerror}")
        print(f"created {folder}")
    out = write_checkpoint(a.out, cfg, dtype=dtype, seed=a.seed, device=a.device, realistic=not a.plain)
    print(f"wrote {out[0]} ({cfg.n_layers} layers, {a.dtype}, {cfg.total_params() / 1e9:.2f} B parameters, "
          f"{'plain N(0, 0.02)' if a.plain else 'realistic'} values)")


def _bench(a):
    env = environment.read()  # ZIMAGE_PINNED_GIB and ZIMAGE_COMPRESSION, refused or used as the nodes do
    results = [r for compress in (["off", "on"] if a.compression == "both" else [a.compression or env.compression])
               for r in bench.run(a.weights, a.width, a.height, a.steps, a.seed, a.resident_layers or [None],
                                  a.device, a.resident, cap_tokens=a.prompt_tokens, card_gib=a.simulate_card_gib,
                                  compress=compress, batch=a.batch)]
    for r in results:
        if a.json:
            print(json.dumps(r))
        else:
            _print_bench(r)


def _dequant(a):
    where = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"one {a.rows}x{a.cols} matrix dequantized into bf16 on {where}:")
    for name, (wall, dev) in bench.dequantize_times(where, a.rows, a.cols).items():
        print(f"  {name:5s} {wall:7.2f} ms" + (f" ({dev:.2f} ms on the device)" if dev is not None else ""))


def _print_bench(r):
    ms = lambda s: f"{s * 1e3:.1f} ms"
    gbs = lambda b: f"{b / 1e9:.1f} GB/s" if b else "n/a"
    card = f"  card {r['card_gib']} GiB free" if r["card_gib"] else ""
    batch = f", batch {r['batch']}" if r["batch"] > 1 else ""
    print(f"{r['device']}{card}  {r['width']}x{r['height']}{batch}  {r['steps']} steps")
    print(f"  resident layers     {r['resident_layers']} ({r['streamed_layers']} streamed, {r['slots']} slots)")
    if "load_s" in r:
        print(f"  load                {r['load_s']:.2f} s")
    print(f"  first forward       {r['first_forward_s']:.2f} s ({r['prepare_s']:.2f} s setting the split; masters packed: "
          f"{r['pinned_layers']} pinned, {r['file_layers']} from the file)")
    print(f"  median step         {ms(r['median_step_s'])} (first {ms(r['first_step_s'])}; "
          f"{r['pin_calls_in_steps']} pin calls)")
    print(f"  compute alone       {ms(r['compute_step_s'])}")
    print(f"  streamed per step   {r['streamed_bytes_per_step'] / 1e9:.2f} GB"
          f"{' (compressed: %d layers)' % r['compressed_layers'] if r['compressed_layers'] else ''}")
    if r.get("decode_s_per_layer"):
        print(f"  decode              {ms(r['decode_s_per_layer'])} a layer (the masters took {r['encode_s']:.2f} s "
              "to encode, in the first forward)")
    print(f"  copy bandwidth      {gbs(r['copy_bandwidth_Bps'])} (pinned alone {gbs(r['pinned_bandwidth_Bps'])})")
    print(f"  bound               {ms(r['bound_s'])}  ratio {r['ratio_to_bound']:.3f}")
    if "peak_reserved_bytes" in r:
        gib = lambda b: f"{b / 2**30:.2f} GiB"
        print(f"  device memory       peak {gib(r['peak_allocated_bytes'])} allocated, {gib(r['peak_reserved_bytes'])} "
              f"reserved; the planner's floor {gib(r['floor_bytes'])}")
    if "resident_median_step_s" in r:
        print(f"  resident step       {ms(r['resident_median_step_s'])}  ratio {r['ratio_to_resident']:.3f}")
    if "measured_activation_bytes" in r:
        print(f"  activations         {r['measured_activation_bytes'] / GiB:.2f} GiB measured, "
              f"{r['planned_activation_bytes'] / GiB:.2f} GiB planned")
    print(f"  output_sha256       {r['output_sha256']}")
    if "resident_output_sha256" in r:
        same = "identical" if r["resident_output_sha256"] == r["output_sha256"] else "DIFFERENT"
        print(f"  resident sha256     {r['resident_output_sha256']} ({same})")


def matrix_list(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or set(names) - set(BIG_KEYS):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(BIG_KEYS)}, comma separated")
    return ",".join(names)


def gguf_out(text):
    if not text.endswith(".gguf"):
        raise argparse.ArgumentTypeError(f"{text}: name it .gguf")
    return text


def _lora(a):
    out = random_weights.write_lora(a.out, a.layers, a.rank, a.matrices.split(","), a.seed)
    print(f"wrote {out} (rank {a.rank} on {a.matrices} of {a.layers} layers)")


def _fp8(a):
    print(f"wrote {write_scaled_fp8(a.src, a.out, a.mixed)} (its layers' matrices scaled fp8, "
          f"{'ComfyUI mixed-precision' if a.mixed else 'legacy scaled_fp8'} layout)")


def _int8(a):
    rotated = f", ConvRot in groups of {a.convrot}" if a.convrot else ""
    print(f"wrote {write_int8(a.src, a.out, a.convrot)} (its layers' matrices int8 "
          f"with a scale per row{rotated})")


def _gguf(a):
    if importlib.util.find_spec("gguf") is None:
        sys.exit("error: writing a GGUF needs the gguf package: python3 -m pip install gguf")
    print(f"wrote {write_gguf(a.src, a.out, a.quant, a.prefix)} (its layers' matrices {a.quant})")


def main(argv=None):
    ap = _Parser(prog="python -m tools")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="random-weights|random-lora|gguf-weights|fp8-weights|int8-weights|bench|ratio")
    r = sub.add_parser("random-weights", help="write a full-size random checkpoint (ComfyUI layout)")
    r.add_argument("out", type=checkpoint_out,
                   help="the .safetensors file to write (its folder is created if missing)")
    r.add_argument("--layers", type=count(1, 64), default=30, help="main transformer layers (default 30)")
    r.add_argument("--dtype", default="bf16", choices=list(STORAGE_DTYPES))
    r.add_argument("--seed", type=count(0, 2**64 - 1), default=0)
    r.add_argument("--device", type=device, default="cpu", help="where to draw the random numbers (cuda is faster)")
    r.add_argument("--plain", action="store_true",
                   help="N(0, 0.02) for every matrix, as earlier versions drew (default: realistic scales)")
    r.set_defaults(fn=_random)
    lo = sub.add_parser("random-lora", help="a random LoRA in the layout ComfyUI's stock LoRA loaders read")
    lo.add_argument("out", type=checkpoint_out, help="the .safetensors file to write")
    lo.add_argument("--layers", type=count(1, 64), default=30, help="main layers it patches (default 30)")
    lo.add_argument("--rank", type=count(1, 1024), default=16)
    lo.add_argument("--matrices", default=",".join(BIG_KEYS), type=matrix_list,
                    help=f"which of each layer's matrices, comma separated (default all: {','.join(BIG_KEYS)})")
    lo.add_argument("--seed", type=count(0, 2**63 - 1), default=3)
    lo.set_defaults(fn=_lora)
    q = sub.add_parser("gguf-weights", help="a transformer file written as a GGUF, its layers quantized")
    q.add_argument("src", type=weights_file, help="a Z-Image transformer (.safetensors, or a folder as the loader takes)")
    q.add_argument("out", type=gguf_out, help="the .gguf file to write")
    q.add_argument("--quant", default="Q8_0", choices=QUANTS,
                   help="the GGML type of the layers' matrices (default Q8_0; K-quants as random valid blocks: "
                        "the gguf package quantizes none; Q4_K_M: Q4_K with each w2 in Q6_K)")
    q.add_argument("--prefix", action="store_true", help="keys behind model.diffusion_model., as ComfyUI saves them")
    q.set_defaults(fn=_gguf)
    f8 = sub.add_parser("fp8-weights", help="a transformer file written as scaled fp8, as ComfyUI makes them")
    f8.add_argument("src", type=weights_file, help="a Z-Image transformer (.safetensors, or a folder as the loader takes)")
    f8.add_argument("out", type=checkpoint_out, help="the .safetensors file to write")
    f8.add_argument("--mixed", action="store_true",
                    help="ComfyUI's mixed-precision quant layout (.weight_scale, .comfy_quant) instead of scaled_fp8")
    f8.set_defaults(fn=_fp8)
    i8 = sub.add_parser("int8-weights", help="a transformer file written as ComfyUI's int8_tensorwise format")
    i8.add_argument("src", type=weights_file, help="a Z-Image transformer (.safetensors, or a folder as the loader takes)")
    i8.add_argument("out", type=checkpoint_out, help="the .safetensors file to write")
    i8.add_argument("--convrot", type=rotation, default=0,
                    help="rotate each row's groups of N inputs before quantizing (ConvRot; N a power of 4, "
                         "e.g. 256; default: not rotated)")
    i8.set_defaults(fn=_int8)
    c = sub.add_parser("ratio", help="compressed bytes of each streamed layer over its bf16 bytes")
    c.add_argument("--weights", type=weights_file, required=True, help="a Z-Image transformer .safetensors file")
    c.add_argument("--layers", type=count(1, 64), help="only the first N layers (the encode is slow on a CPU)")
    c.add_argument("--device", type=device, default="cpu", help="where to encode (cuda is faster)")
    c.set_defaults(fn=lambda a: ratio.report(a.weights, a.layers, a.device))
    b = sub.add_parser("bench", help="median step time against its bound")
    b.add_argument("--weights", type=weights_file, required=True,
                   help="a Z-Image transformer .safetensors file (e.g. from random-weights)")
    size_arguments(b)
    b.add_argument("--steps", type=count(1, 200), default=8, help="timed steps (default 8)")
    b.add_argument("--seed", type=count(0, 2**64 - 1), default=0)
    b.add_argument("--resident-layers", type=layer_list,
                   help="force the split; a comma list (e.g. 30,18,0) runs several in one process")
    b.add_argument("--simulate-card-gib", type=gib(lo_exclusive=True),
                   help="hold the rest of the GPU in another process so only this much stays free")
    b.add_argument("--resident", action="store_true", help="also run everything resident, same process")
    b.add_argument("--batch", type=count(1, 64), default=1, help="images made at once (default 1)")
    b.add_argument("--prompt-tokens", type=count(1, 512), default=64,
                   help="tokens of the (random) prompt (default 64; the planner assumes 512)")
    b.add_argument("--device", type=device, help="cpu or cuda[:N] (default: cuda where there is one)")
    b.add_argument("--compression", choices=("off", "on", "auto", "both"),
                   help="store the streamed layers' masters compressed: auto where the planner finds it "
                        "faster; both: off, then on, in this process (default: ZIMAGE_COMPRESSION, as the "
                        "nodes read it: auto where it is unset)")
    b.add_argument("--json", action="store_true", help="print each result as one JSON object per line")
    b.set_defaults(fn=_bench)
    d = sub.add_parser("dequant", help="milliseconds to dequantize a matrix of each GGML type the loader reads")
    d.add_argument("--device", type=device, help="cpu or cuda[:N] (default: cuda where there is one)")
    d.add_argument("--rows", type=count(1), default=10240, help="default 10240 (a feed-forward matrix)")
    d.add_argument("--cols", type=whole_blocks, default=3840, help="a multiple of 256 (default 3840)")
    d.set_defaults(fn=_dequant)
    run(ap, argv)


if __name__ == "__main__":
    main()

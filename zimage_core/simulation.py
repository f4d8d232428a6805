"""The step a split gives, simulated: layers computed in order, each streamed one after its upload,
uploads in order on one copy stream into the slots their previous users have finished with. The
planner picks its splits and which streamed layers to pin by it."""
from __future__ import annotations

import functools

from .config import ZImageConfig
from .layout import kept_as_blocks, residency_order, streamed_in_order

# attention and the elementwise steps run below the matmul rate: on an H200 a resident 1024x1024
# layer takes 1.09x its FLOPs at that rate with the fused kernels (``attention_input``,
# ``elementwise``: 2.83 ms) and 1.36x with torch's ops in their place (3.53 ms)
LAYER_OVER_MATMUL = {True: 1.1, False: 1.36}


def compute_copy_ratio(cfg: ZImageConfig, tokens: int, matmul_flops_per_s: float, upload_s: float,
                       fused: bool = True) -> float:
    """One layer's compute time over one layer's upload time, from a measured matmul rate and upload;
    ``fused``: the fused kernels run on that device."""
    n = tokens
    layer_flops = 2 * n * cfg.big_layer_params() + 4 * n * n * cfg.dim
    return layer_flops / matmul_flops_per_s * LAYER_OVER_MATMUL[fused] / upload_s


def block_costs(cfg: ZImageConfig, width, height, batch=1, cap_tokens=512) -> list:
    """Each streamable block's compute relative to a main layer's, in the order they run: a
    context refiner sees the caption's tokens, a noise refiner the image's, a main layer both."""
    img, cap = cfg.image_tokens(width, height), cap_tokens
    r = cfg.n_refiner_layers
    return [cap / (img + cap)] * r + [img / (img + cap)] * r + [1.0] * cfg.n_layers


def simulate_step(n_layers, resident, slots, compute, copy, fixed=0.0, steps=8, decode=0.0) -> float:
    """Mean time of one of ``steps`` consecutive steps with ``resident`` layers resident (spread
    as the streamer spreads them). ``compute`` is one layer's compute time, or a list of each
    layer's; ``copy`` one streamed layer's upload time, or a list of each streamed layer's in the
    order they run. Each step computes ``fixed`` (embedders, final layer, sampler: no streamed weights),
    then the layers in order, a streamed one only once its upload is done. Uploads run in order on
    one copy stream, each into the slot its previous user has finished with; the first step's
    start with it, and every step queues the next one's first uploads behind its last layers.
    ``decode``: a streamed layer's decode on the device (a compressed master), or a list of each
    one's, counted as compute beside the layer (it takes the same SMs)."""
    # plans repeat on every image with free bytes that differ by a few MiB, which change the split
    # rarely: the simulations are remembered by their (discrete) arguments
    return _simulate(n_layers, resident, slots, _key(compute), _key(copy), fixed, steps, _key(decode))


def _key(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


@functools.lru_cache(maxsize=4096)
def _simulate(n_layers, resident, slots, compute, copy, fixed, steps, decode) -> float:
    costs = compute if isinstance(compute, (list, tuple)) else [compute] * n_layers
    keep = set(residency_order(n_layers)[:resident])
    streamed = n_layers - len(keep)
    if not streamed:
        return fixed + sum(costs)
    copies = copy if isinstance(copy, (list, tuple)) else [copy] * streamed
    decodes = decode if isinstance(decode, (list, tuple)) else [decode] * streamed
    k = max(min(slots, streamed), 1)
    free, ready, copy_end = [0.0] * k, {}, 0.0

    def upload(pos):
        nonlocal copy_end
        copy_end = max(copy_end, free[pos % k]) + copies[pos % streamed]
        ready[pos] = copy_end

    for pos in range(k):
        upload(pos)
    t = 0.0
    for f in range(steps):
        t += fixed
        j = 0
        for i in range(n_layers):
            if i in keep:
                t += costs[i]
                continue
            pos = f * streamed + j
            t = max(t, ready[pos]) + costs[i] + decodes[pos % streamed]
            free[pos % k] = t
            if j + k < streamed or f + 1 < steps:
                upload(pos + k)
            j += 1
    return t / steps


def pinned_needed(n_layers, resident, slots, costs, fixed, file_copy: float, master_copy: float = 1.0,
                  decode: float = 0.0, coded_file: bool = False, blocks: int = 0) -> int:
    """The fewest streamed layers that need pinned masters for a step to take no longer (within 1%)
    than with every one pinned, the others read from the page cache at ``file_copy`` times a
    plain pinned upload (a master's upload takes ``master_copy`` of that, and ``decode`` on the
    device, where it is compressed; ``coded_file`` and ``blocks``: see ``step_with_pinned``). The
    pinned ones are the first to run (``planner``)."""
    crossing = n_layers - resident - blocks
    step = lambda pinned: step_with_pinned(n_layers, resident, slots, costs, fixed, pinned, file_copy, master_copy,
                                           decode, coded_file, blocks)
    best = step(crossing)
    return next((pinned for pinned in range(crossing) if step(pinned) <= best * 1.01), crossing)


def step_with_pinned(n_layers, resident, slots, costs, fixed, pinned, file_copy, master_copy=1.0, decode=0.0,
                     coded_file=False, blocks=0):
    """``simulate_step`` with the first ``pinned`` streamed layers uploaded from masters (each
    ``master_copy`` of a plain upload, and ``decode`` on the device) and the rest read plain from
    the page cache at ``file_copy``; ``coded_file``: the file stores them as the masters do (a
    GGUF's blocks), so the rest move ``master_copy`` of a layer from it and are decoded too.
    ``blocks``: the next layers of ``residency_order`` after the resident ones keep their blocks on
    the device (``planner``): nothing crosses for them, each is decoded into its slot as it comes;
    ``pinned`` counts the others."""
    on_device = kept_as_blocks(n_layers, resident, blocks)
    from_file, file_decode = (file_copy * master_copy, decode) if coded_file else (file_copy, 0.0)
    copies, decodes, host = [], [], 0
    for i in streamed_in_order(n_layers, resident):
        if i in on_device:
            copies.append(0.0)
            decodes.append(decode)
            continue
        copies.append(master_copy if host < pinned else from_file)
        decodes.append(decode if host < pinned else file_decode)
        host += 1
    return simulate_step(n_layers, resident, slots, costs, copies, fixed, decode=decodes)


def chain_step(steps_of: list, fixed: float = 0.0, handoff: float = 0.0) -> float:
    """The step of consecutive ranges of layers, each run by a device of its own with its own copy
    engine and slots (``placement``): the ranges compute one after the other, the activations
    crossing ``handoff`` at each change of device (and back to the first for the final layer),
    while every device's copy engine works through the step. ``steps_of[d](idle)`` is range d's
    simulated step (``step_with_pinned``) when its copy engine has ``idle`` in each step besides
    its own layers' time: the step's ``fixed`` part, the handoffs and the other ranges. Each
    range's time depends on the others' through that idle time: found by iterating to the fixed
    point, halfway each round (the plain iteration swings between too little idle and too much)."""
    crossings = handoff * len(steps_of) if len(steps_of) > 1 else 0.0
    own = [step(fixed) - fixed for step in steps_of]  # each range with only the fixed part to hide behind
    for _ in range(32):
        total = fixed + crossings + sum(own)
        new = [step(total - t) - (total - t) for step, t in zip(steps_of, own)]
        if max(abs(a - b) for a, b in zip(own, new)) < 1e-6:
            break
        own = [(a + b) / 2 for a, b in zip(own, new)]
    return fixed + crossings + sum(own)

"""How many layers stay on the GPU for a given free memory and image size, and which of the others
are pinned in host memory: the one owner of both policies.

Device memory = fixed part (embedders, norms, adaLN, final layer) + resident layers + slots +
activations + a margin (``device_margin``), where the layers are every block with big matrices:
the refiners and the main layers. Slots cost as much as resident layers, so their number is chosen
by simulating a run of steps (``simulation``): uploads can only run ahead of compute by as many
layers as there are slots, and a few more slots let the copy engine work through the stretches
without streamed layers (resident layers, the embedders and the sampler between steps) instead of
idling. Without a compute/copy estimate two slots are used (classic double buffering).

Host memory is planned beside it: a plan names the streamed layers that get pinned masters
(``Plan.pinned``: the first to run, as far as the host room given in its ``Limits`` holds them and
they buy time), and the rest are read from the file (the page cache, or the disk) at every upload.
A plan is a value: the limits it was made under are among its inputs, and nothing edits it after.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from . import compression, host_memory
from .config import ZImageConfig
from .device_memory import CODEC_BYTES, GiB, HOST_RESERVE, activation_bytes, device_margin
from .image_size import ImageSize
from .layout import PackLayout, kept_as_blocks, staging_bytes, streamed_in_order
from .plans import TEXT_TOKENS, Limits, Plan
from .ram import cache_headroom
from .simulation import block_costs, pinned_needed, simulate_step, step_with_pinned

# Qwen3-4B's 36 decoder layers in bf16 (per layer: q 4096x2560, k and v 1024x2560, o 2560x4096,
# gate and up 9728x2560, down 2560x9728, two norms): what the text encoder streams at each prompt
TEXT_ENCODER_LAYERS_BYTES = 36 * 2 * (2560 * (4096 + 1024 + 1024) + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128)


@dataclass
class HostRoom:
    available: int   # RAM available
    headroom: int    # what ComfyUI's RAM cache keeps free
    working: int     # what a run needs beside the weights
    fixed: int       # the transformer's fixed part and its staging ring
    layers: int      # what is left for the streamed layers' masters (the rest keeps files cached)

    def as_dict(self):
        return asdict(self)

    def for_masters(self, cap: int | None) -> int:
        """What the masters may take under ``cap`` (ZIMAGE_PINNED_GIB: every copy the pack holds, the
        fixed part and the staging first); the RAM beyond it stays to the page cache."""
        return self.layers if cap is None else min(self.layers, max(0, cap - self.fixed))


def host_room(cfg: ZImageConfig, available: int, storage=torch.bfloat16, dtype=torch.bfloat16,
              total: int | None = None) -> HostRoom:
    """The host side of a plan for ``available`` bytes of RAM on a machine of ``total`` (default:
    the same): what stays free, what the fixed part and the staging take, what the layers get."""
    headroom = cache_headroom(available if total is None else total)
    fixed = cfg.fixed_params() * dtype.itemsize + staging_bytes(PackLayout(cfg, storage))
    layers = max(0, available - headroom - host_memory.WORKING_MARGIN - fixed)
    return HostRoom(available, headroom, host_memory.WORKING_MARGIN, fixed, layers)


def _host_sets(n: int, resident: int, masters: int, pinned: int, blocks: int = 0) -> dict:
    """The ``masters`` and ``pinned`` sets of a plan: the first streamed layers to run that do not
    keep their blocks on the device (masters are made at a layer's first upload, in the order the
    layers run)."""
    on_device = kept_as_blocks(n, resident, blocks)
    order = [i for i in streamed_in_order(n, resident) if i not in on_device]
    return dict(block_layers=blocks, masters=frozenset(order[:masters]), pinned=frozenset(order[:pinned]))


def _pinned_count(streamed: int, host_room: int | None, layer_bytes: int) -> int:
    """Streamed layers whose masters ``host_room`` holds (None: all of them)."""
    return streamed if host_room is None else min(streamed, max(0, host_room) // layer_bytes)


def within(p: Plan, limits: Limits) -> Plan:
    """``p`` with the resident layers ``limits`` set or cap (the rest stream through at least two
    slots, pinned as far as the host room allows)."""
    resident = limits.resident
    if resident is None and limits.max_resident is not None and p.fits and p.resident_layers > limits.max_resident:
        resident = limits.max_resident
    if resident is None:
        return p
    n = p.resident_layers + p.streamed_layers
    r = max(0, min(resident, n))
    streamed = n - r
    slots = 0 if not streamed else max(p.slots, 2)
    device = p.fixed_bytes + p.activation_bytes + (r + slots) * p.layer_bytes if not p.on_cpu else p.device_bytes
    return replace(p, resident_layers=r, streamed_layers=streamed, slots=slots, device_bytes=device, step_s=None,
                   **_host_sets(n, r, streamed, _pinned_count(streamed, limits.host_room, p.master_bytes)))


def _largest_fitting(width, height, batch, fits) -> tuple | None:
    """(width, height) of the largest size of this shape for which ``fits(width, height)``."""
    best = ImageSize(width, height, batch).largest_fitting(lambda s: fits(s.width, s.height))
    return None if best is None else (best.width, best.height)


def plan_host(cfg: ZImageConfig, free_bytes: int, width: int, height: int, batch: int = 1,
              limits: Limits = Limits(), dtype=torch.float32, chunk_rows=None, chunk_queries=None,
              compress: str = "off", text_tokens: int = TEXT_TOKENS) -> Plan:
    """A forward computed on the CPU: the layers are in host memory already, so what must fit in
    the RAM that is available is the activations (and what the rest of the machine keeps).
    ``compress``: "on" keeps bf16 masters compressed (the reference decode; no bus to save on)."""
    free_bytes -= limits.leave_free

    def need(w, h):
        return activation_bytes(cfg, w, h, batch, text_tokens, dtype=dtype, storage=dtype, chunk_rows=chunk_rows,
                                chunk_queries=chunk_queries) + HOST_RESERVE

    act = need(width, height) - HOST_RESERVE
    fits = need(width, height) <= free_bytes
    n = cfg.n_blocks
    packed = PackLayout(cfg, dtype)
    layer = packed.nbytes
    p = Plan(width, height, batch, free_bytes, n if fits else 0, 0 if fits else n, 0,
             layer, cfg.fixed_params() * dtype.itemsize, act, 0, fits, on_cpu=True,
             needed_bytes=act + HOST_RESERVE,
             master_bytes=compression.bound(packed.numel) if compress == "on" and dtype == torch.bfloat16 else layer,
             largest_fitting=None if fits else _largest_fitting(width, height, batch,
                                                                lambda w, h: need(w, h) <= free_bytes),
             text_tokens=text_tokens, **_host_sets(n, n if fits else 0, 0 if fits else n, 0 if fits else n))
    return within(p, limits)


def room_for_another(resident: int, slots: int, blocks: int = 0) -> tuple | None:
    """The split (resident, slots, layers keeping their blocks on the device) after giving one more
    piece of device memory to another model, while this one does not run: its slots first (they
    hold nothing that must be uploaded again, and the next plan makes them anew), then the kept
    blocks and the resident layers one layer at a time; None when none is left."""
    if slots:
        return resident, 0, blocks
    if blocks:
        return resident, 0, blocks - 1
    return (resident - 1, 0, 0) if resident else None


def one_layer_less(resident: int, slots: int, blocks: int = 0) -> tuple | None:
    """The split after giving back one layer's worth of device memory (to another model, or after an
    out-of-memory error), or None when nothing is left to give: a layer's kept blocks first, then
    resident layers. The first layer to stream needs slots: enough resident layers go to pay for
    two."""
    if blocks:
        return resident, slots, blocks - 1
    if resident == 0:
        return None
    if slots == 0:
        r = max(0, resident - 3)
        return r, 2 if resident - r >= 2 else 1, 0
    return resident - 1, slots, 0


def stack_resident(n_layers: int, layer_bytes: int, free_bytes: int, cap: int | None = None) -> int:
    """Layers of another model's stack (the text encoder) kept on the device: all of them where the
    device has room for the whole stack and a GiB of work besides (the next prompt uploads nothing),
    else none. Not some resident and the rest streamed: every prompt would cross the bus as much,
    with fewer uploads hidden behind the compute."""
    fits = free_bytes >= n_layers * layer_bytes + GiB + device_margin(GiB)
    return min(n_layers if fits else 0, n_layers if cap is None else cap)


def plan(cfg: ZImageConfig, free_bytes: int, width: int, height: int, batch: int = 1,
         limits: Limits = Limits(), storage=torch.bfloat16, dtype=torch.bfloat16,
         compute_copy_ratio: float | None = None, file_copy: float | None = None, compress: str = "off",
         decode: float = 0.0, text_tokens: int = TEXT_TOKENS, stored: int | None = None,
         upload_s: float | None = None) -> Plan:
    """The split for ``free_bytes`` of device memory under ``limits``. With ``file_copy`` (a layer's
    upload from the page cache through the staging ring, over one from a pinned master) only the
    streamed layers whose masters buy time are pinned: pinned memory is RAM that nothing else can
    use, while the page cache gives way when the machine needs it. ``compress`` ("off", "on" or
    "auto"): bf16 masters stored compressed (``compression``), fewer bytes in host memory and over
    the bus for a little device memory and ``decode`` (a layer's decode on the device, in plain
    uploads of a layer, counted as compute beside each streamed layer: ``compute_copy_ratio`` is in
    the same unit). "on" compresses wherever the decode's two device buffers fit beside the rest;
    "auto" where that also makes the simulated step at least 2% shorter: where the copies hide
    behind the compute anyway, the decode only adds to it (``Plan.compressed``). ``stored``: a
    layer's bytes as its file stores them, where its masters keep them so and uploads dequantize
    them on the device (a GGUF's blocks; ``decode``: that dequantization); then nothing is
    compressed. ``upload_s``: a layer's plain upload in seconds, the unit of the simulated step
    (``Plan.step_s``; a split ``limits`` force is not simulated)."""
    args = (cfg, free_bytes - limits.leave_free, width, height, batch, storage, dtype, compute_copy_ratio,
            limits.host_room, file_copy, text_tokens, upload_s)
    if stored is not None:
        return within(split_for(*args, stored=stored, decode=decode)[0], limits)
    return within(_with_compression(args, compress, decode, storage), limits)


def _with_compression(args, compress, decode, storage) -> Plan:
    """``split_for`` plain or compressed, as ``compress`` asks (``plan``)."""
    if compress == "off" or storage != torch.bfloat16:
        return split_for(*args)[0]
    packed, packed_step = split_for(*args, compress=True, decode=decode)
    if compress == "on" and packed.fits:
        return packed
    plain, plain_step = split_for(*args)
    # "on" where the decode's two buffers do not fit beside the rest, or nothing measured to choose by
    if compress == "on" or packed_step is None or plain_step is None:
        return plain
    return packed if packed.fits and packed_step < 0.98 * plain_step else plain


def split_for(cfg, free_bytes, width, height, batch, storage, dtype, compute_copy_ratio, host_room, file_copy,
              text_tokens, upload_s, compress=False, decode=0.0, stored=None, blocks: range | None = None,
              idle: float = 0.0) -> tuple:
    """(``plan``'s split with or without compressed masters, its simulated step in plain uploads
    of a layer, or None where the compute/copy ratio is not known). ``blocks``: plan only these
    blocks (one device's range of a ``placement``; the plan counts them from 0), whose copy engine
    also has ``idle`` (in plain uploads of a layer) in each step while the other devices compute."""
    packed = PackLayout(cfg, storage)
    layer = packed.nbytes
    master = compression.bound(packed.numel) if compress else (stored or layer)  # host bytes, before an encode
    # a master's upload, in plain uploads: what it is expected to move. At a 7.5 GiB card's balance
    # of compute and bus the bound's 3% more chose 14 resident layers and 2 slots (107.1 ms a step)
    # over 13 and 3 (106.0 ms)
    master_copy = (compression.expected(packed.numel) if compress else (stored or layer)) / layer
    codec = CODEC_BYTES if compress or stored else 0  # the decode's device buffers
    decode = decode if compress or stored else 0.0
    fixed = cfg.fixed_params() * dtype.itemsize
    act = activation_bytes(cfg, width, height, batch, text_tokens, dtype=dtype, storage=storage)
    room = free_bytes - fixed - act - device_margin(act, batch) - codec
    blocks = range(cfg.n_blocks) if blocks is None else blocks
    n = len(blocks)
    if compute_copy_ratio is not None:
        costs = [c * compute_copy_ratio for c in block_costs(cfg, width, height, batch, text_tokens)][
            blocks.start:blocks.stop]
        before = 0.25 * compute_copy_ratio + idle  # embedders, final layer and sampler, in layers' worth
    if room >= n * layer:
        r, k = n, 0
    else:
        m = room // layer  # layers' worth of memory for resident layers + slots
        options = [(r, mm - r) for mm in [m] for r in range(0, mm - 1)] or [(0, 1)]
        if compute_copy_ratio is None:
            r, k = max(m - 2, 0), min(2, max(m, 1))
        else:
            r, k = min(options, key=lambda o: (round(simulate_step(n, o[0], o[1], costs, master_copy, before,
                                                                   decode=decode), 3), -o[0]))
        k = min(k, n - r)
    fits = room >= layer or (room >= 0 and n == 0)
    streamed = n - r
    needed = streamed
    if fits and streamed and compute_copy_ratio is not None and file_copy is not None:
        needed = pinned_needed(n, r, k, costs, before, file_copy, master_copy, decode, stored is not None)

    def need(w, h):  # the least a size needs: everything streamed through one slot
        a = activation_bytes(cfg, w, h, batch, text_tokens, dtype=dtype, storage=storage)
        return fixed + a + device_margin(a, batch) + (layer + codec if n else 0)

    if not fits:
        r, streamed = 0, n
        needed = n
    pinned = min(needed, _pinned_count(streamed, host_room, master))
    blocks = 0
    if stored and fits and streamed:
        def step_of(r, k, b):  # every layer that crosses pinned, as far as the host room holds them
            if compute_copy_ratio is None:
                return None
            return step_with_pinned(n, r, k, costs, before, _pinned_count(n - r - b, host_room, master),
                                    file_copy or 1.0, master_copy, decode, True, b)
        r, k, blocks = _blocks_split(n, room, layer, stored, r, k, step_of)
        if blocks:
            streamed = n - r
            needed = streamed - blocks
            if compute_copy_ratio is not None and file_copy is not None:
                needed = pinned_needed(n, r, k, costs, before, file_copy, master_copy, decode, True, blocks)
            pinned = min(needed, _pinned_count(streamed - blocks, host_room, master))
    step = None
    if fits and compute_copy_ratio is not None:
        step = step_with_pinned(n, r, k, costs, before, pinned, file_copy or 1.0, master_copy, decode,
                                stored is not None, blocks)
    return Plan(width, height, batch, free_bytes, r, streamed, k if fits else 0,
                layer, fixed, act, fixed + act + (r + k) * layer + blocks * master if fits else 0, fits,
                needed_bytes=need(width, height),
                largest_fitting=None if fits else _largest_fitting(width, height, batch,
                                                                   lambda w, h: need(w, h) <= free_bytes),
                master_bytes=master, staging_bytes=staging_bytes(packed), text_tokens=text_tokens,
                quantized=stored is not None, step_s=step * upload_s if step is not None and upload_s else None,
                **_host_sets(n, r, needed, pinned, blocks)), step


def _blocks_split(n, room, layer, stored, r, k, step_of) -> tuple:
    """(resident, slots, layers keeping their blocks on the device) for a quantized stream that does
    not fit whole as dequantized layers, ``(r, k)`` its split without kept blocks. A layer's
    blocks take ``stored`` bytes on the device (0.53 of a bf16 layer at Q8_0, 0.31 at Q4_K_M) and
    spare the bus and the host as much as a resident layer does, but are dequantized into a slot
    as they come. The candidates: every layer's blocks on the device beside two slots, the room
    left making layers resident; and ``r' <= r`` resident layers with ``k`` slots, blocks filling
    the rest. Of those, the shortest simulated step (``step_of(r, k, blocks)``), and within 1% of
    it the one that moves fewest layers across the bus; where the device was not measured
    (``step_of`` gives None), the one that moves fewest."""
    candidates = [(rr, k, min(n - rr, max(0, room - (rr + k) * layer) // stored)) for rr in range(r + 1)]
    slots = min(2, n)
    if room - slots * layer >= n * stored:
        resident = min(n - 1, (room - slots * layer - n * stored) // (layer - stored))
        candidates.append((resident, slots, n - resident))
    crossing = lambda c: (n - c[0] - c[2], -c[0])
    steps = [step_of(*c) for c in candidates]
    if None not in steps:
        best = min(steps)
        candidates = [c for c, t in zip(candidates, steps) if t <= 1.01 * best]
    return min(candidates, key=crossing)

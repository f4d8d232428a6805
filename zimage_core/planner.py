"""How many main layers stay on the GPU for a given free memory and image size.

Host memory is planned beside it: the streamed layers' masters are pinned while the host budget
(``host_memory.BUDGET``: the RAM that is available, less what ComfyUI's RAM cache keeps free) has
room, and the rest are read from the file (the page cache, or the disk) at every upload.

Device memory = fixed part (embedders, norms, adaLN, final layer) + resident layers + slots +
activations + a margin (``device_margin``), where the layers are every block with big matrices:
the refiners and the main layers. Slots cost as much as resident layers, so their number is chosen
by simulating a run of steps: uploads can only run ahead of compute by as many layers as there are
slots, and a few more slots let the copy engine work through the stretches without streamed
layers (resident layers, the embedders and the sampler between steps) instead of idling. Without a
compute/copy estimate two slots are used (classic double buffering).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from . import compression, host_memory
from .config import ZImageConfig
from .streamer import PackLayout, residency_order, staging_bytes

MiB = 1 << 20
GiB = 1 << 30
RESERVE = 160 * MiB  # cuBLAS workspaces and the allocator's rounding, whatever the image
# compressed uploads: the device buffers of ``compression.GROUP_BYTES``, and what the encode's
# temporaries (a chunk's, at a layer's first upload) leave split among the allocator's blocks (on an
# H200 a compressed run held about 0.2 GiB more reserved beyond its tensors than a plain one)
CODEC_BYTES = compression.BUFFERS * compression.GROUP_BYTES + 192 * MiB
HOST_RESERVE = GiB   # what a forward on the CPU leaves to the rest of the machine


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


def host_room(cfg: ZImageConfig, available: int, storage=torch.bfloat16, dtype=torch.bfloat16,
              total: int | None = None) -> HostRoom:
    """The host side of a plan for ``available`` bytes of RAM on a machine of ``total`` (default:
    the same): what stays free, what the fixed part and the staging take, what the layers get."""
    headroom = host_memory.cache_headroom(available if total is None else total)
    fixed = cfg.fixed_params() * dtype.itemsize + staging_bytes(PackLayout(cfg, storage))
    layers = max(0, available - headroom - host_memory.WORKING_MARGIN - fixed)
    return HostRoom(available, headroom, host_memory.WORKING_MARGIN, fixed, layers)


TEXT_TOKENS = 512  # the longest prompt Z-Image was trained on, in tokens: what a plan assumes at least


def text_tokens_to_plan(n: int) -> int:
    """The prompt tokens a plan is made for: 512, or a longer prompt's length rounded up to a
    multiple of 512 (prompts of about the same length share a plan instead of re-planning)."""
    return max(TEXT_TOKENS, -(-int(n) // TEXT_TOKENS) * TEXT_TOKENS)


@dataclass
class Plan:
    width: int
    height: int
    batch: int
    free_bytes: int
    resident_layers: int
    streamed_layers: int
    slots: int
    layer_bytes: int               # on the device
    fixed_bytes: int
    activation_bytes: int
    device_bytes: int
    pinned_host_bytes: int         # the streamed layers' pinned masters
    fits: bool
    on_cpu: bool = False           # computed on the CPU: every layer in host memory, RAM is the limit
    needed_bytes: int = 0          # the least this size needs (with every layer streamed, on a GPU)
    largest_fitting: tuple | None = None  # (width, height) of the same shape that fits, when this does not
    pinned_layers: int = 0         # streamed layers with a pinned master
    file_layers: int = 0           # streamed layers read from the file (page cache) at every upload
    ram_short: int = 0             # of those, layers a master would make faster, for which the RAM has no room
    master_bytes: int = 0          # host bytes of one pinned master (less than layer_bytes where compressed)
    text_tokens: int = TEXT_TOKENS  # the prompt's tokens it was planned for (``text_tokens_to_plan``)

    @property
    def compressed(self) -> bool:
        """Streamed layers get compressed masters (``compression``)."""
        return self.master_bytes < self.layer_bytes

    def as_dict(self):
        return asdict(self)

    def summary(self) -> str:
        n = self.resident_layers + self.streamed_layers
        size = f"{self.width}x{self.height}{'' if self.batch == 1 else f', batch {self.batch}'}"
        if self.text_tokens > TEXT_TOKENS:
            size += f", a prompt of up to {self.text_tokens} tokens"
        memory = "RAM" if self.on_cpu else "GPU memory"
        if not self.fits:
            if self.largest_fitting:
                w, h = self.largest_fitting
                hint = f"Try {w}x{h}{' or a smaller batch' if self.batch > 1 else ''} or free {memory}"
            else:
                hint = f"Free {memory}: not even the smallest image fits"
            return (f"Z-Image: {size} does not fit: it needs at least {_gib(self.needed_bytes)} of {memory}, "
                    f"this {'machine' if self.on_cpu else 'card'} has {_gib(self.free_bytes)} free. {hint}.")
        if self.on_cpu:
            return f"Z-Image: on the CPU, all {n} layers in host memory ({size})"
        return f"Z-Image: {self.resident_layers} of {n} layers on the GPU, {self.streamed_layers} streamed{self.sources()} ({size})"

    def force(self, resident: int, host_room: int | None):
        """Keep ``resident`` layers on the device (clamped to the stack), whatever the plan chose;
        the others stream through at least two slots, pinned as far as ``host_room`` allows."""
        n = self.resident_layers + self.streamed_layers
        self.resident_layers = max(0, min(resident, n))
        self.streamed_layers = n - self.resident_layers
        self.slots = 0 if not self.streamed_layers else max(self.slots, 2)
        self.pinned_layers = _pinned_layers(self.streamed_layers, host_room, self.master_bytes)
        self.file_layers = self.ram_short = self.streamed_layers - self.pinned_layers
        self.pinned_host_bytes = self.pinned_layers * self.master_bytes

    def sources(self) -> str:
        """How the streamed layers come, when not all plain from pinned memory: " (compressed, 16
        pinned, 5 from the page cache)"."""
        if self.on_cpu or not self.streamed_layers:
            return ""
        parts = (["compressed"] if self.compressed else []) + (
            [f"{self.pinned_layers} pinned, {self.file_layers} from the page cache"] if self.file_layers else [])
        return f" ({', '.join(parts)})" if parts else ""


def _pinned_layers(streamed: int, host_room: int | None, layer_bytes: int) -> int:
    """Streamed layers whose masters ``host_room`` holds (None: all of them)."""
    return streamed if host_room is None else min(streamed, max(0, host_room) // layer_bytes)


def device_free_bytes(device) -> int:
    """What this process could allocate on a CUDA ``device`` now: the device's free memory plus
    what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _gib(b):
    return f"{b / GiB:.2f} GiB"


def activation_bytes(cfg: ZImageConfig, width, height, batch=1, cap_tokens=512,
                     dtype=torch.bfloat16, storage=torch.bfloat16, chunk_rows=None, chunk_queries=None) -> int:
    """Peak activation memory of one forward, per token of the joint sequence: seven
    model-wide tensors (residual, normed and modulated input, q, k, v and their contiguous
    copies for the attention kernel) and three FFN-wide ones (w1 and w3 outputs, their
    product), plus the fp32 rotary tables; an upcast copy of the largest weight for narrow
    storage comes on top. Measured on an H200: 118 KB per token, as this formula gives.
    Run in pieces (``chunk_rows`` / ``chunk_queries``, see ``model.Chunks``), the FFN-wide
    tensors exist for one piece at a time; the model-wide ones are counted twelve times (the
    projection's pieces beside their concatenation), plus one attention piece's scores in fp32."""
    tokens = cfg.image_tokens(width, height) + cap_tokens + (-cap_tokens) % cfg.pad_multiple
    e = dtype.itemsize
    rope = cfg.head_dim * 2 * 4 * 2
    upcast = cfg.ffn_dim * cfg.dim * e if storage.itemsize < e else 0
    if chunk_rows is None:
        per_token = (7 * cfg.dim + 3 * cfg.ffn_dim) * e + rope
        return batch * tokens * per_token + upcast + 64 * MiB
    pieces = min(chunk_rows, tokens) * 3 * cfg.ffn_dim * e + min(chunk_queries, tokens) * tokens * cfg.n_heads * 4
    return batch * (tokens * (12 * cfg.dim * e + rope) + pieces) + upcast + 64 * MiB


def device_margin(activations: int, batch: int = 1) -> int:
    """Device memory a forward needs beyond its tensors: ``RESERVE``, and what torch's caching
    allocator holds reserved but unallocated at the peak, where blocks freed by activations of one
    size are split for those of another. Measured on an H200 with every layer streamed through one
    slot: 150-260 MiB beyond the tensors at 768x768 to 1536x1536, about 0.5 GiB more at batch 4."""
    return RESERVE + activations // 5 + (batch - 1) * 96 * MiB


def _largest_fitting(width, height, fits) -> tuple | None:
    """The largest (width, height) of the same shape, sides multiples of 16, for which ``fits``."""
    lo, hi, best = 1, max(width, height) // 16, None
    while lo <= hi:  # bisect on the longer side, in steps of 16
        k = (lo + hi) // 2
        w, h = _scaled(width, height, 16 * k / max(width, height))
        if fits(w, h):
            best, lo = (w, h), k + 1
        else:
            hi = k - 1
    return best


def _scaled(width, height, s):
    return max(16, round(width * s / 16) * 16), max(16, round(height * s / 16) * 16)


def plan_host(cfg: ZImageConfig, free_bytes: int, width: int, height: int, batch: int = 1,
              dtype=torch.float32, chunk_rows=None, chunk_queries=None, compress: str = "off",
              text_tokens: int = TEXT_TOKENS) -> Plan:
    """A forward computed on the CPU: the layers are in host memory already, so what must fit in
    the RAM that is available is the activations (and what the rest of the machine keeps).
    ``compress``: "on" keeps bf16 masters compressed (the reference decode; no bus to save on)."""
    def need(w, h):
        return activation_bytes(cfg, w, h, batch, text_tokens, dtype=dtype, storage=dtype, chunk_rows=chunk_rows,
                                chunk_queries=chunk_queries) + HOST_RESERVE

    act = need(width, height) - HOST_RESERVE
    fits = need(width, height) <= free_bytes
    n = cfg.n_blocks
    packed = PackLayout(cfg, dtype)
    layer = packed.nbytes
    return Plan(width, height, batch, free_bytes, n if fits else 0, 0 if fits else n, 0,
                layer, cfg.fixed_params() * dtype.itemsize, act, 0, 0, fits, on_cpu=True,
                needed_bytes=act + HOST_RESERVE,
                master_bytes=compression.bound(packed.numel) if compress == "on" and dtype == torch.bfloat16 else layer,
                largest_fitting=None if fits else _largest_fitting(width, height, lambda w, h: need(w, h) <= free_bytes),
                text_tokens=text_tokens)


def room_for_another(resident: int, slots: int) -> tuple | None:
    """The split after giving one more piece of device memory to another model, while this one does
    not run: its slots first (they hold nothing that must be uploaded again, and the next plan
    makes them anew), then its resident layers one at a time; None when none is left."""
    if slots:
        return resident, 0
    return (resident - 1, 0) if resident else None


def one_layer_less(resident: int, slots: int) -> tuple | None:
    """The split after giving back one layer's worth of device memory (to another model, or after an
    out-of-memory error), or None when nothing is left to give. The first layer to stream needs
    slots: enough resident layers go to pay for two."""
    if resident == 0:
        return None
    if slots == 0:
        r = max(0, resident - 3)
        return r, 2 if resident - r >= 2 else 1
    return resident - 1, slots


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


def stack_resident(n_layers: int, layer_bytes: int, free_bytes: int, cap: int | None = None) -> int:
    """Layers of another model's stack (the text encoder) kept on the device: all of them where the
    device has room for the whole stack and a GiB of work besides (the next prompt uploads nothing),
    else none. Not some resident and the rest streamed: every prompt would cross the bus as much,
    with fewer uploads hidden behind the compute."""
    fits = free_bytes >= n_layers * layer_bytes + GiB + device_margin(GiB)
    return min(n_layers if fits else 0, n_layers if cap is None else cap)


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


def block_costs(cfg: ZImageConfig, width, height, batch=1, cap_tokens=512) -> list:
    """Each streamable block's compute relative to a main layer's, in the order they run: a
    context refiner sees the caption's tokens, a noise refiner the image's, a main layer both."""
    img, cap = cfg.image_tokens(width, height), cap_tokens
    r = cfg.n_refiner_layers
    return [cap / (img + cap)] * r + [img / (img + cap)] * r + [1.0] * cfg.n_layers


def pinned_needed(n_layers, resident, slots, costs, fixed, file_copy: float, master_copy: float = 1.0,
                  decode: float = 0.0) -> int:
    """The fewest streamed layers that need pinned masters for a step to take no longer (within 1%)
    than with every one pinned, the others read from the page cache at ``file_copy`` times a
    plain pinned upload (a master's upload takes ``master_copy`` of that, and ``decode`` on the
    device, where it is compressed). Masters are made at first upload, so the pinned ones are the
    first to run."""
    streamed = n_layers - resident
    best = simulate_step(n_layers, resident, slots, costs, master_copy, fixed, decode=decode)
    for pinned in range(streamed):
        if _step_with_pinned(n_layers, resident, slots, costs, fixed, pinned, file_copy, master_copy,
                            decode) <= best * 1.01:
            return pinned
    return streamed


def _step_with_pinned(n_layers, resident, slots, costs, fixed, pinned, file_copy, master_copy=1.0, decode=0.0):
    """``simulate_step`` with the first ``pinned`` streamed layers uploaded from masters (each
    ``master_copy`` of a plain upload, and ``decode`` on the device) and the rest read plain from
    the page cache at ``file_copy``."""
    rest = n_layers - resident - pinned
    return simulate_step(n_layers, resident, slots, costs, [master_copy] * pinned + [file_copy] * rest, fixed,
                         decode=[decode] * pinned + [0.0] * rest)


def plan(cfg: ZImageConfig, free_bytes: int, width: int, height: int, batch: int = 1,
         storage=torch.bfloat16, dtype=torch.bfloat16, compute_copy_ratio: float | None = None,
         host_room: int | None = None, file_copy: float | None = None, compress: str = "off",
         decode: float = 0.0, text_tokens: int = TEXT_TOKENS) -> Plan:
    """The split for ``free_bytes`` of device memory; ``host_room``: host bytes the streamed layers'
    masters may take (None: as many as they need). With ``file_copy`` (a layer's upload from the
    page cache through the staging ring, over one from a pinned master) only the streamed layers
    whose masters buy time are pinned: pinned memory is RAM that nothing else can use, while the
    page cache gives way when the machine needs it. ``compress`` ("off", "on" or "auto"): bf16
    masters stored compressed (``compression``), fewer bytes in host memory and over the bus for
    a little device memory and ``decode`` (a layer's decode on the device, in plain uploads of a
    layer, counted as compute beside each streamed layer: ``compute_copy_ratio`` is in the same
    unit). "on" compresses wherever the decode's two device buffers fit beside the rest; "auto"
    where that also makes the simulated step at least 2% shorter: where the copies hide behind the
    compute anyway, the decode only adds to it (``Plan.compressed``)."""
    args = (cfg, free_bytes, width, height, batch, storage, dtype, compute_copy_ratio, host_room, file_copy,
            text_tokens)
    if compress == "off" or storage != torch.bfloat16:
        return _plan(*args)[0]
    packed, packed_step = _plan(*args, compress=True, decode=decode)
    if compress == "on" and packed.fits:
        return packed
    plain, plain_step = _plan(*args)
    # "on" where the decode's two buffers do not fit beside the rest, or nothing measured to choose by
    if compress == "on" or packed_step is None or plain_step is None:
        return plain
    return packed if packed.fits and packed_step < 0.98 * plain_step else plain


def _plan(cfg, free_bytes, width, height, batch, storage, dtype, compute_copy_ratio, host_room, file_copy,
          text_tokens, compress=False, decode=0.0) -> tuple:
    """(``plan``'s split with or without compressed masters, its simulated step in plain uploads
    of a layer, or None where the compute/copy ratio is not known)."""
    packed = PackLayout(cfg, storage)
    layer = packed.nbytes
    master = compression.bound(packed.numel) if compress else layer  # host bytes, before it is encoded
    # a master's upload, in plain uploads: what it is expected to move. At a 7.5 GiB card's balance
    # of compute and bus the bound's 3% more chose 14 resident layers and 2 slots (107.1 ms a step)
    # over 13 and 3 (106.0 ms)
    master_copy = (compression.expected(packed.numel) if compress else layer) / layer
    decode = decode if compress else 0.0
    fixed = cfg.fixed_params() * dtype.itemsize
    act = activation_bytes(cfg, width, height, batch, text_tokens, dtype=dtype, storage=storage)
    room = free_bytes - fixed - act - device_margin(act, batch) - (CODEC_BYTES if compress else 0)
    n = cfg.n_blocks
    if compute_copy_ratio is not None:
        costs = [c * compute_copy_ratio for c in block_costs(cfg, width, height, batch, text_tokens)]
        before = 0.25 * compute_copy_ratio  # embedders, final layer and sampler, in layers' worth
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
        needed = pinned_needed(n, r, k, costs, before, file_copy, master_copy, decode)

    def need(w, h):  # the least a size needs: everything streamed through one slot
        a = activation_bytes(cfg, w, h, batch, text_tokens, dtype=dtype, storage=storage)
        return fixed + a + device_margin(a, batch) + (layer + (CODEC_BYTES if compress else 0) if n else 0)

    if not fits:
        streamed = needed = n
    pinned = min(needed, _pinned_layers(streamed, host_room, master))
    step = None
    if fits and compute_copy_ratio is not None:
        step = _step_with_pinned(n, r, k, costs, before, pinned, file_copy or 1.0, master_copy, decode)
    return Plan(width, height, batch, free_bytes, r if fits else 0, streamed, k if fits else 0,
                layer, fixed, act, fixed + act + (r + k) * layer if fits else 0, pinned * master, fits,
                needed_bytes=need(width, height),
                largest_fitting=None if fits else _largest_fitting(width, height, lambda w, h: need(w, h) <= free_bytes),
                pinned_layers=pinned, file_layers=streamed - pinned, ram_short=needed - pinned,
                master_bytes=master, text_tokens=text_tokens), step

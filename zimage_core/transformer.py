"""A loaded Z-Image transformer: the DiT, its layer streamer and the current plan.

``ZImageTransformer.load(path, device)`` reads any supported checkpoint's header and its fixed
part (0.26 GiB; the layers stay in the file until a forward needs them: loading pins and packs
nothing), places the fixed part on the device, and is then called exactly like ComfyUI's
``NextDiT``. ``prepare(width, height)`` picks the split for the free memory
(promoting layers when memory came back, evicting when it went), and an out-of-memory error
during a forward evicts one more layer and runs the forward again.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass

import torch

from . import attention_input, compression, elementwise, planner
from .checkpoint import Checkpoint
from .config import BIG_KEYS, ZImageConfig
from .errors import CheckpointError, NonFiniteWeights, OutOfDeviceMemory, ZImageError
from . import host_memory
from .host_memory import HostPool, available_ram, locks_files
from .device_copies import DeviceCopies, module_tensors
from .device_timing import device_seconds
from .dit import Chunks, ZImageDiT
from .streamer import LayerStreamer, PackLayout, all_finite, staging_bytes

log = logging.getLogger("zimage")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STORAGE_DTYPES = dict(COMPUTE_DTYPES, fp8_e4m3fn=torch.float8_e4m3fn)
# On the CPU a block runs in pieces of about this much work, so that an interrupt (checked between
# pieces) stops a 2048x2048 step within a second or so even on two cores
CPU_PIECE_FLOPS = 2e10


def layer_pieces(ckpt: Checkpoint, prefix: str) -> dict:
    """A block's five big matrices in ``ckpt``: {name: [(row, StoredTensor)]}, as a streamer reads them."""
    return {n: ckpt.pieces(f"{prefix}{k}.weight") for n, k in BIG_KEYS.items()}


def fixed_tensor(ckpt: Checkpoint, key: str, dtype: torch.dtype, mapped: bool) -> torch.Tensor:
    """A fixed-part tensor in ``dtype``: with ``mapped`` a read-only view of the file's pages where
    the file stores it so, else read into a tensor of its own."""
    t = ckpt.mapped(key, dtype) if mapped else None
    return ckpt.tensor(key, dtype=dtype) if t is None else t


@dataclass(frozen=True)
class Settings:
    """What a loaded transformer is told once, at load (the loader node's inputs), and reads when it
    plans: nothing is set on it afterwards."""
    max_resident: int | None = None   # the most layers kept on the device (None: as many as fit)
    leave_free: int = 0               # bytes of device memory the plan leaves to others
    pinned_cap: int | None = None     # host bytes this model may hold, beside the process-wide budget
    # bf16 masters stored compressed, fewer bytes in RAM and over the bus: "off", "on", or "auto"
    # (where the planner finds that it shortens the step: ``planner.plan``)
    compress: str = "off"


def check_kernels_soon(device, total_bytes: int, compress: bool = True):
    """Start the once-per-device checks of the Triton kernels a model of ``total_bytes`` will run on
    ``device``, each on a thread of its own: the attention inputs' and the norms' on every GPU
    (``attention_input.runs_on.soon``, ``elementwise.runs_on.soon``), the decode's where the model will stream (it does not fit in
    what is free) and may store its layers compressed (``compression.decodes_on.soon``). The first
    forward asks them, and their compiles take a second: started when the prompt's encode starts
    (ComfyUI loads the transformer after it), they run beside the encode."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    attention_input.runs_on.soon(device)
    elementwise.runs_on.soon(device)
    if compress and total_bytes > planner.device_free_bytes(device):
        compression.decodes_on.soon(device)


class ZImageTransformer(torch.nn.Module):
    def __init__(self, model: ZImageDiT, streamer: LayerStreamer, ckpt: Checkpoint, fixed: DeviceCopies,
                 settings: Settings, check_interrupt=None):
        """``check_interrupt()`` raises to stop a forward; it runs between blocks (and, on the CPU,
        between pieces of a block)."""
        super().__init__()
        self.model, self.streamer, self.ckpt, self.fixed = model, streamer, ckpt, fixed
        self.cfg: ZImageConfig = model.cfg
        self.dtype = model.dtype
        self.device = streamer.device
        self.plan: planner.Plan | None = None
        self.settings = settings
        self._status_to = None                # callback(str) for the one-line status, within status_to()
        self._last_status = None
        self._warned = None                   # (file layers, streamed layers) last warned about
        self._said_uncompressed = False       # ZIMAGE_COMPRESSION=on left unused here: said once
        self.patches_uuid = None              # id of the weight-patch set (LoRA) now in the weights
        self.patched_keys: set = set()        # canonical keys that set changed (prefixed as patched)
        self._ratio = {}                      # tokens -> (compute/copy ratio, page-cache/pinned upload, upload seconds)
        self._layer_decode_s = None           # a compressed layer's decode on this device, once measured
        self._fixed_checked = False           # the fixed part's values were checked where they run
        self.check_interrupt = check_interrupt or (lambda: None)
        model.runner = streamer
        self.fixed_bytes = fixed.loaded_bytes
        self.ckpt_keys = ckpt.keys()
        self.block_index = {name: i for i, name in enumerate(self.cfg.block_names())}

    @classmethod
    def load(cls, path, device="cuda", dtype="bf16", weight_dtype=None, settings: Settings = Settings(),
             initial_device=None, check_interrupt=None):
        """``device`` computes; the fixed part starts on ``initial_device`` (default: ``device``),
        e.g. the CPU for a model that ComfyUI moves to the GPU when it is used."""
        if dtype not in COMPUTE_DTYPES:
            raise ZImageError(f"compute dtype {dtype!r} is not supported; use one of {', '.join(COMPUTE_DTYPES)}.")
        if weight_dtype not in (None, "default", *STORAGE_DTYPES):
            raise ZImageError(f"weight dtype {weight_dtype!r} is not supported; use one of "
                              f"default, {', '.join(STORAGE_DTYPES)}.")
        compute = COMPUTE_DTYPES[dtype]
        log.info("Z-Image: loading the transformer from %s", path)
        ckpt = Checkpoint(path)
        pool = None
        try:
            if weight_dtype in (None, "default"):
                storage = ckpt.storage_dtype if ckpt.storage_dtype == torch.float8_e4m3fn else compute
            else:
                storage = STORAGE_DTYPES[weight_dtype]
            cfg = ckpt.config
            with torch.device("meta"):
                model = ZImageDiT(cfg, compute)
            dev = torch.device(device)
            home = torch.device(initial_device) if initial_device is not None else dev
            # on a GPU the fixed part's master is the file's own pages, locked in place (``DeviceCopies``):
            # no copy of it in host memory
            mapped = dev.type == "cuda" and locks_files()
            state = {name: fixed_tensor(ckpt, name, compute, mapped) for name, _ in model.named_parameters()}
            model.load_state_dict(state, assign=True)
            model.requires_grad_(False)  # inference only: no autograd graph keeps activations alive
            layout = PackLayout(cfg, storage)
            pool = HostPool("transformer", pin=dev.type == "cuda", cap_bytes=settings.pinned_cap)
            streamer = LayerStreamer(layout, [layer_pieces(ckpt, f"{name}.") for name in cfg.block_names()],
                                     dev, pool, check_finite=True, compress=settings.compress != "off")
            # the never-streamed tensors (embedders, norms, adaLN, final layer): placed on the device
            # while it computes, from one host master per dtype
            fixed = DeviceCopies(module_tensors(model), dev, pool)
            t = cls(model, streamer, ckpt, fixed, settings, check_interrupt)
            check_kernels_soon(dev, t.total_bytes, streamer.can_compress)
            if home == dev:
                t.to_device()
            return t
        except torch.OutOfMemoryError:
            if pool is not None:
                pool.release_all()
            ckpt.close()
            raise OutOfDeviceMemory(f"{ckpt.path}: the fixed part of the transformer (embedders, "
                                    "norms) does not fit on the GPU. Free GPU memory (close other programs) "
                                    "and try again.") from None
        except BaseException:
            if pool is not None:
                pool.release_all()
            ckpt.close()
            raise

    # -- memory ------------------------------------------------------------------------------

    @property
    def storage_dtype(self):
        return self.streamer.layout.dtype

    @property
    def on_device(self) -> bool:
        return self.fixed.placed

    @property
    def total_bytes(self) -> int:
        """Everything this model would hold on the device with every layer resident."""
        return self.fixed_bytes + self.cfg.n_blocks * self.streamer.layout.nbytes

    def device_bytes(self) -> int:
        """What this model holds on the device now."""
        return (self.fixed_bytes if self.on_device else 0) + self.streamer.device_bytes

    def to_device(self):
        """Bring the fixed part (embedders, norms, adaLN, final layer) to the compute device: one
        upload from its pinned host master."""
        if not self.on_device:
            self.fixed.place()

    def offload(self, device="cpu"):
        """Free every byte this model holds on the device. Nothing is copied back: the fixed part
        has a host master, and a layer comes back from its master or the file."""
        self.streamer.configure(0, 0)
        if self.on_device and self.device.type != "cpu":
            self.fixed.unload()
            torch.cuda.empty_cache()

    def free_bytes(self) -> int:
        """Device memory this model could use: what is free plus its own layers and slots. On the CPU:
        the RAM that is available (the layers are in it already)."""
        if self.device.type == "cpu":
            avail = available_ram()
            return 1 << 62 if avail is None else avail
        if self.device.type != "cuda":  # a device whose free memory torch does not report
            return 1 << 62
        return planner.device_free_bytes(self.device) + self.device_bytes()

    def chunks(self, width, height, batch=1) -> Chunks | None:
        """On the CPU, blocks run in pieces of about ``CPU_PIECE_FLOPS`` (rows for the projections and
        the FFN, queries for the attention) with an interrupt check between them; on a GPU, whole."""
        if self.device.type != "cpu":
            return None
        cfg = self.cfg
        tokens = batch * (cfg.image_tokens(width, height) + 512)
        rows = int(CPU_PIECE_FLOPS / (2 * batch * cfg.dim * max(3 * cfg.dim, cfg.ffn_dim)))
        queries = int(CPU_PIECE_FLOPS / (4 * batch * tokens * cfg.dim))
        return Chunks(max(32, rows // 32 * 32), max(16, queries // 16 * 16), self.check_interrupt)

    def make_plan(self, width, height, batch=1, free_bytes=None, text_tokens=planner.TEXT_TOKENS) -> planner.Plan:
        free = (self.free_bytes() if free_bytes is None else free_bytes) - self.settings.leave_free
        mode = self.settings.compress if self.streamer.can_compress else "off"
        if self.device.type == "cpu":
            c = self.chunks(width, height, batch)
            # max_resident_layers holds on the CPU too: the others stream from their host masters
            return self._capped(planner.plan_host(self.cfg, free, width, height, batch, dtype=self.dtype,
                                                  chunk_rows=c.rows, chunk_queries=c.queries, compress=mode,
                                                  text_tokens=text_tokens))
        sizes = dict(storage=self.storage_dtype, dtype=self.dtype, text_tokens=text_tokens)
        if mode != "on":  # a card that holds every layer: nothing to measure, nothing to compress
            whole = planner.plan(self.cfg, free, width, height, batch, host_room=self.host_room(), **sizes)
            if whole.fits and not whole.streamed_layers:
                return self._capped(whole)
        tokens = self.cfg.image_tokens(width, height) * batch
        if tokens not in self._ratio and self.device.type == "cuda":
            self._ratio[tokens] = self._measure_with_room(tokens)
        ratio, file_copy, upload_s = self._ratio.get(tokens, (None, None, None))
        split = functools.partial(planner.plan, self.cfg, free, width, height, batch, compute_copy_ratio=ratio,
                                  host_room=self.host_room(), file_copy=file_copy, **sizes)
        if mode == "auto" and ratio is not None and not split(compress="auto", decode=0.0).compressed:
            mode = "off"  # not even a decode that took no time would shorten a step: no check to wait for
        if mode != "off" and not (self.device.type == "cuda" and compression.decodes_on(self.device)):
            mode = "off"  # it says why, once
        return self._capped(split(compress=mode, decode=self._decode_ratio(upload_s) if mode != "off" else 0.0))

    def _capped(self, p: planner.Plan) -> planner.Plan:
        """``p`` under the user's cap on resident layers."""
        cap = self.settings.max_resident
        if cap is not None and p.fits and p.resident_layers > cap:
            p.force(cap, self.host_room())
        return p

    def host_room(self) -> int | None:
        """Host bytes the streamed layers' masters may take: those they hold, and what the budget
        leaves after the staging buffers every upload from the file needs. None on the CPU."""
        s = self.streamer
        if not s.cuda:
            return None
        return s.master_layers * s.master_bytes + max(0, s.pool.room() - s.staging_due())

    def prepare(self, width, height, batch=1, resident_layers=None, free_bytes=None,
                text_tokens=planner.TEXT_TOKENS) -> planner.Plan:
        """Set the split for an image of this size and a prompt of up to ``text_tokens`` tokens:
        planned, or forced to ``resident_layers``."""
        p = self.make_plan(width, height, batch, free_bytes, text_tokens)
        if resident_layers is not None:
            p.force(resident_layers, self.host_room())
        elif not p.fits:
            raise OutOfDeviceMemory(p.summary())
        self.plan = p
        start, before = time.perf_counter(), self.streamer.n_resident
        self._set_split(p.resident_layers, p.slots, p.file_layers - p.ram_short, p.compressed)
        # the free memory it was planned with: a plan that changes from one image to the next says why
        log.debug("Z-Image: split set in %.2f s (%d -> %d resident, %.3f GiB free)", time.perf_counter() - start,
                  before, self.streamer.n_resident, p.free_bytes / planner.GiB)
        if self.streamer.cuda:
            # the pinned masters, the staging buffers and the fixed part: what the host budget keeps
            # for this model however the text encoder's pools come first
            host_memory.BUDGET.claim("transformer", self.fixed_bytes + p.pinned_host_bytes
                                     + staging_bytes(self.streamer.layout))
        self._announce()
        self._warn_host(p)
        self._say_if_uncompressed(p)
        return p

    def _say_if_uncompressed(self, p):
        """Once: ZIMAGE_COMPRESSION=on asked for compressed layers and this plan has none (where the
        GPU's decode cannot run, its check has said why already)."""
        if self.settings.compress != "on" or p.compressed or self._said_uncompressed or not p.fits:
            return
        if not self.streamer.can_compress:
            why = (f"its layers are {str(self.streamer.layout.dtype).removeprefix('torch.')} here (compression is "
                   "for bf16 layers; an fp8 file streams as it is, the CPU computes in fp32)")
        elif self.device.type == "cuda" and not compression.decodes_on(self.device):
            return
        else:
            why = "every layer fits on the device: nothing streams"
        self._said_uncompressed = True
        log.info("Z-Image: ZIMAGE_COMPRESSION=on: not used, %s.", why)

    def _warn_host(self, p):
        """Once per plan that reads layers from the file for want of RAM: what would help."""
        key = (p.file_layers, p.streamed_layers)
        if not p.ram_short or key == self._warned:
            return
        self._warned = key
        fp8 = "" if self.storage_dtype == torch.float8_e4m3fn else "the fp8 checkpoint (half the bytes), "
        log.warning("Z-Image: the RAM holds %d of %d streamed layers pinned; %d are read from the file at every "
                    "step (slower; from the disk where the page cache cannot hold them). What would help: %s"
                    "more RAM, or closing other programs. ComfyUI keeps %.1f GiB of RAM free.",
                    p.pinned_layers, p.streamed_layers, p.file_layers, fp8,
                    host_memory.BUDGET.headroom / planner.GiB)

    def _set_split(self, resident, slots, from_file=None, compress=None):
        """The split ``resident`` / ``slots``, or the first below it (``planner.one_layer_less``)
        whose buffers the device can allocate: the one ladder down after an out-of-memory error."""
        while True:
            try:
                self.streamer.configure(resident, slots, from_file, compress)
                break
            except torch.OutOfMemoryError:  # the estimate was optimistic: one layer fewer
                less = planner.one_layer_less(resident, slots)
                if less is None:
                    raise
                resident, slots = less

    def _evict_one(self) -> bool:
        """Give back one layer's worth of device memory; False when nothing is left to evict."""
        less = planner.one_layer_less(self.streamer.n_resident, len(self.streamer.slots))
        if less is None:
            return False
        self._set_split(*less)
        return True

    def _announce(self):
        """The one-line status, once per change of split or image size: to the callback when one is
        set (a node shows it, in the console too), else to the log."""
        n, r = self.cfg.n_blocks, self.streamer.n_resident
        size = ""
        if self.plan:
            size = f" ({self.plan.width}x{self.plan.height}{'' if self.plan.batch == 1 else f', batch {self.plan.batch}'})"
        if self.device.type == "cpu":
            msg = (f"Z-Image: on the CPU, all {n} layers in host memory{size}" if r == n else
                   f"Z-Image: on the CPU, {r} of {n} layers kept, {n - r} streamed from host memory{size}")
        else:
            sources = self.plan.sources() if self.plan and self.plan.resident_layers == r else ""
            msg = f"Z-Image: {r} of {n} layers on the GPU, {n - r} streamed{sources}{size}"
        if msg == self._last_status:
            return
        self._last_status = msg
        (self._status_to or log.info)(msg)

    @contextlib.contextmanager
    def status_to(self, callback):
        """Within: the one-line status goes to ``callback`` (a node shows it, in the console too)
        instead of the log."""
        self._status_to = callback
        try:
            yield
        finally:
            self._status_to = None

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of device memory for another model (``planner.room_for_another``:
        the slots, then resident layers, the last of ``residency_order`` first), then the fixed
        part. Nothing is copied back: a layer comes back from its master or the file. Returns bytes
        freed."""
        start = self.device_bytes()
        while start - self.device_bytes() < nbytes:
            less = planner.room_for_another(self.streamer.n_resident, len(self.streamer.slots))
            if less is None:
                break
            self.streamer.configure(*less)
        if start - self.device_bytes() < nbytes:
            self.offload()
        freed = start - self.device_bytes()
        if freed and self.device.type == "cuda":
            # hand the blocks back to the driver: whoever asked for the room allocates other sizes,
            # which cached layer-sized blocks cannot serve
            torch.cuda.empty_cache()
        if freed and self.streamer.n_resident + len(self.streamer.slots):
            self._announce()
        return freed

    def release(self):
        """Give back the device memory and every pinned host buffer."""
        self.offload()
        self.streamer.release()

    # -- weights by canonical key (LoRA and other weight patches) ------------------------------

    def _big_slot(self, key):
        """(streamer block index, matrix name) for a big matrix's canonical key, else None."""
        parts = key.split(".")
        names = {v: k for k, v in BIG_KEYS.items()}
        block = self.block_index.get(".".join(parts[:2]))
        if len(parts) == 5 and parts[4] == "weight" and ".".join(parts[2:4]) in names and block is not None:
            return block, names[".".join(parts[2:4])]
        return None

    def weight_shapes(self) -> dict:
        """Canonical key -> (shape, dtype) of every weight, streamed matrices included."""
        out = {k: (tuple(v.shape), v.dtype) for k, v in self.model.named_parameters()}
        for key in self.ckpt_keys:
            if key not in out:
                slot = self._big_slot(key)
                out[key] = (self.streamer.layout.shapes[slot[1]], self.storage_dtype)
        return out

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Canonical (ComfyUI) key names. The streamed matrices appear as meta tensors: names and
        shapes for weight-patch key maps, without copying gigabytes; their values live in the
        host masters (``base_weight`` / ``set_weight``)."""
        out = {} if destination is None else destination
        for k, v in self.model.state_dict(keep_vars=keep_vars).items():
            out[prefix + k] = v
        for key, (shape, dtype) in self.weight_shapes().items():
            out.setdefault(prefix + key, torch.empty(shape, dtype=dtype, device="meta"))
        return out

    def base_weight(self, key) -> torch.Tensor:
        """The weight as loaded from the file (storage dtype for streamed matrices, compute dtype
        for the rest), freshly read from the file."""
        slot = self._big_slot(key)
        if slot:
            out = torch.empty(self.streamer.layout.shapes[slot[1]], dtype=self.storage_dtype)
        else:
            out = torch.empty(self.model.get_parameter(key).shape, dtype=self.dtype)
        self.ckpt.read_into(key, out)
        return out

    def set_weight(self, key, value: torch.Tensor):
        """Replace a weight everywhere it lives: host master (packed first if the layer was only
        file-backed), resident device copy, or parameter. Streamed layers pick the new values up
        at their next upload."""
        slot = self._big_slot(key)
        if slot is None:  # a parameter: the fixed part
            module_path, _, name = key.rpartition(".")
            self.fixed.write(self.model.get_submodule(module_path), name, value)
            self._fixed_checked = False
            return
        owner, name = slot
        layout = self.streamer.layout
        self.streamer.synchronize()
        self.streamer.drop_queued()  # a slot may hold the old weights, uploaded ahead
        self.streamer.ensure_host(owner)
        self.streamer.recheck(owner)
        layout.region(self.streamer.host[owner], name).copy_(value)
        if owner in self.streamer.resident:
            layout.region(self.streamer.resident[owner], name).copy_(value)

    def _measure_with_room(self, tokens) -> tuple:
        """``_measure_ratio`` on a card that the current split fills (a larger image or batch comes
        after a smaller one): resident layers make way for its buffers, one at a time. The plan that
        follows promotes them again where they fit (``free_bytes`` counts them as this model's)."""
        while True:
            try:
                return self._measure_ratio(tokens)
            except torch.OutOfMemoryError:
                pass  # out of the handler first: its traceback holds the measurement's tensors
            if not self._evict_one():
                raise OutOfDeviceMemory(f"Out of GPU memory even with every layer streamed, while timing a "
                                        f"step of {tokens} image tokens. Lower the image size or batch, or free "
                                        "GPU memory.")
            torch.cuda.empty_cache()

    def _measure_ratio(self, tokens) -> tuple:
        """Compute time of one layer over upload time of one layer: a matmul and an upload timed on
        this device, the rest is the planner's model. A layer's upload from the file through
        the staging ring over one from a pinned master: a chunk read into the staging buffer (from
        the page cache, or the disk where it is not cached: then more layers are pinned), each
        chunk's read overlapping the previous chunk's upload (None once every layer has a master).
        And a layer's upload in seconds."""
        cfg = self.cfg
        dev = self.device
        x = torch.randn(tokens + 512, cfg.dim, device=dev, dtype=self.dtype)
        w = torch.randn(cfg.ffn_dim, cfg.dim, device=dev, dtype=self.dtype)
        host = self.streamer.staging_buffer()  # what an upload copies from (pinned if the budget has room)
        dst = torch.empty_like(host, device=dev)
        chunks = self.streamer.layout.numel / host.numel()  # a layer is uploaded in this many chunks
        matmul_s = device_seconds(lambda: [torch.nn.functional.linear(x, w) for _ in range(5)]) / 5
        if host.is_pinned():
            upload_s = device_seconds(lambda: dst.copy_(host, non_blocking=True))
        else:  # a pageable copy returns once the device has done it (``device_seconds``)
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            dst.copy_(host)
            upload_s = time.perf_counter() - start
        rate = 2 * x.shape[0] * cfg.dim * cfg.ffn_dim / matmul_s
        fused = attention_input.runs_on(dev) and elementwise.runs_on(dev)
        ratio = planner.compute_copy_ratio(cfg, x.shape[0], rate, chunks * upload_s, fused)
        s = self.streamer
        unpinned = [i for i in reversed(s.order) if s.host[i] is None]  # the last to become resident first
        if not unpinned:
            return ratio, None, chunks * upload_s
        s.layout.fill(host, s.sources[unpinned[0]])  # untimed: the first read may fault the pages in
        start = time.perf_counter()
        s.layout.fill(host, s.sources[unpinned[0]])
        return ratio, max(1.0, (time.perf_counter() - start) / upload_s), chunks * upload_s

    def _decode_ratio(self, layer_upload_s: float) -> float:
        """A compressed layer's decode on this device over a layer's upload; the decode measured
        once, from one chunk of random weights encoded and decoded here."""
        if self._layer_decode_s is None:
            flat = (torch.randn(compression.CHUNK, device=self.device) * 0.02).to(torch.bfloat16)
            chunks, packed = compression.encode_all(flat)
            seconds = compression.decode_seconds(chunks, packed, torch.empty_like(flat))
            self._layer_decode_s = seconds * self.streamer.layout.numel / flat.numel()
        return self._layer_decode_s / layer_upload_s

    # -- running -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x, timesteps, context, num_tokens=None, attention_mask=None, transformer_options={}, **kw):
        self.to_device()
        size = (x.shape[-1] * 8, x.shape[-2] * 8, x.shape[0], planner.text_tokens_to_plan(context.shape[1]))
        if self.plan is None or (self.plan.width, self.plan.height, self.plan.batch, self.plan.text_tokens) != size \
                or (self.streamer.n_streamed and not self.streamer.slots):
            self.prepare(*size[:3], text_tokens=size[3])
        if not self._fixed_checked:
            self._check_fixed()
        chunks = self.chunks(x.shape[-1] * 8, x.shape[-2] * 8, x.shape[0])
        while True:
            try:
                out = self.model(x, timesteps, context, num_tokens, attention_mask, transformer_options,
                                 chunks=chunks, tick=self.check_interrupt, **kw)
                self.streamer.pool.report("transformer")
                return out
            except NonFiniteWeights as e:
                raise CheckpointError(self.ckpt.path, f"has NaN or infinite values in "
                                      f"{self.cfg.block_names()[e.layer]}.{BIG_KEYS[e.name]}.weight.",
                                      "The file is damaged: download it again.") from None
            except torch.OutOfMemoryError:
                if not self._evict_one():
                    raise OutOfDeviceMemory(
                        f"Out of GPU memory at {x.shape[-1] * 8}x{x.shape[-2] * 8} even with every layer "
                        "streamed. Lower the image size or batch, or free GPU memory.") from None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("Z-Image: out of memory during a step; evicted a layer and retrying.")
                self._announce()

    def _check_fixed(self):
        """Every tensor outside the streamed layers is finite, checked once where it runs (on the
        GPU: one reduction each and one read of the results)."""
        tensors = list(self.model.named_parameters())
        names = [name for name, _ in tensors]
        flags = [all_finite(t) for _, t in tensors]
        ok = torch.stack(flags).cpu()
        if not bool(ok.all()):
            bad = names[int((~ok).nonzero()[0])]
            raise CheckpointError(self.ckpt.path, f"has NaN or infinite values in {bad}.",
                                  "The file is damaged: download it again.")
        self._fixed_checked = True


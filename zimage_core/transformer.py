"""A loaded Z-Image transformer: the DiT, its layer stream and the current plan.

``ZImageTransformer.load(path, device)`` reads any supported checkpoint's header and its fixed
part (0.26 GiB; the layers stay in the file until a forward needs them: loading pins and packs
nothing), places the fixed part on the device, and is then called exactly like ComfyUI's
``NextDiT``. The first forward of an image size plans the split for the free memory (promoting
layers when memory came back, evicting when it went), and an out-of-memory error during a forward
evicts one more layer and runs the forward again. Its weights by key (weight patches) are
``weights``; what another model's loading asks of it is ``evict`` and ``restore_split``. Loaded on
a list of devices, its first image cuts the layers across the cards (``placement``) where the
first cannot hold them all; its layers are a ``LayerChain`` either way.
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref

import torch

from . import attention_input, compression, device_memory, elementwise, host_memory, planner, plans, triton_dequant
from .checkpoint import Checkpoint
from .config import BIG_KEYS, ZImageConfig
from .device_copies import DeviceCopies, module_tensors
from .devices import device_free_bytes, device_of
from .dit import ZImageDiT, cpu_chunks, sdpa_attention
from .errors import CheckpointError, NonFiniteWeights, OutOfDeviceMemory, ZImageError
from .host_memory import HostPool, locks_files
from .image_size import ImageSize
from .layer_chain import LayerChain
from .layout import PackLayout, StreamConfig
from .placement import Placement, place
from .ram import available_ram
from .settings import COMPUTE_DTYPES, STORAGE_DTYPES, Settings
from .split_planner import SplitPlanner
from .status import SplitStatus
from .streamer import LayerStreamer
from .weight_checks import FiniteChecks
from .weights import Weights

log = logging.getLogger("zimage")

def layer_pieces(ckpt: Checkpoint, prefix: str) -> dict:
    """A block's five big matrices in ``ckpt``: {name: [(row, StoredTensor)]}, as a stream reads them."""
    return {n: ckpt.pieces(f"{prefix}{k}.weight") for n, k in BIG_KEYS.items()}


def fixed_tensor(ckpt: Checkpoint, key: str, dtype: torch.dtype, mapped: bool) -> torch.Tensor:
    """A fixed-part tensor in ``dtype``: with ``mapped`` a read-only view of the file's pages where
    the file stores it so, else read into a tensor of its own."""
    t = ckpt.mapped(key, dtype) if mapped else None
    return ckpt.tensor(key, dtype=dtype) if t is None else t


def check_kernels_soon(device, total_bytes: int, compress: bool = True, quant_types=(), dtype=torch.bfloat16):
    """Start the once-per-device checks of the Triton kernels a model of ``total_bytes`` will run on
    ``device``, each on a thread of its own: the attention inputs' and the norms' on every GPU
    (``attention_input.runs_on.soon``, ``elementwise.runs_on.soon``), the decode's where the model will stream (it does not fit in
    what is free) and may store its layers compressed (``compression.decodes_on.soon``), the
    dequantization's of a GGUF's ``quant_types`` into ``dtype`` (``triton_dequant.check_soon``). The first
    forward asks them, and their compiles take a second: started when the prompt's encode starts
    (ComfyUI loads the transformer after it), they run beside the encode."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    attention_input.runs_on.soon(device)
    elementwise.runs_on.soon(device)
    if compress and total_bytes > device_free_bytes(device):
        compression.decodes_on.soon(device)
    triton_dequant.check_soon(device, quant_types, dtype)


def check_devices(devices: list) -> tuple:
    """The devices a transformer is loaded on, each with its index; a clear error for a card that is
    not there or named twice, or a mix of kinds."""
    out = tuple(device_of(d) for d in devices)
    if not out:
        raise ZImageError("no device given: name the card the transformer runs on.")
    if len({d.type for d in out}) > 1:
        raise ZImageError(f"devices {', '.join(map(str, out))}: the layers span cards of one kind; give CUDA "
                          "devices only, or the CPU alone.")
    if out[0].type == "cuda":
        count = torch.cuda.device_count()
        for d in out:
            if d.index >= count:
                raise ZImageError(f"{d} is not there: this machine has {count} CUDA device{'' if count == 1 else 's'}"
                                  f"{f' (cuda:0 to cuda:{count - 1})' if count > 1 else ''}. Leave it out of the "
                                  "loader's devices.")
        if len(set(out)) < len(out):
            raise ZImageError(f"devices {', '.join(map(str, out))}: a card is named twice; name each once.")
    return out


# every transformer loaded in this process: one at a time holds host memory (``let_go_of_host``)
_LOADED: "weakref.WeakSet[ZImageTransformer]" = weakref.WeakSet()


def _unload(streamer, pool, ckpt):
    """What a load that failed had made goes: the reads ahead, the pinned buffers, the file."""
    if streamer is not None:
        streamer.masters.stop_reading()
    if pool is not None:
        pool.release_all()
    ckpt.close()


class ZImageTransformer(torch.nn.Module):
    def __init__(self, model: ZImageDiT, streamer: LayerStreamer, ckpt: Checkpoint, fixed: DeviceCopies,
                 settings: Settings, check_interrupt=None, devices: tuple = ()):
        """``check_interrupt()`` raises to stop a forward; it runs between blocks (and, on the CPU,
        between pieces of a block). ``devices``: the cards the layers span (the first is
        ``streamer``'s, where the model runs until its first image cuts the layers across them)."""
        super().__init__()
        self.model, self.ckpt, self.fixed = model, ckpt, fixed
        self.cfg: ZImageConfig = model.cfg
        self.dtype = model.dtype
        self.storage_dtype = streamer.layout.dtype
        self.device = streamer.device
        self.devices = tuple(devices) or (self.device,)
        self.settings = settings
        self.plan: plans.Plan | None = None
        self.placement: Placement | None = None  # where the layers span cards: the last image's
        self.chain = LayerChain([streamer], [range(self.cfg.n_blocks)])
        self.status = SplitStatus(self.cfg, streamer, settings)
        self.planner = SplitPlanner(self.cfg, self.dtype, streamer, settings)
        self.checks = FiniteChecks(self.cfg.n_blocks)
        self.chain.observe(self.checks)
        self.weights = Weights(model, self.chain, ckpt, self.fixed, self.checks)
        self.check_interrupt = check_interrupt or (lambda: None)
        self.fixed_bytes = fixed.loaded_bytes

    @property
    def streamer(self) -> LayerStreamer:
        """The first card's layer stream (of one card: every layer's)."""
        return self.chain.streamers[0]

    @classmethod
    def load(cls, path, device="cuda", dtype="bf16", weight_dtype=None, settings: Settings = Settings(),
             initial_device=None, check_interrupt=None, attention=sdpa_attention):
        """``device`` computes: one device, or a list of cards the layers span (``placement``: the
        first image cuts them across the cards by their free memory; the fixed part on the first);
        the fixed part starts on ``initial_device`` (default: ``device``), e.g. the CPU for a model
        that ComfyUI moves to the GPU when it is used. ``attention``: the attention kernel (``ZImageDiT``)."""
        if dtype not in COMPUTE_DTYPES:
            raise ZImageError(f"compute dtype {dtype!r} is not supported; use one of {', '.join(COMPUTE_DTYPES)}.")
        if weight_dtype not in (None, "default", *STORAGE_DTYPES):
            raise ZImageError(f"weight dtype {weight_dtype!r} is not supported; use one of "
                              f"default, {', '.join(STORAGE_DTYPES)}.")
        compute = COMPUTE_DTYPES[dtype]
        devices = check_devices(device if isinstance(device, (list, tuple)) else [device])
        log.info("Z-Image: loading the transformer from %s", path)
        ckpt = Checkpoint(path)
        pool = streamer = None
        try:
            if weight_dtype in (None, "default"):
                storage = ckpt.storage_dtype if ckpt.storage_dtype == torch.float8_e4m3fn else compute
            else:
                storage = STORAGE_DTYPES[weight_dtype]
            cfg = ckpt.config
            dev = devices[0]
            if len(devices) > 1 and ckpt.streams_blocks:
                raise ZImageError(f"{ckpt.path}: a GGUF file runs on one card; give the loader one device, "
                                  "or load the bf16 or fp8 safetensors file across the cards.")
            home = torch.device(initial_device) if initial_device is not None else dev
            pool = HostPool("transformer", pin=dev.type == "cuda", cap_bytes=settings.pinned_cap)
            # layers that span cards stream plain (``placement`` plans no compressed masters)
            config = StreamConfig(PackLayout(cfg, storage), dev, compress=settings.compress != "off" and len(devices) == 1,
                                  quantized=ckpt.streams_blocks)
            sources = [layer_pieces(ckpt, f"{name}.") for name in cfg.block_names()]
            streamer = LayerStreamer(config, sources, pool)
            with torch.device("meta"):
                model = ZImageDiT(cfg, compute, runner=streamer, attention=attention)
            # on a GPU the fixed part's master is the file's own pages, locked in place (``DeviceCopies``):
            # no copy of it in host memory
            mapped = dev.type == "cuda" and locks_files()
            state = {name: fixed_tensor(ckpt, name, compute, mapped) for name, _ in model.named_parameters()}
            model.load_state_dict(state, assign=True)
            model.requires_grad_(False)  # inference only: no autograd graph keeps activations alive
            # the never-streamed tensors (embedders, norms, adaLN, final layer): placed on the device
            # while it computes, from one host master per dtype
            fixed = DeviceCopies(module_tensors(model), dev, pool)
            t = cls(model, streamer, ckpt, fixed, settings, check_interrupt, devices)
            # the first image's reads begin now, in the order its forward runs the layers (the split
            # it plans sets the order its uploads follow), while ComfyUI loads and runs the text encoder
            streamer.masters.read_ahead(range(streamer.n_layers))
            quant_types = {p.tensor.type_name for src in sources for parts in src.values() for _, p in parts} \
                if config.quantized else ()
            for d in devices:
                check_kernels_soon(d, t.total_bytes, config.can_compress, quant_types, compute)
            if home == dev:
                t.to_device()
            _LOADED.add(t)
            return t
        except torch.OutOfMemoryError:
            _unload(streamer, pool, ckpt)
            raise OutOfDeviceMemory(f"{ckpt.path}: the fixed part of the transformer (embedders, "
                                    "norms) does not fit on the GPU. Free GPU memory (close other programs) "
                                    "and try again.") from None
        except BaseException:
            _unload(streamer, pool, ckpt)
            raise

    # -- memory ------------------------------------------------------------------------------

    @property
    def on_device(self) -> bool:
        return self.fixed.placed

    @property
    def total_bytes(self) -> int:
        """Everything this model would hold on the device with every layer resident."""
        return self.fixed_bytes + self.cfg.n_blocks * self.streamer.layout.nbytes

    @property
    def resident_layers(self) -> int:
        return self.chain.n_resident

    @property
    def file_uploads(self) -> int:
        """Layer uploads so far that read the checkpoint (the page cache or the disk) rather than a
        master: every upload of a layer without one, and each master's making."""
        return self.chain.source_uploads

    @property
    def partly_loaded(self) -> bool:
        """Some of the model is not on the device now (layers stream, or it is offloaded)."""
        return self.chain.n_streamed > 0 or not self.on_device

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this model's pool holds (pinned masters, staging, the fixed part's master)."""
        return self.streamer.pool.used

    def device_bytes(self, device=None) -> int:
        """What this model holds now on ``device`` (default: the first card, where ComfyUI's model
        manager sees it; of one card, everything on the device)."""
        device = self.device if device is None else device_of(device)
        return self.fixed.device_bytes(device) + self.chain.device_bytes(device)

    def activation_bytes(self, size: ImageSize) -> int:
        """The activations a forward of ``size`` needs on the device, by the planner's estimate."""
        return device_memory.activation_bytes(self.cfg, size.width, size.height, size.batch, dtype=self.dtype,
                                        storage=self.storage_dtype)

    def to_device(self):
        """Bring the fixed part (embedders, norms, adaLN, final layer) to the compute device: one
        upload from its pinned host master."""
        if not self.on_device:
            self.fixed.place()

    def offload(self, device="cpu"):
        """Free every byte this model holds on the device. Nothing is copied back: the fixed part
        has a host master, and a layer comes back from its master or the file."""
        for s in self.chain.streamers:
            s.configure(0, 0)
        if self.on_device and self.device.type != "cpu":
            self.fixed.unload()
            torch.cuda.empty_cache()

    def free_bytes(self, device=None) -> int:
        """Memory this model could use on ``device`` (default: the first card): what is free plus its
        own layers and slots there. On the CPU: the RAM that is available (the layers are in it already)."""
        device = self.device if device is None else device_of(device)
        if device.type == "cpu":
            avail = available_ram()
            return 1 << 62 if avail is None else avail
        if device.type != "cuda":  # a device whose free memory torch does not report
            return 1 << 62
        return device_free_bytes(device) + self.device_bytes(device)

    def prepare(self, width, height, batch=1, resident_layers=None, free_bytes=None,
                text_tokens=plans.TEXT_TOKENS) -> plans.Plan:
        """Set the split for an image of this size and a prompt of up to ``text_tokens`` tokens:
        planned, or forced to ``resident_layers``. Another transformer of this process lets go of
        its memory first (``let_go_of_host``)."""
        for other in list(_LOADED):
            if other is not self:
                other.let_go_of_host()
        if len(self.devices) > 1:
            return self._prepare_span(width, height, batch, resident_layers, free_bytes, text_tokens)
        free = self.free_bytes() if free_bytes is None else free_bytes
        # on a card the current split fills, resident layers make way for the device's measurement
        p = self.planner.plan(width, height, batch, free, text_tokens, resident_layers, self._evict_one)
        if resident_layers is None and not p.fits:
            raise OutOfDeviceMemory(p.summary())
        self.plan = p
        start, before = time.perf_counter(), self.streamer.n_resident
        self._set_split(p.resident_layers, p.slots, p.block_layers, p.masters, p.compressed)
        # the free memory it was planned with: a plan that changes from one image to the next says why
        log.debug("Z-Image: split set in %.2f s (%d -> %d resident, %.3f GiB free%s)", time.perf_counter() - start,
                  before, self.streamer.n_resident, p.free_bytes / planner.GiB,
                  "" if p.step_s is None else f"; its simulated step {p.step_s:.4f} s")
        if self.streamer.cuda:
            # what the host budget keeps for this model however the text encoder's pools come first
            host_memory.BUDGET.claim("transformer", p.host_bytes)
        self.status.announce(self.plan)
        self.status.planned(p)
        return p

    def _prepare_span(self, width, height, batch, resident_layers, free_bytes, text_tokens) -> plans.Plan:
        """``prepare`` over several cards (``free_bytes``: a list, one per card): the first image
        cuts the layers across them (``placement``), later ones plan each card's range again."""
        frees = [self.free_bytes(d) for d in self.devices] if free_bytes is None else free_bytes
        # the balance of compute and bus measured on the first card (the cards are of one kind), as
        # one card's plan measures it: it picks the cut, the slots and the layers worth pinning
        ratio, file_copy, upload_s = self.planner.calibration.ratios(self.cfg.image_tokens(width, height) * batch,
                                                                     self._evict_one)
        measured = dict(compute_copy_ratio=ratio, file_copy=file_copy, upload_s=upload_s, text_tokens=text_tokens)
        limits = plans.Limits(max_resident=self.settings.max_resident, resident=resident_layers,
                              leave_free=self.settings.leave_free, host_room=self._span_host_room())
        if self.placement is None and resident_layers is None:
            alone = place(self.cfg, [self.device], frees[:1], width, height, batch, limits, self.storage_dtype,
                          self.dtype, **measured)
            if alone.fits and not alone.streamed_layers:
                # the first card holds every layer: the others stay free (a span would only add handoffs)
                log.info("Z-Image: %s holds every layer; %s left free", self.device,
                         ", ".join(map(str, self.devices[1:])))
                self.devices = self.devices[:1]
                return self.prepare(width, height, batch, free_bytes=None if free_bytes is None else frees[0],
                                    text_tokens=text_tokens)
        p = place(self.cfg, list(self.devices), frees, width, height, batch, limits, self.storage_dtype, self.dtype,
                  ranges=None if self.placement is None else self.placement.ranges, **measured)
        if resident_layers is None and not p.fits:
            raise OutOfDeviceMemory(p.summary())
        if self.placement is None:
            self._cut(p)
        for s, sub in zip(self.chain.streamers, p.plans):
            s.configure(sub.resident_layers, sub.slots, 0, sub.masters, False)
        self.placement, self.plan = p, p.plans[0]
        if self.streamer.cuda:
            host_memory.BUDGET.claim("transformer", sum(sub.host_bytes for sub in p.plans))
        self.status.say(p.summary())
        return self.plan

    def _span_host_room(self) -> int | None:
        """``SplitPlanner.host_room`` over every card's masters."""
        if not self.streamer.cuda:
            return None
        held = sum(s.masters.master_layers * s.masters.master_bytes for s in self.chain.streamers)
        return held + max(0, self.streamer.pool.room() - self.streamer.masters.staging_due())

    def _cut(self, p: Placement):
        """The layers across the cards as ``p`` ranges them, from now on: a streamer of each card's
        range (``LayerChain.recut``), each block's norms and adaLN on the card that runs it. Layers
        ``weights.set`` wrote keep their values (their masters go to the new streamers)."""
        names, old = self.cfg.block_names(), self.streamer
        streamers = [LayerStreamer(StreamConfig(old.layout, d, quantized=old.config.quantized),
                                   [layer_pieces(self.ckpt, f"{names[i]}.") for i in blocks], old.pool)
                     for d, blocks in zip(p.devices, p.ranges)]
        written = {i: old.masters.host[i].clone() for i in self.weights.set_layers}
        card = {}  # a block's modules -> the card that runs it
        blocks = [*self.model.context_refiner, *self.model.noise_refiner, *self.model.layers]
        for d, r in zip(p.devices, p.ranges):
            for i in r:
                card.update({id(m): d for m in blocks[i].modules()})
        self.fixed.spread([card.get(id(m), self.device) for m, _, _ in self.fixed.entries])
        self.chain.recut(streamers, list(p.ranges))
        self.model.runner = self.chain
        for i, values in written.items():
            s, j = self.chain.locate(i)
            s.masters.ensure_plain(j)
            s.masters.host[j].copy_(values)

    def restore_split(self) -> plans.Plan | None:
        """The split of the last image again, with the memory there is now (layers another model
        borrowed come back); None before the first image."""
        p = self.plan
        if p is None:
            return None
        return self.prepare(p.width, p.height, p.batch, text_tokens=p.text_tokens)

    def _set_split(self, resident, slots, blocks=0, masters=None, compress=None):
        """The split ``resident`` / ``slots`` / ``blocks`` (layers keeping their quantized blocks on
        the device), or the first below it (``planner.one_layer_less``) whose buffers the device can
        allocate: the one ladder down after an out-of-memory error."""
        while True:
            try:
                self.streamer.configure(resident, slots, blocks, masters, compress)
                break
            except torch.OutOfMemoryError:  # the estimate was optimistic: one layer fewer
                less = planner.one_layer_less(resident, slots, blocks)
                if less is None:
                    raise
                resident, slots, blocks = less

    def _evict_one(self) -> bool:
        """Give back one layer's worth of device memory (of a span: on every card); False when
        nothing is left to evict."""
        if len(self.chain.streamers) > 1:
            evicted = False
            for s in self.chain.streamers:
                less = planner.one_layer_less(*s.split)
                if less is not None:
                    s.configure(*less)
                    evicted = True
            return evicted
        less = planner.one_layer_less(*self.streamer.split)
        if less is None:
            return False
        self._set_split(*less)
        return True

    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` of device memory for another model (``planner.room_for_another``:
        the slots, then resident layers, the last of ``residency_order`` first), then the fixed
        part. Nothing is copied back: a layer comes back from its master or the file. Returns bytes
        freed."""
        start = self.device_bytes()
        while start - self.device_bytes() < nbytes:
            less = planner.room_for_another(*self.streamer.split)
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
        if freed and self.streamer.n_resident + len(self.streamer.slots) and len(self.chain.streamers) == 1:
            self.status.announce(self.plan)
        return freed

    def let_go_of_host(self):
        """Give back the device memory and every host buffer (the streamed layers' masters, the
        fixed part's, the staging ring) while another transformer runs: a switch between two
        checkpoints would otherwise keep the first one's pinned masters beside the second's, where
        the RAM holds one model's (16-32 GB machines). Nothing is lost: the next forward plans
        again, reads the layers from the file and pins them anew; the fixed part keeps its patched
        values, and the streamed layers' patches are made again by the next load (the bridge's).
        A model without masters (its layers all on the device, or read from the file) keeps what it
        has: little RAM, and ComfyUI moves it off the card when the other needs the room. A model
        whose layers ``weights.set`` wrote keeps them: their values are in its masters only."""
        if not any(s.masters.master_layers for s in self.chain.streamers) or self.weights.set_layers:
            return
        log.info("Z-Image: %s lets go of its memory while another Z-Image model runs", self.ckpt.path)
        self.offload()
        self.fixed.release()
        for s in self.chain.streamers:
            s.masters.release()
        # a patch set's tensors held on the device go too: the next load applies the set anew
        self.weights.patch_layers(None)
        self.weights.patches_uuid = None

    def release(self):
        """Give back the device memory and every pinned host buffer."""
        self.offload()
        for s in self.chain.streamers:
            s.release()

    @contextlib.contextmanager
    def status_to(self, callback):
        """Within: the one-line status goes to ``callback`` (a node shows it, in the console too)
        instead of the log."""
        with self.status.to(callback):
            yield

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Canonical (ComfyUI) key names. The streamed matrices appear as meta tensors: names and
        shapes for weight-patch key maps, without copying gigabytes; their values live in the
        host masters and the file (``weights``)."""
        out = {} if destination is None else destination
        for k, v in self.model.state_dict(keep_vars=keep_vars).items():
            out[prefix + k] = v
        for key, (shape, dtype) in self.weights.shapes().items():
            out.setdefault(prefix + key, torch.empty(shape, dtype=dtype, device="meta"))
        return out

    # -- running -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x, timesteps, context, num_tokens=None, attention_mask=None, transformer_options={}, **kw):
        self.to_device()
        size = ImageSize.of_latent(x.shape)
        tokens = plans.text_tokens_to_plan(context.shape[1])
        if self.plan is None or (self.plan.width, self.plan.height, self.plan.batch, self.plan.text_tokens) != (
                size.width, size.height, size.batch, tokens) or any(s.n_streamed and not s.slots
                                                                    for s in self.chain.streamers):
            self.prepare(size.width, size.height, size.batch, text_tokens=tokens)
        self.weights.check_fixed()
        chunks = cpu_chunks(self.cfg, size.width, size.height, size.batch, self.check_interrupt) \
            if self.device.type == "cpu" else None
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
                        f"Out of GPU memory at {size.width}x{size.height} even with every layer "
                        "streamed. Lower the image size or batch, or free GPU memory.") from None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("Z-Image: out of memory during a step; evicted a layer and retrying.")
                if len(self.chain.streamers) == 1:
                    self.status.announce(self.plan)

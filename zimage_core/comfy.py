"""The one module that talks to ComfyUI's model manager (it imports ``comfy``; in the core only it
and ``comfy_reaches``, the list of what it relies on beyond ComfyUI's public API, do).

A Z-Image ``MODEL`` is a stock ``Lumina2`` base model whose diffusion model is the streamed
``ZImageTransformer``, wrapped in ``ZImagePatcher``: a ``ModelPatcher`` that reports the bytes
the transformer really holds, unloads partially by evicting resident layers (the last to become resident first; nothing
is copied back: a layer comes back from its master or the file) and loads by promoting them. ComfyUI's own
``free_memory`` / ``load_models_gpu`` therefore make room for the text encoder and the VAE the
cheap way, and stock samplers, ``VAEDecode`` and LoRA loaders see an ordinary MODEL.
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref

import torch

import comfy.conds
import comfy.float
import comfy.ldm.modules.attention
import comfy.lora
import comfy.model_base
import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models

from . import planner
from .checkpoint import Checkpoint
from .device_copies import DeviceCopies, module_tensors
from .config import ZImageConfig
from .host_memory import BUDGET, HostPool, available_ram, cache_headroom, environment_cap, total_ram
from .stack_streaming import StreamedStack, UnsupportedStack
from .transformer import COMPUTE_DTYPES, STORAGE_DTYPES, Settings, ZImageTransformer

log = logging.getLogger("zimage")
_DTYPE_NAMES = {v: k for k, v in COMPUTE_DTYPES.items()}
PREFIX = "diffusion_model."


def comfy_attention(q, k, v, heads):
    """ComfyUI's attention kernel, so the pack computes what its native Z-Image computes."""
    return comfy.ldm.modules.attention.optimized_attention(q, k, v, heads, skip_reshape=True)


class ZImageModel(comfy.model_base.Lumina2):
    """ComfyUI's Lumina2 base model over the streamed transformer. Its memory estimate (what the
    samplers ask before loading) is the transformer's activation estimate: ComfyUI's factor-based
    one is several times larger and would make it evict layers for nothing."""

    def memory_required(self, input_shape, cond_shapes={}):
        t = self.diffusion_model
        b, h, w = input_shape[0], input_shape[-2] * 8, input_shape[-1] * 8
        return planner.activation_bytes(t.cfg, w, h, b, dtype=t.dtype, storage=t.storage_dtype)

    def extra_conds(self, **kwargs):
        """ComfyUI's conds, with the prompt's embeddings put on the device once per sampling run.
        ComfyUI would copy them from host memory at every step: a copy from pageable memory that
        makes the host wait for the step before and queues behind the layer uploads on the bus."""
        out = super().extra_conds(**kwargs)
        c, device = out.get("c_crossattn"), kwargs.get("device")
        if c is not None and device is not None:
            out["c_crossattn"] = comfy.conds.CONDRegular(c.cond.to(device))
        return out


class ZImagePatcher(comfy.model_patcher.ModelPatcher):
    """ModelPatcher over a streamed Z-Image transformer. Clones (made by stock nodes such as
    ModelSamplingAuraFlow or LoRA loaders) share the transformer through ``self.model``."""

    @property
    def zimage(self) -> ZImageTransformer:
        return self.model.diffusion_model

    def model_size(self):
        return self.zimage.total_bytes

    def loaded_size(self):
        return self.zimage.device_bytes()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        """Fixed part to the GPU, this patcher's weight patches in place, then as many layers as a
        plan for the last image's size allows (ComfyUI has already freed what it could for us; the
        plan reads the real free memory). ComfyUI does not tell a loading model the coming size:
        the first forward plans for it, and plans again if it differs from the last."""
        t = self.zimage
        t.to_device()
        self._apply_patches()
        if t.plan is not None:
            t.prepare(t.plan.width, t.plan.height, t.plan.batch)
        self._sync()

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        """Every sampling run re-plans (promoting layers when memory came back) and brings this
        clone's object and weight patches in."""
        before = self.loaded_size()
        self.unpatch_model(self.offload_device, unpatch_weights=False)
        self.patch_model(device_to, lowvram_model_memory=0, load_weights=True)
        return max(0, self.loaded_size() - before)

    def _apply_patches(self):
        """Weight patches (LoRA and the like) are computed once per patch set, from the file's
        weights, exactly as ComfyUI's ModelPatcher computes them (compute dtype of the device,
        stochastic rounding seeded by the key), and written into the host masters, so streamed
        layers carry them too. Keys patched by a previous set and not by this one are restored."""
        t = self.zimage
        if t.patches_uuid == self.patches_uuid:
            return
        wanted = {k for k in self.patches if k.startswith(PREFIX)}
        for key in sorted(wanted | t.patched_keys):
            base = t.base_weight(key[len(PREFIX):])
            if key in wanted:
                temp = base.to(device=t.device, dtype=mm.lora_compute_dtype(t.device), copy=True)
                out = comfy.lora.calculate_weight(self.patches[key], temp, key)
                base = comfy.float.stochastic_rounding(out, base.dtype, seed=comfy.model_patcher.string_to_seed(key))
            t.set_weight(key[len(PREFIX):], base)
        t.patched_keys, t.patches_uuid = wanted, self.patches_uuid
        if wanted:
            log.info("Z-Image: %d weights patched", len(wanted))

    def model_mmap_residency(self, free=False):
        """(ComfyUI v0.20) The host copies are pinned buffers, not file mappings to bounce."""
        return 0, 0

    def pinned_memory_size(self):
        return self.zimage.streamer.pool.used

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.zimage.evict(memory_to_free)
        self._sync()
        log.info("Z-Image: made room for another model: %.2f GiB freed (%d layers stay on the GPU)",
                 freed / planner.GiB, self.zimage.streamer.n_resident)
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        super().unpatch_model(device_to, unpatch_weights=False)
        if unpatch_weights and device_to is not None:
            self.zimage.offload(device_to)
            self._sync()

    def _sync(self):
        """Keep the bookkeeping ComfyUI reads off the module in step with the transformer."""
        t = self.zimage
        self.model.model_loaded_weight_memory = t.device_bytes()
        self.model.model_lowvram = t.streamer.n_streamed > 0 or not t.on_device
        self.model.device = t.device if t.on_device else self.offload_device


class PinnedPatcher(comfy.model_patcher.ModelPatcher):
    """Another model as ComfyUI sees it while the pack runs it from pinned host masters: a model
    whose size is what it needs on the GPU at least (a streamed text encoder: its final norm and a
    few layer slots, 0.56 GiB for Qwen3-4B; the VAE: its 168 MB), so making room for it evicts
    a few transformer layers instead of all of them, and unloading it is free (the masters stay).
    ``part`` is the ``StreamedStack`` or ``DeviceCopies`` that holds the device buffers."""

    def __init__(self, owner, part):
        super().__init__(owner.model, owner.load_device, owner.offload_device, size=part.loaded_bytes)
        self.part = part

    def model_size(self):
        return self.part.loaded_bytes

    def loaded_size(self):
        return self.part.device_bytes()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        self.part.load()

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        before = self.loaded_size()
        self.part.load()
        return self.loaded_size() - before

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return self.part.unload()

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        super().unpatch_model(device_to, unpatch_weights=False)
        if unpatch_weights:
            self.part.unload()

    def model_mmap_residency(self, free=False):
        return 0, 0

    def pinned_memory_size(self):
        return self.part.pool.used


# the pack's patcher for another model, one per ComfyUI patcher, alive as long as that patcher is
_pinned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _loaded_by_comfy(p) -> bool:
    """ComfyUI holds this patcher's weights on the GPU now (never true on a CPU-only setup,
    where loading moves nothing)."""
    return p.load_device != p.offload_device and any(
        lm.model is p and p.loaded_size() > 0 for lm in mm.current_loaded_models)


def _pinned_patcher(p, root, make_part, what):
    """The pack's ``PinnedPatcher`` for ComfyUI's patcher ``p``, or None where ComfyUI's own path
    must run the model: weight patches or hooks on it (a LoRA), ComfyUI holding it on the GPU now
    (the pack's device copies are then dropped: one copy on the GPU is enough), Dynamic VRAM
    managing its weights, or a model ``make_part`` cannot serve (``UnsupportedStack``)."""
    mine = _pinned.get(p)
    if p.patches or getattr(p, "forced_hooks", None) is not None or _loaded_by_comfy(p):
        if mine is not None:
            mine.part.unload()
        return None
    if any(hasattr(m, "_v") for m in root.modules()):
        return None  # ComfyUI's Dynamic VRAM loader has prepared these weights as its own
    if mine is None:
        try:
            # on the CPU the model's own tensors are the masters: no packed copy
            on_cpu = torch.device(p.load_device).type == "cpu"
            if not on_cpu:
                _plan_host_budget(p.load_device)
            pool = HostPool(what, cap_bytes=0 if on_cpu else None)
            part = make_part(pool)
        except UnsupportedStack as e:
            log.info("Z-Image: the %s runs through ComfyUI's loader: %s", what, e)
            return None
        mine = _pinned[p] = PinnedPatcher(p, part)
        # ComfyUI's own patcher (or a clone of it) loading this model takes ours off the model
        # manager's list without unloading it: drop our copies then, one copy on the GPU is enough
        ref = weakref.ref(mine)
        p.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, lambda *_: ref() and ref().part.unload())
    return mine


def _ram_cache_headroom() -> int:
    """The available RAM ComfyUI's RAM-pressure cache keeps (v0.20+, set for each prompt from
    --cache-ram or its default; 0 where there is none): below it ComfyUI drops cached models."""
    try:
        import comfy.memory_management
    except ImportError:  # v0.8: no RAM-pressure cache
        return 0
    return int(getattr(comfy.memory_management, "RAM_CACHE_HEADROOM", 0))


_said_headroom = [None]


def _plan_host_budget(device):
    """The host budget keeps what ComfyUI keeps free (said once in the console), and, until the
    transformer plans its own split, expects it to need the masters of the layers a bf16 Z-Image
    streams at 1024x1024 on this card: a text encoder loaded first leaves them that much RAM."""
    headroom = _ram_cache_headroom() or cache_headroom(total_ram())
    if headroom != _said_headroom[0]:
        _said_headroom[0] = headroom
        avail = available_ram()
        log.info("Z-Image: host RAM: %s available, ComfyUI keeps %.1f GiB of it free; the pack holds weights "
                 "in the rest%s", "?" if avail is None else f"{avail / planner.GiB:.1f} GiB", headroom / planner.GiB,
                 " (ZIMAGE_PINNED_GIB caps it)" if environment_cap() is not None else "")
    BUDGET.headroom = headroom
    if "transformer" not in BUDGET.claims and torch.device(device).type == "cuda":
        p = planner.plan(ZImageConfig(), planner.device_free_bytes(device), 1024, 1024)
        BUDGET.claim("transformer", p.streamed_layers * p.layer_bytes + planner.host_room(ZImageConfig(), 0).fixed)


def _streamed_stack(clip, pool):
    stack = StreamedStack(clip.cond_stage_model, clip.patcher.load_device, pool)
    log.info("Z-Image: text encoder streamed: %d layers through %d slots, %.2f GiB on the device",
             len(stack.layers), stack.n_slots, stack.loaded_bytes / planner.GiB)
    return stack


def streamed_text_encoder(clip):
    """The CLIP with its text encoder streamed, or None where ComfyUI's own path must run it."""
    te = _pinned_patcher(clip.patcher, clip.cond_stage_model, lambda pool: _streamed_stack(clip, pool),
                         "text encoder")
    if te is None:
        return None
    n = clip.clone()
    n.patcher = te
    return n


def pinned_vae(vae):
    """The pack's patcher for ``vae`` (its weights uploaded from pinned masters, its unload free),
    or None where ComfyUI's own VAE patcher must run the decode."""
    model = vae.first_stage_model
    return _pinned_patcher(vae.patcher, model,
                           lambda pool: DeviceCopies(module_tensors(model), vae.patcher.load_device, pool), "VAE")


# Measured peak of the Flux AE decoder: about 2.2 KB per output pixel in bf16, 4.4 KB in fp32
# (ComfyUI's estimate is about twice that, which would evict transformer layers for nothing).
BYTES_PER_PIXEL_PER_DTYPE_BYTE = 1100


def _decode_bytes(vae, shape):
    return shape[-2] * shape[-1] * 64 * BYTES_PER_PIXEL_PER_DTYPE_BYTE * vae.vae_dtype.itemsize + (256 << 20)


def _decode_full(vae, samples):
    """Decode on the GPU in one piece per image. Room comes through the model manager, which
    asks the loaded models (a streamed transformer evicts layers) for it. The VAE's weights come
    from pinned host masters where the pack can hold them, so the model manager unloading the VAE
    to make room for the transformer costs nothing, and loading it again is one fast upload
    (ComfyUI's classic path copies its weights to pageable memory and back: 0.13 s per image)."""
    need = _decode_bytes(vae, samples.shape)
    pinned = pinned_vae(vae)
    mm.load_models_gpu([vae.patcher if pinned is None else pinned], memory_required=need, force_full_load=True)
    out = []
    with torch.no_grad(), (contextlib.nullcontext() if pinned is None else pinned.part.running()):
        for i in range(samples.shape[0]):
            x = samples[i:i + 1].to(device=vae.device, dtype=vae.vae_dtype)
            img = vae.first_stage_model.decode(x).to(vae.output_device).float()
            out.append(vae.process_output(img))
    if pinned is not None:
        pinned.part.pool.report("VAE")
    return torch.cat(out).movedim(1, -1)


def decode(vae, latent, on_tiled=None):
    """Images for ``latent``: decoded on the GPU in one piece per image, with room made through the
    model manager; after an out-of-memory error, once more on an emptied GPU; only then tiled (slower,
    slightly different), said to ``on_tiled`` and the log."""
    try:
        start = time.perf_counter()
        out = _decode_full(vae, latent)
        log.debug("Z-Image: decoded in %.2f s", time.perf_counter() - start)
        return out
    except mm.OOM_EXCEPTION:
        log.info("Z-Image: the decode ran out of memory in the room it asked for; emptying the GPU and retrying")
    mm.free_memory(1e30, vae.device)  # everything else off the GPU, then one more full try
    try:
        return _decode_full(vae, latent)
    except mm.OOM_EXCEPTION:
        pass
    mm.soft_empty_cache()
    text = ("Z-Image: the VAE decode does not fit even on an emptied GPU at "
            f"{latent.shape[-1] * 8}x{latent.shape[-2] * 8}; decoding tiled (slower, slightly different).")
    log.warning(text)
    if on_tiled is not None:
        on_tiled(text)
    return vae.decode_tiled(latent)


_warned_disk = [False]


def _warn_text_encoder_from_disk(stack):
    """Once: where the RAM the host budget leaves (beside the transformer's pinned layers and
    ComfyUI's headroom) cannot keep the text encoder's file cached, every new prompt reads it from
    the disk again; say so, and what would help."""
    te_bytes = len(stack.layers) * stack.layout.nbytes
    room = BUDGET.room("text encoder")
    if _warned_disk[0] or room >= te_bytes or available_ram() is None:
        return
    _warned_disk[0] = True
    log.warning("Z-Image: the text encoder's %.1f GiB do not fit in the %.1f GiB of RAM left beside the "
                "transformer's pinned layers and the %.1f GiB ComfyUI keeps free: it is read from the disk "
                "for every new prompt (seconds, not tenths). What would help: the fp8 transformer "
                "checkpoint (half the pinned RAM), more RAM, or closing other programs.",
                te_bytes / planner.GiB, room / planner.GiB, BUDGET.headroom / planner.GiB)


def encode(clip, text):
    """CONDITIONING for ``text``: ComfyUI's own encode, with the text encoder's decoder layers
    streamed when that is possible. Its weights, kernels and dtypes are the model's own, so the
    conditioning is the one ComfyUI computes with the text encoder loaded whole."""
    tokens = clip.tokenize(text)
    streamed = streamed_text_encoder(clip)
    if streamed is None:
        return clip.encode_from_tokens_scheduled(tokens)
    for attempt in range(2):
        try:
            start = time.perf_counter()
            mm.load_models_gpu([streamed.patcher])  # room first, through the model manager
            with streamed.patcher.part.running():
                out = streamed.encode_from_tokens_scheduled(tokens)
            part = streamed.patcher.part
            part.pool.report("text encoder")
            _warn_text_encoder_from_disk(part)
            log.debug("Z-Image: prompt encoded in %.2f s (%d of %d layers resident)", time.perf_counter() - start,
                      part.streamer.n_resident, len(part.layers))
            return out
        except torch.OutOfMemoryError:
            if attempt:
                raise
            log.warning("Z-Image: out of memory while encoding the prompt; emptying the GPU and retrying")
            mm.free_memory(1e30, streamed.patcher.load_device)


def unet_config(cfg):
    """The unet_config ComfyUI's detection gives a Z-Image file (LoRA key maps read it)."""
    return {"image_model": "lumina2", "patch_size": cfg.patch_size, "in_channels": cfg.in_channels,
            "dim": cfg.dim, "n_layers": cfg.n_layers, "n_refiner_layers": cfg.n_refiner_layers,
            "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_heads, "multiple_of": 256,
            "ffn_dim_multiplier": 8.0 / 3.0, "norm_eps": cfg.norm_eps, "qk_norm": True,
            "cap_feat_dim": cfg.cap_feat_dim, "axes_dims": list(cfg.axes_dims), "axes_lens": [1536, 512, 512],
            "rope_theta": cfg.rope_theta, "z_image_modulation": True, "time_scale": cfg.time_scale,
            "pad_tokens_multiple": cfg.pad_multiple, "disable_unet_model_creation": True}


def load_model(path, weight_dtype="default", settings: Settings = Settings()):
    """A Z-Image MODEL backed by the streaming core; dtypes chosen as ComfyUI's UNETLoader does."""
    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    ck = Checkpoint(path)  # header only: config, parameter count and storage dtype
    cfg, file_dtype = ck.config, ck.storage_dtype
    ck.close()
    model_config = comfy.supported_models.ZImage(unet_config(cfg))
    supported = list(model_config.supported_inference_dtypes)
    weight = file_dtype if weight_dtype == "default" else STORAGE_DTYPES[weight_dtype]
    unet_dtype = mm.unet_dtype(model_params=cfg.total_params(), supported_dtypes=supported, weight_dtype=weight)
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, supported)
    compute = manual_cast or unet_dtype
    if compute not in _DTYPE_NAMES:
        compute = torch.bfloat16
    model_config.set_inference_dtype(unet_dtype, manual_cast)
    storage = weight if weight == torch.float8_e4m3fn else compute
    storage_name = {v: k for k, v in STORAGE_DTYPES.items()}[storage]
    _plan_host_budget(load_device)
    # an interrupt is seen between blocks (and, on the CPU, between pieces of one), not only between steps
    t = ZImageTransformer.load(path, device=load_device, dtype=_DTYPE_NAMES[compute], weight_dtype=storage_name,
                               settings=settings, initial_device=offload_device,
                               check_interrupt=mm.throw_exception_if_processing_interrupted)
    t.model.set_attention(comfy_attention)
    base = ZImageModel(model_config, device=None)
    base.diffusion_model = t
    return ZImagePatcher(base, load_device=load_device, offload_device=offload_device)

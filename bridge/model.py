"""The pack's ComfyUI ``MODEL``: a stock ``Lumina2`` base model whose diffusion model is the
streamed ``ZImageTransformer``, wrapped in ``ZImagePatcher``: a ``ModelPatcher`` that reports the
bytes the transformer really holds, unloads partially by evicting resident layers (the last to
become resident first; nothing is copied back: a layer comes back from its master or the file)
and loads by promoting them. ComfyUI's own ``free_memory`` / ``load_models_gpu`` therefore make
room for the text encoder and the VAE the cheap way, and stock samplers, ``VAEDecode`` and LoRA
loaders see an ordinary MODEL.
"""
from __future__ import annotations

import logging

import torch

import comfy.conds
import comfy.ldm.modules.attention
import comfy.model_base
import comfy.model_management as mm
import comfy.model_patcher
import comfy.supported_models

from ..zimage_core import planner, triton_lora
from ..zimage_core.checkpoint import Checkpoint
from ..zimage_core.dit import sdpa_attention
from ..zimage_core.errors import OutOfDeviceMemory, ZImageError
from ..zimage_core.image_size import ImageSize
from ..zimage_core.settings import COMPUTE_DTYPES, STORAGE_DTYPES, Settings
from ..zimage_core.transformer import ZImageTransformer
from .memory import plan_host_budget
from .patches import apply as apply_patches, remember_sources

log = logging.getLogger("zimage")
_DTYPE_NAMES = {v: k for k, v in COMPUTE_DTYPES.items()}


def comfy_attention(q, k, v, heads):
    """ComfyUI's attention kernel, so the pack computes what its native Z-Image computes."""
    return comfy.ldm.modules.attention.optimized_attention(q, k, v, heads, skip_reshape=True)


def attention(device):
    """The attention the transformer runs: ComfyUI's, the kernel the user asked it for (sage,
    flash-attn, xformers, ...) or its default, PyTorch's SDPA with flash attention put first. On
    the cards where torch itself puts cuDNN's kernel first (compute capability 9.0 and 10.0: H100,
    H200, B200) the default becomes torch's own choice: cuDNN's kernel took 0.48 ms a layer at
    1024x1024 on an H100 against flash attention's 0.82 (11 ms of a step), the two differing by
    bf16 rounding only. Everywhere else, the consumer cards and Windows among them, it is
    ComfyUI's."""
    attn = comfy.ldm.modules.attention
    prefers_cudnn = device.type == "cuda" and torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))
    default = attn.optimized_attention is getattr(attn, "attention_pytorch", None)
    return sdpa_attention if default and prefers_cudnn else comfy_attention


class ZImageModel(comfy.model_base.Lumina2):
    """ComfyUI's Lumina2 base model over the streamed transformer. Its memory estimate (what the
    samplers ask before loading) is the transformer's activation estimate: ComfyUI's factor-based
    one is several times larger and would make it evict layers for nothing."""

    def memory_required(self, input_shape, cond_shapes={}):
        return self.diffusion_model.activation_bytes(ImageSize.of_latent(input_shape))

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
        apply_patches(self, t.weights)
        t.restore_split()
        self._sync()

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        """Every sampling run re-plans (promoting layers when memory came back) and brings this
        clone's object and weight patches in."""
        before = self.loaded_size()
        self.unpatch_model(self.offload_device, unpatch_weights=False)
        self.patch_model(device_to, lowvram_model_memory=0, load_weights=True)
        return max(0, self.loaded_size() - before)

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        added = super().add_patches(patches, strength_patch, strength_model)
        remember_sources(patches, added)  # a damaged LoRA's error names its file
        return added

    def model_mmap_residency(self, free=False):
        """(ComfyUI v0.20) The host copies are pinned buffers, not file mappings to bounce."""
        return 0, 0

    def pinned_memory_size(self):
        return self.zimage.pinned_bytes

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.zimage.evict(memory_to_free)
        self._sync()
        log.info("Z-Image: made room for another model: %.2f GiB freed (%d layers stay on the GPU)",
                 freed / planner.GiB, self.zimage.resident_layers)
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        super().unpatch_model(device_to, unpatch_weights=False)
        if unpatch_weights and device_to is not None:
            self.zimage.offload(device_to)
            self._sync()

    def take_back(self):
        """The memory another model borrowed is back (a decode has finished): the layers it took
        return now, uploading in the background (while ComfyUI saves the image), so that the next
        image's first step does not wait for them."""
        t = self.zimage
        if not (t.device.type == "cuda" and t.on_device):
            return
        try:
            t.restore_split()
        except OutOfDeviceMemory:
            return  # someone else holds the memory now: the next sampling run plans with what is left
        finally:
            self._sync()

    def _sync(self):
        """Keep the bookkeeping ComfyUI reads off the module in step with the transformer."""
        t = self.zimage
        self.model.model_loaded_weight_memory = t.device_bytes()
        self.model.model_lowvram = t.partly_loaded
        self.model.device = t.device if t.on_device else self.offload_device


def take_back_memory():
    """Every Z-Image model ComfyUI holds on the GPU takes back the memory a decode borrowed."""
    for lm in list(mm.current_loaded_models):
        if isinstance(lm.model, ZImagePatcher):
            lm.model.take_back()


def unet_config(cfg):
    """The unet_config ComfyUI's detection gives a Z-Image file (LoRA key maps read it)."""
    return {"image_model": "lumina2", "patch_size": cfg.patch_size, "in_channels": cfg.in_channels,
            "dim": cfg.dim, "n_layers": cfg.n_layers, "n_refiner_layers": cfg.n_refiner_layers,
            "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_heads, "multiple_of": 256,
            "ffn_dim_multiplier": 8.0 / 3.0, "norm_eps": cfg.norm_eps, "qk_norm": True,
            "cap_feat_dim": cfg.cap_feat_dim, "axes_dims": list(cfg.axes_dims), "axes_lens": [1536, 512, 512],
            "rope_theta": cfg.rope_theta, "z_image_modulation": True, "time_scale": cfg.time_scale,
            "pad_tokens_multiple": cfg.pad_multiple, "disable_unet_model_creation": True}


def describe(model, unet_name) -> str:
    """The loader's one line about a loaded MODEL: its layers, and where they are kept."""
    t = model.zimage
    n = t.cfg.n_blocks
    held = "read from the file as the first image needs them" if t.device.type == "cuda" else "in host memory (CPU)"
    if len(t.devices) > 1:
        held += f", across {', '.join(map(str, t.devices))} as their memory allows"
    return f"Z-Image: {unet_name}: {n} layers ({t.cfg.n_layers} main, {n - t.cfg.n_layers} refiners), {held}"


def cards(devices: str, load_device) -> list:
    """The devices the transformer's layers span, ComfyUI's own first (it runs the sampler there and
    its model manager sees the model there): ``auto``, every CUDA device this process sees (ComfyUI
    uses one; the others are free for layers), or a list such as ``cuda:0, cuda:1`` or ``0, 1``."""
    load_device = torch.device(load_device)
    text = devices.strip().lower()
    if text in ("", "auto"):
        if load_device.type != "cuda":
            return [load_device]
        first = load_device.index if load_device.index is not None else torch.cuda.current_device()
        return [torch.device("cuda", first)] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())
                                                if i != first]
    named = []
    for part in text.split(","):
        name = part.strip()
        try:
            named.append(torch.device(f"cuda:{name}" if name.isdigit() else name))
        except RuntimeError:
            raise ZImageError(f"devices: {part.strip()!r} is not a device; write auto, or cards such as "
                              "cuda:0, cuda:1 (or 0, 1).") from None
    if load_device.type == "cuda" and load_device.index is None:
        load_device = torch.device("cuda", torch.cuda.current_device())
    if load_device not in named:
        raise ZImageError(f"devices {devices!r} leaves out {load_device}, where ComfyUI runs the sampler and "
                          f"the other models: name it too (it comes first), or write auto.")
    return [load_device] + [d for d in named if d != load_device]


def load_model(path, weight_dtype="default", settings: Settings = Settings(), devices: str = "auto"):
    """A Z-Image MODEL backed by the streaming core; dtypes chosen as ComfyUI's UNETLoader does. Its
    layers span ``devices`` (``cards``)."""
    load_device = mm.get_torch_device()
    spans = cards(devices, load_device)
    offload_device = mm.unet_offload_device()
    ck = Checkpoint(path)  # header only: config, parameter count and storage dtype
    # a GGUF's blocks have no dtype of their own: the compute dtype is ComfyUI's pick for the device
    cfg, file_dtype = ck.config, (None if ck.streams_blocks else ck.storage_dtype)
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
    plan_host_budget(load_device)
    # an interrupt is seen between blocks (and, on the CPU, between pieces of one), not only between steps
    t = ZImageTransformer.load(path, device=spans if len(spans) > 1 else load_device, dtype=_DTYPE_NAMES[compute],
                               weight_dtype=storage_name,
                               settings=settings, initial_device=offload_device,
                               check_interrupt=mm.throw_exception_if_processing_interrupted,
                               attention=attention(load_device))
    # the fused LoRA patch's check compiles what a LoRA will launch, beside the first image (not in
    # the first LoRA image: a second or more where Triton's cache on disk has none of it)
    triton_lora.check_soon(load_device, mm.lora_compute_dtype(load_device), t.storage_dtype)
    base = ZImageModel(model_config, device=None)
    base.diffusion_model = t
    return ZImagePatcher(base, load_device=load_device, offload_device=offload_device)

"""Another model (the text encoder, the VAE) as ComfyUI sees it while the pack runs it: a patcher
that asks for what the model needs on the GPU at least and whose unload is free."""
from __future__ import annotations

import logging
import weakref

import torch

import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension

from ..zimage_core.host_memory import HostPool
from ..zimage_core.stack_streaming import UnsupportedStack
from .memory import plan_host_budget

log = logging.getLogger("zimage")


class PinnedPatcher(comfy.model_patcher.ModelPatcher):
    """Another model as ComfyUI sees it while the pack runs it from pinned host masters: a model
    whose size is what it holds on the GPU between runs at least (a streamed text encoder: its
    final norm, the slots its layers stream through being a run's memory, asked for as such; the
    VAE: its 168 MB), so making room for it takes the transformer's slots or a few of its layers
    instead of all of them, and unloading it is free (the masters stay). ``part`` is the
    ``StreamedStack`` or ``DeviceCopies`` that holds the device buffers of ``model``, the modules
    it runs: ComfyUI's own (``owner.model``), or the pack's tree of them (the VAE's)."""

    def __init__(self, owner, part, model):
        super().__init__(model, owner.load_device, owner.offload_device, size=part.loaded_bytes)
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


def run_dtypes(entries) -> list:
    """Per ``module_tensors`` entry, the dtype ComfyUI runs the tensor in: with Dynamic VRAM
    (v0.20, v0.28) it assigns the file's tensors to the model (an fp32 VAE file stays fp32 in
    memory) and casts each to the dtype it archived for it (``<name>_comfy_model_dtype``) as it
    loads it; None where it archived none."""
    return [getattr(m, f"{name}_comfy_model_dtype", None) for m, _, name in entries]


# ComfyUI's patcher -> the pack's patcher for its model (a CLIP and its clones with a LoRA share one),
# alive as long as one of those patchers is (the pack's refers to the model, not to them)
_pinned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def loaded_by_comfy(p) -> bool:
    """ComfyUI holds this patcher's weights on the GPU now (never true on a CPU-only setup,
    where loading moves nothing)."""
    return p.load_device != p.offload_device and any(
        lm.model is p and p.loaded_size() > 0 for lm in mm.current_loaded_models)


def pinned_patcher(p, root, make_part, what, takes_patches=None):
    """The pack's ``PinnedPatcher`` for ComfyUI's patcher ``p``, running the modules ``root`` (``p``'s
    model, or the pack's tree of it), or None where ComfyUI's own path must run the model: hooks on
    it, weight patches the part does not apply itself (``takes_patches(p, part)``: the text
    encoder's stack applies a LoRA on its layers; without it, any weight patch), ComfyUI holding it
    on the GPU now (the pack's device copies are then dropped: one copy on the GPU is enough),
    Dynamic VRAM managing the weights of ``root``, or a model ``make_part`` cannot serve
    (``UnsupportedStack``)."""
    mine = _pinned.get(p)
    if mine is None:  # a clone of a patcher the pack serves already (a LoRA on it)
        mine = next((m for m in list(_pinned.values()) if m.model is root), None)
    if (p.patches and takes_patches is None) or getattr(p, "forced_hooks", None) is not None or loaded_by_comfy(p):
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
                plan_host_budget(p.load_device)
            pool = HostPool(what, cap_bytes=0 if on_cpu else None)
            part = make_part(pool)
        except UnsupportedStack as e:
            log.info("Z-Image: the %s runs through ComfyUI's loader: %s", what, e)
            return None
        mine = PinnedPatcher(p, part, root)
    if p not in _pinned:
        _pinned[p] = mine
        # ComfyUI's own patcher (or a clone of it) loading this model takes ours off the model
        # manager's list without unloading it: drop our copies then, one copy on the GPU is enough
        ref = weakref.ref(mine)
        p.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, lambda *_: ref() and ref().part.unload())
    if p.patches and not takes_patches(p, mine.part):
        mine.part.unload()
        return None
    return mine

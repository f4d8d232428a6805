"""The decode: on the GPU in one piece per image, the VAE's weights uploaded from pinned masters."""
from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref

import torch

import comfy.model_management as mm

from ..zimage_core.device_copies import DeviceCopies, module_tensors
from .memory import on_an_emptied_gpu_after_oom
from .model import take_back_memory
from .pinned import loaded_by_comfy, pinned_patcher, run_dtypes

log = logging.getLogger("zimage")

# ComfyUI's VAE model -> the pack's tree of its modules (``_own_modules``)
_trees: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _own_modules(module, made):
    """``module`` and its submodules copied, their parameter and buffer dicts shared (no tensor is
    copied, and a tensor pointed elsewhere is pointed there for both trees)."""
    if id(module) not in made:
        tree = made[id(module)] = copy.copy(module)
        tree._modules = {name: None if m is None else _own_modules(m, made) for name, m in module._modules.items()}
    return made[id(module)]


def pinned_vae(vae):
    """The pack's patcher for ``vae`` (its weights uploaded from pinned masters, its unload free),
    or None where ComfyUI's own VAE patcher must run the decode.

    It runs a tree of the model's modules of its own, made the first time the pack can serve the
    VAE. ComfyUI's Dynamic VRAM marks the modules of a model it loads (a stock VAEDecode in the same
    session) as its own for good; without a tree of its own the pack's decode would then go through
    ComfyUI's patcher for the rest of the session, about 0.1 s slower at 1024x1024 on an H200."""
    model = vae.first_stage_model
    tree = _trees.get(model)
    if tree is None and not loaded_by_comfy(vae.patcher):  # not while ComfyUI holds it: what its load sets stays off
        tree = _trees[model] = _own_modules(model, {})
    root = model if tree is None else tree
    entries = module_tensors(root)
    return pinned_patcher(vae.patcher, root,
                          lambda pool: DeviceCopies(entries, vae.patcher.load_device, pool, run_dtypes(entries)), "VAE")


# Measured peak of the Flux AE decoder: about 2.2 KB per output pixel in bf16, 4.4 KB in fp32 (2.14
# GiB at 1024x1024 in bf16 on an H200), with the convolutions cuDNN prefers. That peak includes their
# workspaces: with less free memory cuDNN takes other convolutions, whose results differ in the last
# bits, and keeps taking them for that shape for the rest of the process (its plan cache). So the
# decode asks for the peak with a quarter and 0.5 GiB on top (2.5 GiB free was enough there, 2.2
# was not): the image is then the same on every card and at every point of a session.
BYTES_PER_PIXEL_PER_DTYPE_BYTE = 1100


def _decode_bytes(vae, shape):
    peak = shape[-2] * shape[-1] * 64 * BYTES_PER_PIXEL_PER_DTYPE_BYTE * vae.vae_dtype.itemsize
    return peak * 5 // 4 + (512 << 20)


def _decode_full(vae, samples):
    """Decode on the GPU in one piece per image. Room comes through the model manager, which
    asks the loaded models (a streamed transformer evicts layers) for it. The VAE's weights come
    from pinned host masters where the pack can hold them, so the model manager unloading the VAE
    to make room for the transformer costs nothing, and loading it again is one fast upload
    (ComfyUI's classic path copies its weights to pageable memory and back: 0.13 s per image)."""
    need = _decode_bytes(vae, samples.shape)
    pinned = pinned_vae(vae)
    mm.load_models_gpu([vae.patcher if pinned is None else pinned], memory_required=need, force_full_load=True)
    log.debug("Z-Image: decoding through %s with %.2f GiB free (%.2f asked)",
              "ComfyUI's VAE patcher" if pinned is None else "the pack's device copies",
              mm.get_free_memory(vae.device) / (1 << 30), need / (1 << 30))
    out = []
    with torch.no_grad(), (contextlib.nullcontext() if pinned is None else pinned.part.running()):
        for i in range(samples.shape[0]):
            x = samples[i:i + 1].to(device=vae.device, dtype=vae.vae_dtype)
            img = (vae.first_stage_model if pinned is None else pinned.model).decode(x).to(vae.output_device).float()
            out.append(vae.process_output(img))
    if pinned is not None:
        pinned.part.pool.report("VAE")
    return torch.cat(out).movedim(1, -1)


def decode(vae, latent, on_tiled=None):
    """Images for ``latent``: decoded on the GPU in one piece per image, with room made through the
    model manager; after an out-of-memory error, once more on an emptied GPU; only then tiled (slower,
    slightly different), said to ``on_tiled`` and the log."""
    start = time.perf_counter()
    try:
        out = on_an_emptied_gpu_after_oom(lambda: _decode_full(vae, latent), vae.device, "decoding")
        log.debug("Z-Image: decoded in %.2f s", time.perf_counter() - start)
        take_back_memory()
        return out
    except mm.OOM_EXCEPTION:
        pass
    mm.soft_empty_cache()
    text = ("Z-Image: the VAE decode does not fit even on an emptied GPU at "
            f"{latent.shape[-1] * 8}x{latent.shape[-2] * 8}; decoding tiled (slower, slightly different).")
    log.warning(text)
    if on_tiled is not None:
        on_tiled(text)
    return vae.decode_tiled(latent)

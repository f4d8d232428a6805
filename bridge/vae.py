"""The decode: on the GPU in one piece per image, the VAE's weights uploaded from pinned masters."""
from __future__ import annotations

import contextlib
import logging
import time

import torch

import comfy.model_management as mm

from ..zimage_core.device_copies import DeviceCopies, module_tensors
from .memory import on_an_emptied_gpu_after_oom
from .model import take_back_memory
from .pinned import pinned_patcher, run_dtypes

log = logging.getLogger("zimage")


def pinned_vae(vae):
    """The pack's patcher for ``vae`` (its weights uploaded from pinned masters, its unload free),
    or None where ComfyUI's own VAE patcher must run the decode."""
    model = vae.first_stage_model
    entries = module_tensors(model)
    return pinned_patcher(vae.patcher, model,
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
            img = vae.first_stage_model.decode(x).to(vae.output_device).float()
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

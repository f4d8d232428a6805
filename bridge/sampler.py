"""Text to image: ComfyUI's own sampling of a MODEL, with Z-Image's flow schedule."""
from __future__ import annotations

import contextlib
import logging
import statistics
import time

import torch

import comfy.model_management
import comfy.model_sampling
import comfy.sample
import comfy.samplers
import comfy.utils
import latent_preview

from ..zimage_core.image_size import ImageSize

log = logging.getLogger("zimage")

SAMPLERS = comfy.samplers.KSampler.SAMPLERS
SCHEDULERS = comfy.samplers.KSampler.SCHEDULERS


class _FlowSampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    """Flow matching with a static shift: what ModelSamplingAuraFlow installs."""


def shifted_sigmas(model, scheduler, steps, shift):
    """The schedule ModelSamplingAuraFlow(shift) would give. Computed here instead of patching a
    clone of the model: a clone that dies when this returns would leave ComfyUI's model manager
    with a dead entry for a model that still holds GPU memory, which it then cannot free."""
    sampling = _FlowSampling(model.model.model_config)
    sampling.set_parameters(shift=shift, multiplier=1.0)
    return comfy.samplers.calculate_sigmas(sampling, scheduler, steps)


def zero_conditioning(conditioning):
    """A negative with the positive's shapes and zeros (ConditioningZeroOut); with cfg 1 it is never run."""
    out = []
    for cond, extra in conditioning:
        extra = extra.copy()
        if extra.get("pooled_output") is not None:
            extra["pooled_output"] = torch.zeros_like(extra["pooled_output"])
        out.append([torch.zeros_like(cond), extra])
    return out


def sample(model, positive, negative, size: ImageSize, seed, steps, cfg, shift, sampler_name, scheduler,
           on_status=None):
    """Latents of ``size.batch`` images from empty latents, sampled as ComfyUI's KSampler samples
    them (its noise, its samplers, its previews and progress bar) on ``shifted_sigmas``. With a
    streamed transformer, ``on_status(text)`` hears the split while it samples."""
    transformer = getattr(model, "zimage", None)
    with contextlib.nullcontext() if transformer is None or on_status is None else transformer.status_to(on_status):
        latent = torch.zeros(size.latent_shape(16), device=comfy.model_management.intermediate_device())
        latent = comfy.sample.fix_empty_latent_channels(model, latent)
        noise = comfy.sample.prepare_noise(latent, seed)
        preview = latent_preview.prepare_callback(model, steps)
        ticks = [time.perf_counter()]
        file_uploads = None if transformer is None else transformer.file_uploads

        def callback(*args):  # ComfyUI's previews and progress, and when each step ended
            ticks.append(time.perf_counter())
            return preview(*args)
        out = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive,
                                  negative if negative is not None else zero_conditioning(positive), latent,
                                  denoise=1.0, sigmas=shifted_sigmas(model, scheduler, steps, shift),
                                  callback=callback, disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
        if len(ticks) > 2:
            log.debug("Z-Image: sampled %d steps in %.2f s (the first %.2f s, with loading; then %.3f s a step)%s",
                      len(ticks) - 1, time.perf_counter() - ticks[0], ticks[1] - ticks[0],
                      statistics.median(b - a for a, b in zip(ticks[1:], ticks[2:])),
                      "" if file_uploads is None else
                      f"; {transformer.file_uploads - file_uploads} layer uploads read the checkpoint")
        return out

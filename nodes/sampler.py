import contextlib

import comfy.model_management
import comfy.model_sampling
import comfy.sample
import comfy.samplers
import comfy.utils
import latent_preview
import torch
from comfy_api.latest import io

from .checks import finite_latent, number
from .status import aliases, node_id, show

MAX_SIDE = 4096
MAX_CFG = MAX_SHIFT = 100.0


class _FlowSampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    """Flow matching with a static shift: what ModelSamplingAuraFlow installs."""


def shifted_sigmas(model, scheduler, steps, shift):
    """The schedule ModelSamplingAuraFlow(shift) would give. Computed here instead of patching a
    clone of the model: a clone that dies when this node returns would leave ComfyUI's model
    manager with a dead entry for a model that still holds GPU memory, which it then cannot free."""
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


def check_side(name, value):
    if value % 16 or not 16 <= value <= MAX_SIDE:
        raise ValueError(f"{name} is {value}: Z-Image needs a multiple of 16 between 16 and {MAX_SIDE} "
                         f"(the VAE downscales by 8 and the transformer patches by 2). Try {max(16, value // 16 * 16)}.")


class ZImageSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        side = ("Image {} in pixels: a multiple of 16 (the VAE downscales by 8, the transformer patches by 2). "
                "Larger images keep fewer layers on the GPU.")
        return io.Schema(
            node_id="ZImageSampler",
            display_name="Z-Image Sampler (streaming)",
            category="Z-Image",
            description="Text to image with Z-Image-Turbo defaults (8 steps, cfg 1, shift 3, res_multistep / "
                        "simple). Plans how many layers stay on the GPU for the image size.",
            inputs=[
                io.Model.Input("model", tooltip="The Z-Image Model Loader (streaming)'s MODEL; a stock "
                                                "Z-Image MODEL works too."),
                io.Conditioning.Input("positive", tooltip="The prompt, from Z-Image Text Encode (streaming)."),
                io.Conditioning.Input("negative", optional=True,
                                      tooltip="Only used with cfg above 1; zeros when left empty."),
                io.Int.Input("width", default=1024, min=16, max=MAX_SIDE, step=16, tooltip=side.format("width")),
                io.Int.Input("height", default=1024, min=16, max=MAX_SIDE, step=16, tooltip=side.format("height")),
                io.Int.Input("batch_size", default=1, min=1, max=64,
                             tooltip="Images made at once; each needs its own activations on the GPU."),
                io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                             tooltip="The noise the image starts from: the same seed and settings give the "
                                     "same image."),
                io.Int.Input("steps", default=8, min=1, max=200,
                             tooltip="Sampling steps; Z-Image-Turbo is distilled for 8."),
                io.Float.Input("cfg", default=1.0, min=0.0, max=MAX_CFG, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance. Z-Image-Turbo uses 1 (the negative is not run); "
                                       "above 1 every step also runs the negative: twice the work."),
                io.Float.Input("shift", default=3.0, min=0.0, max=MAX_SHIFT, step=0.01,
                               tooltip="Timestep shift of the schedule (ModelSamplingAuraFlow's shift). "
                                       "Z-Image-Turbo uses 3; higher spends more steps on coarse structure."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS, default="res_multistep",
                               tooltip="The sampling method; res_multistep is what Z-Image-Turbo's template uses."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default="simple",
                               tooltip="How the noise levels are spaced over the steps; Z-Image-Turbo uses simple."),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
            **aliases("ksampler", "sampler", "text to image"),
        )

    @classmethod
    def execute(cls, model, positive, width, height, batch_size, seed, steps, cfg, shift, sampler_name,
                scheduler, negative=None):
        check_side("width", width)
        check_side("height", height)
        number("cfg", cfg, 0.0, MAX_CFG, "Z-Image-Turbo uses 1")
        number("shift", shift, 0.0, MAX_SHIFT, "Z-Image-Turbo uses 3")
        node = node_id(cls)
        transformer = getattr(model, "zimage", None)
        # the split's status goes to this node while it samples
        with contextlib.nullcontext() if transformer is None else transformer.status_to(lambda text: show(node, text)):
            latent = torch.zeros([batch_size, 16, height // 8, width // 8], device=comfy.model_management.intermediate_device())
            latent = comfy.sample.fix_empty_latent_channels(model, latent)
            noise = comfy.sample.prepare_noise(latent, seed)
            samples = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive,
                                          negative if negative is not None else zero_conditioning(positive), latent,
                                          denoise=1.0, sigmas=shifted_sigmas(model, scheduler, steps, shift),
                                          callback=latent_preview.prepare_callback(model, steps),
                                          disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
        finite_latent(samples, "The image came out non-finite (NaN or infinity) after sampling")
        return io.NodeOutput({"samples": samples})

from comfy_api.latest import io

from ..bridge import ui
from ..bridge.sampler import SAMPLERS, SCHEDULERS, sample
from ..zimage_core.image_size import MAX_SIDE, ImageSize, is_side, nearest_side
from .checks import finite_latent, number
from .status import aliases, node_id

MAX_CFG = MAX_SHIFT = 100.0


def check_side(name, value):
    if not is_side(value):
        raise ValueError(f"{name} is {value}: Z-Image needs a multiple of 16 between 16 and {MAX_SIDE} "
                         f"(the VAE downscales by 8 and the transformer patches by 2). Try {nearest_side(value)}.")


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
                io.Combo.Input("sampler_name", options=SAMPLERS, default="res_multistep",
                               tooltip="The sampling method; res_multistep is what Z-Image-Turbo's template uses."),
                io.Combo.Input("scheduler", options=SCHEDULERS, default="simple",
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
        samples = sample(model, positive, negative, ImageSize(width, height, batch_size), seed, steps, cfg, shift,
                         sampler_name, scheduler, on_status=lambda text: ui.show(node, text))
        finite_latent(samples, "The image came out non-finite (NaN or infinity) after sampling")
        return io.NodeOutput({"samples": samples})

from comfy_api.latest import io

from ..bridge import ui
from ..bridge.model import describe, load_model
from ..zimage_core import environment
from ..zimage_core.settings import STORAGE_DTYPES, Settings
from .checks import number
from .status import aliases, node_id

VRAM_MODES = ["auto", "max_resident_layers", "leave_free_gb"]
DEFAULT_RESIDENT, DEFAULT_LEAVE_FREE = 30, 0.0
MAX_LEAVE_FREE = 1024.0


class ZImageModelLoader(io.ComfyNode):
    # resident_layers and leave_free_gb stay two plain widgets, shown in every mode: a DynamicCombo
    # would rename them (vram.resident_layers) and shift the widget values of saved workflows.
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageModelLoader",
            display_name="Z-Image Model Loader (streaming)",
            category="Z-Image",
            description="Loads a Z-Image-Turbo diffusion model (ComfyUI, official or diffusers layout; bf16, "
                        "fp16, fp32, fp8, or a GGUF). As many layers as fit stay on the GPU, spread through the stack; "
                        "the others stream from pinned host memory, and other models get GPU memory by "
                        "evicting layers.",
            inputs=[
                io.Combo.Input("unet_name", options=ui.model_files(),
                               tooltip="The Z-Image-Turbo transformer in models/diffusion_models, e.g. "
                                       "z_image_turbo_bf16.safetensors (or the fp8 export or a GGUF for less "
                                       "RAM)."),
                io.Combo.Input("weight_dtype", options=["default", *STORAGE_DTYPES],
                               default="default",
                               tooltip="How the layers are kept and streamed. default: as stored (fp8 stays fp8, "
                                       "the rest in the compute dtype). fp16 can overflow into black images: "
                                       "prefer bf16."),
                io.Combo.Input("vram", options=VRAM_MODES, default="auto",
                               tooltip="auto: as many layers on the GPU as fit the image being made. "
                                       "max_resident_layers: at most resident_layers of them. "
                                       "leave_free_gb: plan as if leave_free_gb of GPU memory belonged to "
                                       "others. Each number below is used only in its own mode."),
                io.Int.Input("resident_layers", default=DEFAULT_RESIDENT, min=0, max=64,
                             tooltip="Used only with vram = max_resident_layers: the most layers kept on the "
                                     "GPU (Z-Image-Turbo has 34 counting its 4 refiners; 0 streams them all)."),
                io.Float.Input("leave_free_gb", default=DEFAULT_LEAVE_FREE, min=0.0, max=MAX_LEAVE_FREE, step=0.5,
                               tooltip="Used only with vram = leave_free_gb: GiB of GPU memory the plan leaves "
                                       "untouched, for other programs or models."),
                io.String.Input("devices", default="auto", optional=True,
                                tooltip="The GPUs the transformer's layers may use. auto: ComfyUI's GPU, and every "
                                        "other GPU of this machine where the first cannot hold all the layers "
                                        "(each card streams its own layers over its own link). Or a list such "
                                        "as cuda:0, cuda:1 (ComfyUI's GPU comes first)."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
            **aliases("zimage", "z image turbo", "load diffusion model", "unet loader", "low vram", "block swap"),
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name, **_):
        """The file's size and modification time: a file changed on disk (a finished re-download)
        is loaded again instead of a cached model reading a file that is no longer its own."""
        return ui.fingerprint(unet_name)

    # async only for ComfyUI's order: of the nodes ready to run, it runs an async one first, so the
    # load, which starts reading the checkpoint's layers from the disk (``read_ahead``), comes at the
    # prompt's start, before the text encoder's load and encode, rather than after them. Nothing in
    # it awaits: it runs to its end at once, as a plain node would.
    @classmethod
    async def execute(cls, unet_name, weight_dtype, vram, resident_layers, leave_free_gb, devices="auto"):
        number("leave_free_gb", leave_free_gb, 0.0, MAX_LEAVE_FREE, "GiB of GPU memory to leave free; 0 leaves none")
        path = ui.model_path(unet_name)
        env = environment.read()  # a malformed ZIMAGE_* setting stops the prompt here, its first node
        settings = Settings(max_resident=resident_layers if vram == "max_resident_layers" else None,
                                   leave_free=int((leave_free_gb if vram == "leave_free_gb" else 0.0) * (1 << 30)),
                                   compress=env.compression)
        model = load_model(path, weight_dtype=weight_dtype, settings=settings, devices=devices)
        text = describe(model, unet_name)
        for name, value, default, mode in (("resident_layers", resident_layers, DEFAULT_RESIDENT, "max_resident_layers"),
                                           ("leave_free_gb", leave_free_gb, DEFAULT_LEAVE_FREE, "leave_free_gb")):
            if vram != mode and value != default:  # set but not used: say so rather than ignore it silently
                text += f"; {name} {value} is not used with vram {vram} (only with vram {mode})"
        ui.show(node_id(cls), text)
        return io.NodeOutput(model)

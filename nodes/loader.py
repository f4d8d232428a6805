import folder_paths
from comfy_api.latest import io

from ..zimage_core import comfy as zcomfy
from .status import node_id, show

VRAM_MODES = ["auto", "max_resident_layers", "leave_free_gb"]


class ZImageModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageModelLoader",
            display_name="Load Z-Image Model (streaming)",
            category="Z-Image",
            description="Loads a Z-Image-Turbo diffusion model (ComfyUI, official or diffusers layout; bf16, "
                        "fp16, fp32 or fp8). Leading layers stay on the GPU, trailing ones stream from pinned "
                        "host memory, and other models get GPU memory by evicting layers.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models")),
                io.Combo.Input("weight_dtype", options=["default", "bf16", "fp8_e4m3fn", "fp16", "fp32"],
                               default="default",
                               tooltip="How the layers are kept and streamed. default: as stored (fp8 stays fp8, "
                                       "the rest in the compute dtype)."),
                io.Combo.Input("vram", options=VRAM_MODES, default="auto",
                               tooltip="auto: as many layers on the GPU as fit the image being made. "
                                       "max_resident_layers: never more than the number below. "
                                       "leave_free_gb: plan as if this much GPU memory belonged to others."),
                io.Int.Input("resident_layers", default=30, min=0, max=64,
                             tooltip="With max_resident_layers: the most layers kept on the GPU."),
                io.Float.Input("leave_free_gb", default=0.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="With leave_free_gb: GPU memory the plan leaves untouched."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, unet_name, weight_dtype, vram, resident_layers, leave_free_gb):
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        model = zcomfy.load_model(path, weight_dtype=weight_dtype,
                                  max_resident=resident_layers if vram == "max_resident_layers" else None,
                                  leave_free_gib=leave_free_gb if vram == "leave_free_gb" else 0.0)
        t = model.zimage
        show(node_id(cls), f"Z-Image: {unet_name}: {t.cfg.n_layers} layers, "
                           f"{t.streamer.pinned_layers} pinned in host memory")
        return io.NodeOutput(model)

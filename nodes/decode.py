from comfy_api.latest import io

from ..bridge import ui
from ..bridge.vae import decode
from .checks import finite_latent
from .status import aliases, node_id


class ZImageDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageDecode",
            display_name="Z-Image Decode (streaming)",
            category="Z-Image",
            description="Full VAE decode on the GPU, making room by evicting transformer layers. Falls back to a "
                        "tiled decode (with a warning) only when even an emptied GPU cannot hold it.",
            inputs=[io.Vae.Input("vae", tooltip="The Flux VAE: a VAELoader with ae.safetensors."),
                    io.Latent.Input("samples", tooltip="The latent from Z-Image Sampler (streaming) or a KSampler.")],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
            **aliases("vae decode"),
        )

    @classmethod
    def execute(cls, vae, samples):
        latent = samples["samples"]
        if latent.ndim == 5:
            latent = latent[:, :, 0]
        finite_latent(latent, "The latent to decode holds NaN or infinity: the image would be black")
        return io.NodeOutput(decode(vae, latent, on_tiled=lambda text: ui.show(node_id(cls), text)))

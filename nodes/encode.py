from comfy_api.latest import io

from ..zimage_core import comfy as zcomfy
from .status import node_id, show


class ZImageTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageTextEncode",
            display_name="Z-Image Text Encode",
            category="Z-Image",
            description="Encodes a prompt with Qwen3-4B (CLIPLoader, type lumina2) in Z-Image's chat template. "
                        "The text encoder runs on the GPU with its layers streamed from pinned memory, so it "
                        "needs about 1 GB there and the transformer stays loaded.",
            inputs=[
                io.Clip.Input("clip"),
                io.String.Input("text", multiline=True, dynamic_prompts=True),
            ],
            outputs=[io.Conditioning.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, clip, text):
        if clip is None:
            raise RuntimeError("Z-Image Text Encode got no text encoder: connect a CLIPLoader with "
                               "qwen_3_4b.safetensors and type lumina2.")
        show(node_id(cls), "Z-Image: encoding the prompt")
        return io.NodeOutput(zcomfy.encode(clip, text))

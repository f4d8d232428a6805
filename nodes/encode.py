from comfy_api.latest import io

from ..bridge import ui
from ..bridge.text_encoder import encode
from .status import aliases, node_id


class ZImageTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageTextEncode",
            display_name="Z-Image Text Encode (streaming)",
            category="Z-Image",
            description="Encodes a prompt with Qwen3-4B (CLIPLoader, type lumina2) in Z-Image's chat template, "
                        "on the GPU. Where the whole encoder does not fit beside the transformer, its layers "
                        "stream from host memory and it needs 0.56 GiB there, so the transformer stays loaded.",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder: a CLIPLoader with qwen_3_4b.safetensors and "
                                              "type lumina2."),
                io.String.Input("text", multiline=True, dynamic_prompts=True,
                                tooltip="What the image shows. Plain sentences work best; Z-Image-Turbo needs "
                                        "no negative prompt."),
            ],
            outputs=[io.Conditioning.Output()],
            hidden=[io.Hidden.unique_id],
            **aliases("clip text encode", "prompt", "qwen"),
        )

    @classmethod
    def execute(cls, clip, text):
        if clip is None:
            raise RuntimeError("Z-Image Text Encode got no text encoder: connect a CLIPLoader with "
                               "qwen_3_4b.safetensors and type lumina2.")
        ui.show(node_id(cls), "Z-Image: encoding the prompt")
        return io.NodeOutput(encode(clip, text))

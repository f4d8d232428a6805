from comfy_api.latest import io

from .status import node_id, show


class ZImageTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageTextEncode",
            display_name="Z-Image Text Encode",
            category="Z-Image",
            description="Encodes a prompt with Qwen3-4B (CLIPLoader, type lumina2) in Z-Image's chat template. "
                        "The text encoder runs on the GPU; its room comes from evicted transformer layers.",
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
        tokens = clip.tokenize(text)
        show(node_id(cls), "Z-Image: encoding the prompt")
        return io.NodeOutput(clip.encode_from_tokens_scheduled(tokens))

"""ComfyUI nodes over zimage_core, on the schema API (``comfy_api.latest``)."""
from comfy_api.latest import ComfyExtension

from .decode import ZImageDecode
from .encode import ZImageTextEncode
from .loader import ZImageModelLoader
from .sampler import ZImageSampler


class ZImageExtension(ComfyExtension):
    async def get_node_list(self):
        return [ZImageModelLoader, ZImageTextEncode, ZImageSampler, ZImageDecode]


async def comfy_entrypoint():
    return ZImageExtension()

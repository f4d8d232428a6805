"""ComfyUI nodes over zimage_core, on the schema API (``comfy_api.latest``)."""
import logging

from comfy_api.latest import ComfyExtension

from ..zimage_core import environment

from .decode import ZImageDecode
from .encode import ZImageTextEncode
from .loader import ZImageModelLoader
from .sampler import ZImageSampler


class ZImageExtension(ComfyExtension):
    async def get_node_list(self):
        # said once at start-up; the loader refuses each prompt with the same words (environment.read)
        for problem in environment.problems_now():
            logging.getLogger("zimage").error(
                "Z-Image: %s The Z-Image nodes are loaded, but every prompt that uses them stops at its first "
                "Z-Image node with this message until the setting is fixed and ComfyUI restarted.", problem)
        return [ZImageModelLoader, ZImageTextEncode, ZImageSampler, ZImageDecode]


async def comfy_entrypoint():
    return ZImageExtension()

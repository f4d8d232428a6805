"""ComfyUI nodes over zimage_core (schema API)."""
from comfy_api.latest import ComfyExtension


class ZImageExtension(ComfyExtension):
    async def get_node_list(self):
        return []


async def comfy_entrypoint():
    return ZImageExtension()

"""Who a node is to ComfyUI's schema API: the running node's id, and the words the node library's
search finds it by."""
import dataclasses

from comfy_api.latest import io

COMMON_ALIASES = ("zimage", "z image", "z-image turbo", "streaming", "low vram")


def node_id(cls):
    """The executing node's id; None when a node's execute is called outside a prompt (scripts)."""
    return getattr(cls.hidden, "unique_id", None) if cls.hidden is not None else None


def aliases(*words):
    """Schema keywords for search aliases, where this ComfyUI's schema has them (v0.20 and later;
    v0.8's Schema refuses the keyword)."""
    if "search_aliases" not in {f.name for f in dataclasses.fields(io.Schema)}:
        return {}
    return {"search_aliases": [*COMMON_ALIASES, *words]}

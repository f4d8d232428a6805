"""ComfyUI entry point: registers the Z-Image nodes."""
from .nodes import comfy_entrypoint

__all__ = ["comfy_entrypoint"]

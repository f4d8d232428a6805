"""ComfyUI inside a helper script's own process, on the CPU. ComfyUI parses the command line when
it is imported, so each script that needs it runs in a process of its own and calls ``start``
before importing anything from ComfyUI."""
import os
import sys

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(comfy_path):
    """Make ComfyUI (CPU only) and this pack importable."""
    sys.path.insert(0, comfy_path)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.path.insert(0, PACK_ROOT)

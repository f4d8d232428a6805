"""ComfyUI inside a helper script's own process, on the CPU (or its GPU: ``cpu=False``). ComfyUI
parses the command line when it is imported, so each script that needs it runs in a process of its
own and calls ``start`` before importing anything from ComfyUI."""
import os
import sys
import types

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PACKAGE = "zimage_pack"


def start(comfy_path, cpu=True, flags=()):
    """Make ComfyUI (CPU only, unless ``cpu`` is False; ``flags``: more of its command line) and this
    pack importable: the pack as
    ``zimage_pack``, the package ComfyUI imports it as (the bridge's imports of the core are relative
    to it), without running its ``__init__`` (which registers the nodes with a server). Import the
    core through it too (``zimage_pack.zimage_core``): one copy of its modules in the process."""
    sys.path.insert(0, comfy_path)
    sys.argv = [sys.argv[0]] + (["--cpu"] if cpu else []) + list(flags)
    import comfy.options
    comfy.options.enable_args_parsing()
    pack = types.ModuleType(PACKAGE)
    pack.__path__ = [PACK_ROOT]
    sys.modules[PACKAGE] = pack

"""Where the ComfyUI tests find ComfyUI: COMFYUI_PATH, run with a Python that has ComfyUI's
requirements (the tests start ComfyUI with the interpreter that runs them)."""
import os

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
needs_comfyui = pytest.mark.skipif(
    not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH or "", "main.py")),
    reason="set COMFYUI_PATH to a ComfyUI source tree (v0.8.0 or v0.20.1) to run the ComfyUI tests")


def comfyui_version():
    ns = {}
    with open(os.path.join(COMFYUI_PATH, "comfyui_version.py")) as f:
        exec(compile(f.read(), "comfyui_version.py", "exec"), ns)  # a one-line generated file
    return ns["__version__"]

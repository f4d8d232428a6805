"""Where the ComfyUI tests find ComfyUI: COMFYUI_PATH, run with a Python that has ComfyUI's
requirements (the tests start ComfyUI with the interpreter that runs them)."""
import json
import os
import subprocess
import sys

import pytest

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
needs_comfyui = pytest.mark.skipif(
    not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH or "", "main.py")),
    reason="set COMFYUI_PATH to a ComfyUI source tree (v0.8.0, v0.20.1, v0.28.0 or v0.33.0) to run the ComfyUI tests")


def comfyui_version():
    ns = {}
    with open(os.path.join(COMFYUI_PATH, "comfyui_version.py")) as f:
        exec(compile(f.read(), "comfyui_version.py", "exec"), ns)  # a one-line generated file
    return ns["__version__"]


def run_check(tmp_path, script, *args, timeout=900):
    """Run a check script of this folder in a process of its own (ComfyUI parses the command line
    when it is imported) as ``script COMFYUI_PATH ARGS... OUT.json``, with fresh allocations
    filled with non-zero bytes so that reading uninitialised memory shows; returns the JSON it wrote."""
    out = tmp_path / (os.path.splitext(script)[0] + ".json")
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script),
                        COMFYUI_PATH, *map(str, args), str(out)], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, MALLOC_PERTURB_="255"))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())

"""The pack's reaches into ComfyUI's internals (bridge/reaches.py), checked against a
ComfyUI tree in ComfyUI's process.

    python comfy_reaches_check.py COMFYUI_PATH OUT.json
"""
import json
import sys

import comfy_process

comfy_path, out_path = sys.argv[1:3]
comfy_process.start(comfy_path)
from zimage_pack.bridge import reaches as comfy_reaches  # noqa: E402

with open(out_path, "w") as f:
    json.dump({"reaches": len(comfy_reaches.reaches()), "problems": comfy_reaches.check()}, f)

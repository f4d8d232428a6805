#!/usr/bin/env bash
# Make a venv in which the ComfyUI tests can run a ComfyUI source tree on the CPU:
#   bash tests/comfy_venv.sh COMFYUI_TREE VENV
# then: . VENV/bin/activate && COMFYUI_PATH=COMFYUI_TREE python3 -m pytest -q tests
#
# The tree's own requirements.txt, except torch, torchvision and torchaudio, which it leaves
# unpinned:
# - torch 2.14.1 with torchvision 0.29.1, the CUDA builds (they run on the CPU). The CPU build of
#   torch the core tests use cannot serve here: torchvision's wheels on the package index link
#   against the CUDA build and fail to load beside the CPU one, and ComfyUI imports torchvision.
# - torchaudio 2.11.0 without its pin on torch (its newest release): ComfyUI v0.20 and later import
#   it when they load, and nothing a Z-Image workflow runs calls it.
# And gguf: the reference the quantization tests check the pack's dequantization against.
set -euo pipefail
tree=$1 venv=$2
[ -f "$tree/requirements.txt" ] || { echo "no requirements.txt in $tree: not a ComfyUI tree" >&2; exit 2; }
python3 -m venv "$venv"
. "$venv/bin/activate"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "$tree/requirements.txt" >"$reqs"
# requests: v0.8.0 imports it at start without listing it
python3 -m pip install -q "torch==2.14.1" "torchvision==0.29.1" -r "$reqs" requests pytest gguf
python3 -m pip install -q --no-deps "torchaudio==2.11.0"

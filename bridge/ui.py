"""What the user meets of ComfyUI: the model files it lists (GGUF files beside them: ComfyUI lists
only its own extensions there), and a node's one-line status (in the console, and on the node in the
browser)."""
from __future__ import annotations

import logging
import os

import folder_paths

log = logging.getLogger("zimage")
FOLDER = "diffusion_models"  # where Z-Image transformers go (ComfyUI's alias "unet" lists the same)


GGUF = ".gguf"


def _gguf_files() -> dict:
    """{name: path} of the .gguf files in the diffusion models' folders (the first folder's wins)."""
    found = {}
    for folder in folder_paths.get_folder_paths(FOLDER):
        for name in folder_paths.recursive_search(folder, excluded_dir_names=[".git"])[0]:
            if name.lower().endswith(GGUF):
                found.setdefault(name, os.path.join(folder, name))
    return found


def model_files() -> list:
    return sorted({*folder_paths.get_filename_list(FOLDER), *_gguf_files()})


def model_path(name: str) -> str:
    """The file's path; ComfyUI's own error (naming the file and the folder) where it is not there."""
    if name.lower().endswith(GGUF):
        path = _gguf_files().get(name)
        if path is None:
            raise FileNotFoundError(f"Model in folder '{FOLDER}' with filename '{name}' not found.")
        return path
    return folder_paths.get_full_path_or_raise(FOLDER, name)


def fingerprint(name: str) -> str | None:
    """The file's size and modification time (None where it is missing: loading it says so)."""
    try:
        st = os.stat(model_path(name))
    except Exception:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}"


def show(node_id, text):
    """``text`` in the console and on node ``node_id`` (none outside a server: ComfyUI as a library)."""
    log.info(text)
    try:
        from server import PromptServer
        PromptServer.instance.send_progress_text(text, node_id)
    except (ImportError, AttributeError):
        pass

"""What the user meets of ComfyUI: the model files it lists, and a node's one-line status (in the
console, and on the node in the browser)."""
from __future__ import annotations

import logging
import os

import folder_paths

log = logging.getLogger("zimage")
FOLDER = "diffusion_models"  # where Z-Image transformers go (ComfyUI's alias "unet" lists the same)


def model_files() -> list:
    return folder_paths.get_filename_list(FOLDER)


def model_path(name: str) -> str:
    """The file's path; ComfyUI's own error (naming the file and the folder) where it is not there."""
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

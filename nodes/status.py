"""The one-line status a node shows while it works, in the console and on the node."""
import logging

log = logging.getLogger("zimage")


def show(node_id, text):
    log.info(text)
    try:
        from server import PromptServer
        PromptServer.instance.send_progress_text(text, node_id)
    except (ImportError, AttributeError):  # no server (ComfyUI used as a library)
        pass


def node_id(cls):
    """The executing node's id; None when a node's execute is called outside a prompt (scripts)."""
    return getattr(cls.hidden, "unique_id", None) if cls.hidden is not None else None

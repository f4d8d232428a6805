"""What ComfyUI is running: the API-format node being executed and the model files upstream of one
of its inputs, so that an error can name the file (a LoRA, a text encoder) that caused it. None
outside a prompt (a script calling the bridge directly)."""
from __future__ import annotations

MODEL_FILES = (".safetensors", ".sft", ".gguf", ".ckpt", ".pt", ".pth", ".bin")


def running_node() -> tuple | None:
    """(node id, the prompt's nodes) of the node ComfyUI is executing now, or None."""
    try:
        import server
        from comfy_execution.utils import get_executing_context

        ctx = get_executing_context()
        queue = server.PromptServer.instance.prompt_queue
    except (ImportError, AttributeError):  # no server in this process
        return None
    if ctx is None:
        return None
    running, _ = queue.get_current_queue_volatile()
    for item in running:  # (number, prompt id, prompt, extra data, outputs, ...)
        if item[1] == ctx.prompt_id and ctx.node_id in item[2]:
            return ctx.node_id, item[2]
    return None


def _files(node_id, nodes) -> list:
    node = nodes.get(node_id, {})
    return [f"{v} ({node.get('class_type', '?')}, node {node_id})" for v in node.get("inputs", {}).values()
            if isinstance(v, str) and v.lower().endswith(MODEL_FILES)]


def files_of_running_node() -> list:
    """The model files the running node names in its inputs ("x.safetensors (LoraLoader, node 7)")."""
    running = running_node()
    return [] if running is None else _files(*running)


def files_upstream(input_name: str) -> list:
    """The model files named by the nodes that feed the running node's ``input_name``, nearest
    first: for a text encode's ``clip``, a LoRA loader's file, then the CLIPLoader's."""
    running = running_node()
    if running is None:
        return []
    node_id, nodes = running
    link = nodes.get(node_id, {}).get("inputs", {}).get(input_name)
    out, seen, todo = [], set(), [link]
    while todo:
        link = todo.pop(0)
        if not (isinstance(link, list) and link and link[0] in nodes) or link[0] in seen:
            continue
        seen.add(link[0])
        out += _files(link[0], nodes)
        todo += [v for v in nodes[link[0]].get("inputs", {}).values() if isinstance(v, list)]
    return out

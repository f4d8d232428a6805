"""A device as the core names it, and the memory this process could still take on it."""
from __future__ import annotations

import torch


def device_of(device) -> torch.device:
    """A device with its index: tensors report ``cuda:0``, and comparisons with a bare ``cuda`` fail."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_free_bytes(device) -> int:
    """What this process could allocate on a CUDA ``device`` now: the device's free memory plus
    what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

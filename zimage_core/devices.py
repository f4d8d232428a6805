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


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` on ``device``: itself where it is there already. Between cards the copy is ordered
    after the kernels that made ``x`` and before those queued next on ``device``."""
    return x if x.device == device else x.to(device)

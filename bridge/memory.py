"""Memory the bridge plans with ComfyUI: the host RAM ComfyUI's cache keeps free, the host
budget's first claim for the transformer, and the one retry after an out-of-memory error that a
text encode or a decode gets on an emptied GPU."""
from __future__ import annotations

import logging

import torch

import comfy.model_management as mm

from ..zimage_core import planner
from ..zimage_core.config import FULL
from ..zimage_core.devices import device_free_bytes
from ..zimage_core.host_memory import BUDGET
from ..zimage_core.ram import available_ram, cache_headroom, total_ram

log = logging.getLogger("zimage")


def _ram_cache_headroom() -> int:
    """The available RAM ComfyUI's RAM-pressure cache keeps (v0.20+, set for each prompt from
    --cache-ram or its default; 0 where there is none): below it ComfyUI drops cached models."""
    try:
        import comfy.memory_management
    except ImportError:  # v0.8: no RAM-pressure cache
        return 0
    return int(getattr(comfy.memory_management, "RAM_CACHE_HEADROOM", 0))


_said_headroom = [None]


def plan_host_budget(device):
    """The host budget keeps what ComfyUI keeps free (said once in the console), and, until the
    transformer plans its own split, expects it to need the masters of the layers a bf16 Z-Image
    streams at 1024x1024 on this card: a text encoder loaded first leaves them that much RAM."""
    headroom = _ram_cache_headroom() or cache_headroom(total_ram())
    if headroom != _said_headroom[0]:
        _said_headroom[0] = headroom
        avail = available_ram()
        log.info("Z-Image: host RAM: %s available, ComfyUI keeps %.1f GiB of it free; the pack holds weights "
                 "in the rest%s", "?" if avail is None else f"{avail / planner.GiB:.1f} GiB", headroom / planner.GiB,
                 " (ZIMAGE_PINNED_GIB caps it)" if BUDGET.cap is not None else "")
    BUDGET.headroom = headroom
    if "transformer" not in BUDGET.claims and torch.device(device).type == "cuda":
        BUDGET.claim("transformer", planner.plan(FULL, device_free_bytes(device), 1024, 1024).host_bytes)


def on_an_emptied_gpu_after_oom(run, device, what):
    """``run()``; after an out-of-memory error in the room the model manager made for it, once more
    with every other model off the GPU (the error stands when that does not help either)."""
    try:
        return run()
    except mm.OOM_EXCEPTION:
        pass  # out of the handler first: its traceback holds the failed run's tensors
    log.warning("Z-Image: out of memory while %s; emptying the GPU and retrying", what)
    mm.free_memory(1e30, device)
    return run()

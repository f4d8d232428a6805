"""The prompt's encode: ComfyUI's own, with the text encoder's decoder layers streamed."""
from __future__ import annotations

import logging
import time

import comfy.model_management as mm
import torch

from ..zimage_core import environment, planner, plans
from ..zimage_core.config import FULL
from ..zimage_core.errors import TextEncoderError
from ..zimage_core.host_memory import BUDGET
from ..zimage_core.ram import available_ram
from ..zimage_core.stack_streaming import StreamedStack
from ..zimage_core.transformer import check_kernels_soon
from . import patches
from .memory import on_an_emptied_gpu_after_oom
from .pinned import pinned_patcher
from .prompt import files_upstream

log = logging.getLogger("zimage")


def _streamed_stack(clip, pool):
    stack = StreamedStack(clip.cond_stage_model, clip.patcher.load_device, pool)
    if stack.device.type == "cpu":
        log.info("Z-Image: text encoder on the CPU: %d layers in host memory", len(stack.layers))
    else:
        log.info("Z-Image: text encoder streamed: %d layers through %d slots, %.2f GiB on the GPU while it runs",
                 len(stack.layers), stack.n_slots, (stack.loaded_bytes + stack.run_bytes) / planner.GiB)
    return stack


def streamed_text_encoder(clip):
    """The CLIP with its text encoder streamed, or None where ComfyUI's own path must run it."""
    te = pinned_patcher(clip.patcher, clip.cond_stage_model, lambda pool: _streamed_stack(clip, pool),
                        "text encoder", takes_patches=patches.stack_takes)
    if te is None:
        return None
    n = clip.clone()
    n.patcher = te
    return n


_warned_disk = [False]


def _warn_text_encoder_from_disk(stack):
    """Once: where the RAM the host budget leaves (beside the transformer's pinned layers and
    ComfyUI's headroom) cannot keep the text encoder's file cached, every new prompt reads it from
    the disk again; say so, and what would help. Not where its weights are locked in place: their
    pages stay (and the room left counts them as taken)."""
    te_bytes = len(stack.layers) * stack.layout.nbytes
    room = BUDGET.ram_room("text encoder")  # ZIMAGE_PINNED_GIB caps pinned copies, not the page cache
    if _warned_disk[0] or stack.pool.in_place or room >= te_bytes or available_ram() is None:
        return
    _warned_disk[0] = True
    log.warning("Z-Image: the text encoder's %.1f GiB do not fit in the %.1f GiB of RAM left beside the "
                "transformer's pinned layers and the %.1f GiB ComfyUI keeps free: it is read from the disk "
                "for every new prompt (seconds, not tenths). What would help: the fp8 transformer "
                "checkpoint (half the pinned RAM), more RAM, or closing other programs.",
                te_bytes / planner.GiB, room / planner.GiB, BUDGET.headroom / planner.GiB)


def encode(clip, text):
    """CONDITIONING for ``text``: ComfyUI's own encode, with the text encoder's decoder layers
    streamed when that is possible. Its weights, kernels and dtypes are the model's own, so the
    conditioning is the one ComfyUI computes with the text encoder loaded whole."""
    # ComfyUI loads the transformer after the prompt is encoded: the kernels' checks start now and
    # run beside the encode, not before the first step
    check_kernels_soon(clip.patcher.load_device, FULL.total_params() * torch.bfloat16.itemsize,
                      environment.read().compression != "off")  # a malformed ZIMAGE_* setting stops here
    tokens = clip.tokenize(text)
    streamed = streamed_text_encoder(clip)
    if streamed is None:
        out = clip.encode_from_tokens_scheduled(tokens)
    else:
        out = on_an_emptied_gpu_after_oom(lambda: _encode_streamed(streamed, tokens, clip.patcher),
                                         streamed.patcher.load_device, "encoding the prompt")
    _check_finite(out)
    _say_if_long(out)
    return out


def _say_if_long(conditioning):
    """A prompt longer than Z-Image was trained on still works, and makes every step slower: say so."""
    tokens = max(c.shape[1] for c, _ in conditioning)
    if tokens > plans.TEXT_TOKENS:
        log.warning("Z-Image: this prompt is %d tokens; Z-Image-Turbo was trained on prompts of up to %d. Longer "
                    "ones are outside what it learned, and every step takes longer (the transformer plans for "
                    "%d prompt tokens).", tokens, plans.TEXT_TOKENS, plans.text_tokens_to_plan(tokens))


def _check_finite(conditioning):
    """A text encoder that gives NaN (a damaged file, or a LoRA on it) is named here, once, not
    blamed on the transformer after a whole sampling run."""
    values = [c for c, _ in conditioning if isinstance(c, torch.Tensor)]
    bad = sum(int((~torch.isfinite(c)).sum()) for c in values)
    if not bad:
        return
    files = files_upstream("clip")
    source = f" from {', then '.join(files)}" if files else ""
    lora = " or the LoRA on it" if any("Lora" in f for f in files) else ""
    raise TextEncoderError(
        f"The text encoder{source} gave NaN or infinite values for this prompt ({bad} of "
        f"{sum(c.numel() for c in values)}): its file{lora} is damaged. The Z-Image model, its dtype and cfg "
        "are not the cause. Download qwen_3_4b.safetensors again (CLIPLoader, type lumina2)"
        f"{', or remove that LoRA' if lora else ''}.")


def _encode_streamed(streamed, tokens, patcher):
    """``patcher``: ComfyUI's, whose weight patches (a LoRA) the layers get as they arrive."""
    start = time.perf_counter()
    part = streamed.patcher.part
    patches.apply_to_stack(patcher, part)
    # room first, through the model manager: the slots are the run's memory, not the model's (the
    # room it keeps free for a run covers them), so its transformer's slots make way, not its layers
    mm.load_models_gpu([streamed.patcher], memory_required=part.run_bytes)
    with part.running():
        out = streamed.encode_from_tokens_scheduled(tokens)
    part.pool.report("text encoder")
    _warn_text_encoder_from_disk(part)
    log.debug("Z-Image: prompt encoded in %.2f s (%d of %d layers resident)", time.perf_counter() - start,
              part.streamer.n_resident, len(part.layers))
    return out

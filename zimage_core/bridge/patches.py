"""Weight patches (LoRA and the like) on the streamed transformer: computed once per patch set
exactly as ComfyUI's ModelPatcher computes them (the device's LoRA compute dtype, stochastic
rounding seeded by the key), checked and counted, and written where each weight lives (host
master, resident copy), so that streamed layers carry them too. A patch that makes a weight NaN or
infinite is named with the LoRA file it came from; the model file is not blamed for it."""
from __future__ import annotations

import logging
import weakref

import torch

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils

from ..errors import PatchError
from .prompt import files_of_running_node

# comfy.utils since v0.20; the old place still answers there, with a warning at every call
string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed

log = logging.getLogger("zimage")
PREFIX = "diffusion_model."

# a patch's data (a LoRA adapter) -> the loader node and file it came from; weak, so a LoRA that
# ComfyUI drops is not kept alive here. Older patch kinds are tuples, which cannot be named.
_sources = weakref.WeakKeyDictionary()


def remember_sources(patches: dict, added):
    """From a patcher's ``add_patches``: the running node (a LoRA loader) and its file are where
    these patches came from."""
    files = files_of_running_node()
    if not files:
        return
    for k in added:
        try:
            _sources[patches[k]] = " or ".join(files)
        except TypeError:
            pass


def apply(patcher, t):
    """Bring ``patcher``'s weight patches into transformer ``t`` (once per patch set); keys patched
    by a previous set and not by this one are restored from the file."""
    if t.patches_uuid == patcher.patches_uuid:
        return
    wanted = {k for k in patcher.patches if k.startswith(PREFIX)}
    written, unchanged = set(), 0
    try:
        for key in sorted(wanted | t.patched_keys):
            name = key[len(PREFIX):]
            base = t.base_weight(name)
            value = base
            if key in wanted:
                on_device = base.to(t.device)  # uploaded once: patched from it, compared with it
                temp = on_device.to(dtype=mm.lora_compute_dtype(t.device), copy=True)
                out = comfy.lora.calculate_weight(patcher.patches[key], temp, key)
                # rounded to the dtype ComfyUI's own model holds the weight in: the file's, where the
                # pack keeps a fixed-part tensor of an fp8 file wider
                stored = t.ckpt.dtype(name)
                held = stored if stored.itemsize == 1 else base.dtype
                value = comfy.float.stochastic_rounding(out, held, seed=string_to_seed(key)).to(base.dtype)
                # fp8 has no isfinite; its rounding clamps to the finite range, so ``out`` says it all
                if not (bool(torch.isfinite(out).all()) and (value.element_size() == 1 or bool(torch.isfinite(value).all()))):
                    raise PatchError(_blame(patcher.patches[key], name))
                unchanged += torch.equal(value.view(torch.uint8), on_device.view(torch.uint8))
            t.set_weight(name, value)
            written.add(key)
    except BaseException:
        # what was written stays recorded (the next patch set restores it); this set is not applied
        t.patched_keys, t.patches_uuid = t.patched_keys | written, None
        raise
    t.patched_keys, t.patches_uuid = wanted, patcher.patches_uuid
    if wanted:
        n = len(wanted) - unchanged
        log.info("Z-Image: %d weight%s patched%s", n, "" if n == 1 else "s",
                 f"; {unchanged} left unchanged (strength 0, or patches ComfyUI refused: see its messages above)"
                 if unchanged else "")


def _tensors(data):
    """The tensors of one patch's data: a LoRA adapter's weights, or an older tuple's."""
    found = getattr(data, "weights", None)
    if found is None and isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], tuple):
        found = data[1]
    if found is None:
        found = (data,)
    return [v for v in found if isinstance(v, torch.Tensor)]


def _blame(entries, name) -> str:
    """Which patch of ``entries`` (ModelPatcher's (strength, data, strength_model, offset, function)
    tuples) made weight ``name`` non-finite, and what to do."""
    def what(data):
        return f"the LoRA {_sources[data]}" if _is_named(data) else "a weight patch (a LoRA or a model merge)"

    for strength, data, *_ in entries:
        if any(not bool(torch.isfinite(v).all()) for v in _tensors(data)):
            text = (f"{what(data)} has NaN or infinite values for {name} and would make that weight NaN: the "
                    "LoRA file is damaged (or was trained into NaN). The model file is fine. Remove the LoRA, "
                    "or download it again.")
            return text[0].upper() + text[1:]
    names = ", ".join(f"{what(data)} at strength {strength:g}" for strength, data, *_ in entries)
    text = (f"{names} make{'s' if len(entries) == 1 else ''} {name} overflow to NaN or infinity. The model "
            "file is fine. Lower the LoRA's strength.")
    return text[0].upper() + text[1:]


def _is_named(data) -> bool:
    try:
        return data in _sources
    except TypeError:
        return False

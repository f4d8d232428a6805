"""Weight patches (LoRA and the like) on the streamed transformer and the streamed text encoder,
computed exactly as ComfyUI's ModelPatcher computes them (``calculate_weight`` in the device's LoRA
compute dtype, then the rounding ComfyUI applies, seeded by the key).

The streamed layers' matrices are patched on the device as each layer arrives: after its upload
into a slot, or once in its resident buffer (``LayerStreamer.set_patch``), from the patches' tensors
held on the device. No host master, compressed master or file-backed layer is written or copied
for a patch, so a new LoRA costs no pass over the model and removing it costs the re-upload of the
resident layers it changed. The few fixed-part weights a LoRA may touch (embedders, adaLN) are
patched once where they live. A matrix whose patches are all plain LoRAs (the common case) has
ComfyUI's arithmetic done in one kernel (``triton_lora``: the product, then the same roundings, the
same bits; ComfyUI's own code computes the other kinds). The first forward checks every
patched weight (finite, changed)
and reads the checks back once: a patch that makes a weight NaN or infinite is named with the
LoRA file it came from (the model file is not blamed), and the console counts the weights it
changed.
"""
from __future__ import annotations

import copy
import logging
import weakref

import torch

import comfy.float
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
from comfy.weight_adapter.lora import LoRAAdapter

from ..zimage_core import triton_lora
from ..zimage_core.errors import PatchError
from ..zimage_core.weights import Weights
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
    these patches came from; a LoRA that matched nothing is said once."""
    files = files_of_running_node()
    if not added and files:
        # ComfyUI lists each key it could not place; one line says what that means
        log.warning("Z-Image: %s changes none of this model's weights (a LoRA for another model, or for "
                    "the text encoder alone): the transformer runs without it.", " or ".join(files))
    if not files:
        return
    for k in added:
        try:
            _sources[patches[k]] = " or ".join(files)
        except TypeError:
            pass


def apply(patcher, w: Weights):
    """Bring ``patcher``'s weight patches into a transformer's weights ``w`` (once per patch set): the
    streamed layers' on the device as they arrive (``Weights.patch_layers``), the fixed part's written
    in place (keys a previous set patched there and this one does not are restored from the file)."""
    if w.patches_uuid == patcher.patches_uuid:
        return
    names = {k: k[len(PREFIX):] for k in patcher.patches if k.startswith(PREFIX)}
    where = {k: (*at, _held_dtype(w, n, w.storage_dtype)) for k, n in names.items() if (at := w.layer_of(n))}
    fixed = set(names) - set(where)
    fixed_unchanged = _apply_fixed(patcher, w, fixed)
    forget = _weakly(lambda w: setattr(w, "patches_uuid", None), w)
    first = w.device

    def make(device, blocks):
        """The patches of the layers ``blocks`` (one card's range), their tensors on ``device``; the
        first card's count says the fixed part's too."""
        mine = {k: v for k, v in where.items() if v[0] in blocks}
        counts = (len(fixed) - fixed_unchanged, fixed_unchanged) if device == first else (0, 0)
        return LayerPatches(patcher.patches, mine, device, w.storage_dtype, forget, *counts,
                            model="" if len(blocks) == w.cfg.n_blocks else f" on {device}") if mine else None
    w.patch_layers(make if where else None)
    w.patches_uuid = patcher.patches_uuid
    if fixed and not where:
        _say_count(len(fixed) - fixed_unchanged, fixed_unchanged)


def _weakly(fn, owner):
    """``fn(owner)`` through a weak reference to ``owner``: a patch set is held by the model it
    patches, and a reference back would make a cycle, which keeps a dropped model's pinned memory
    until Python's next collection instead of letting it go with the model."""
    ref = weakref.ref(owner)
    return lambda: (o := ref()) is not None and fn(o)


def _say_count(changed, unchanged, model=""):
    log.info("Z-Image: %d weight%s%s patched%s", changed, "" if changed == 1 else "s", model,
             f"; {unchanged} left unchanged (strength 0, or patches ComfyUI refused: see its messages above)"
             if unchanged else "")


def _held_dtype(w, name, dtype):
    """The dtype a patched weight is rounded to: the one ComfyUI's own model holds it in (the file's,
    where the pack keeps a tensor of an fp8 file wider), else ``dtype``, the pack's."""
    stored = w.stored_dtype(name)
    return stored if stored.itemsize == 1 else dtype


def _patched(entries, weight, key, held, seed):
    """ComfyUI's patched value of ``weight`` (on the device): the patched value before rounding
    and after, in ``weight``'s dtype. ``seed``: ``string_to_seed(key)`` (a bit loop in Python,
    computed once per key, not at every upload)."""
    temp = weight.to(dtype=mm.lora_compute_dtype(weight.device), copy=True)
    out = comfy.lora.calculate_weight(entries, temp, key)
    return out, comfy.float.stochastic_rounding(out, held, seed=seed).to(weight.dtype)


def _checks(out, value, weight) -> torch.Tensor:
    """(not finite, changed): int32 on the device, as the fused kernel's flags, for a patched ``value``
    of ``weight`` (``out``: before rounding; fp8 has no isfinite, and its rounding clamps to the finite
    range, so ``out`` says it all)."""
    finite = torch.isfinite(out).all()
    if value.element_size() > 1:
        finite &= torch.isfinite(value).all()
    return torch.stack([~finite, (value.view(torch.uint8) != weight.view(torch.uint8)).any()]).to(torch.int32)


def _apply_fixed(patcher, w, wanted) -> int:
    """The fixed-part weights of ``wanted``, patched where they live (restoring those a previous
    set patched and this one does not). Returns how many came out unchanged."""
    written, unchanged = set(), 0
    try:
        for key in sorted(wanted | w.patched_keys):
            name = key[len(PREFIX):]
            base = w.base(name)
            value = base
            if key in wanted:
                on_device = base.to(w.device)  # uploaded once: patched from it, compared with it
                out, value = _patched(patcher.patches[key], on_device, key, _held_dtype(w, name, base.dtype),
                                      string_to_seed(key))
                bad, changed = _checks(out, value, on_device).tolist()
                if bad:
                    raise PatchError(_blame(patcher.patches[key], name))
                unchanged += not changed
            w.set(name, value)
            written.add(key)
    except BaseException:
        # what was written stays recorded (the next patch set restores it); this set is not applied
        w.patched_keys, w.patches_uuid = w.patched_keys | written, None
        raise
    w.patched_keys = wanted
    return unchanged


# a patch tensor at most this large is held on the device; a larger one (a model merge's full-size
# difference) stays where ComfyUI keeps it and crosses at each use, as in ComfyUI's own low-VRAM path
DEVICE_PATCH_BYTES = 64 << 20


def _on_device(data, device):
    """A patch's data with its (small) tensors on ``device``: a LoRA adapter's weights, an older
    tuple's, nested lists; anything else as it is."""
    if isinstance(data, torch.Tensor):
        # a 0-d tensor (a LoRA's alpha) stays where ComfyUI keeps it: a CPU scalar enters the
        # arithmetic at full precision, a device one is first cast to the LoRA dtype
        return data.to(device) if 0 < data.dim() and data.nbytes <= DEVICE_PATCH_BYTES else data
    if type(data) in (tuple, list):
        return type(data)(_on_device(v, device) for v in data)
    if isinstance(getattr(data, "weights", None), tuple):  # a weight adapter (comfy.weight_adapter)
        moved = copy.copy(data)
        moved.weights = _on_device(data.weights, device)
        return moved
    return data


class LayerPatches:
    """One patch set's streamed-layer patches, for ``LayerStreamer.set_patch``: for each layer, its
    patched matrices' (name, key, patches on the device, rounding dtype, rounding seed, ``LowRank`` or
    None). The first forward checks
    each result on the device; ``verify`` reads the checks once, names a LoRA that made a weight NaN,
    drops the patches that changed nothing and says the count."""

    def __init__(self, patches: dict, where: dict, device, dtype, forget, fixed_changed=0, fixed_unchanged=0,
                 model=""):
        """``where``: {key: (layer, matrix, the dtype ComfyUI rounds it to)} for the patched keys of
        ``patches`` (a patcher's); ``dtype``: the layers'; ``forget()`` makes the next prompt apply
        the set anew (after a patch made a weight NaN); ``model``: the count's words for another
        model than the transformer (" of the text encoder")."""
        self.forget, self._where, self.model = forget, where, model
        self.sources = {k: patches[k] for k in where}  # ComfyUI's own entries: what ``_blame`` reads
        self.by_layer = {}
        for key in sorted(where):
            layer, matrix, held = where[key]
            entries = [(strength, _on_device(data, device), *rest) for strength, data, *rest in patches[key]]
            low_rank = LowRank.of(entries, held, dtype, device)
            self.by_layer.setdefault(layer, []).append((matrix, key, entries, held, string_to_seed(key), low_rank))
        # the fused kernel's check (compiles) started when the model loaded; where not, it runs now on a
        # thread while the prompt's encode does
        for inter in {e[5].inter for entries in self.by_layer.values() for e in entries if e[5]}:
            triton_lora.check_soon(device, inter, dtype)
        self.layers = set(self.by_layer)
        self._unchecked = set(where)  # keys whose first result has not been read back yet
        self._checks = {}             # key -> int32 (not finite, changed) on the device
        self._fixed = (fixed_changed, fixed_unchanged)
        self._changed = 0

    def apply(self, i, views):
        for matrix, key, entries, held, seed, low_rank in self.by_layer[i]:
            weight = views[matrix] if isinstance(views, dict) else getattr(views, matrix)
            check = key in self._unchecked
            if low_rank is not None and low_rank.runs_on(weight):
                # in place (no rounding after: held == dtype); its first result is checked as the
                # kernel writes it
                flags = torch.zeros(2, dtype=torch.int32, device=weight.device) if check else None
                low_rank(weight, weight, flags)
            else:
                out, value = _patched(entries, weight, key, held, seed)
                flags = _checks(out, value, weight) if check else None
                weight.copy_(value)
            if check:
                self._checks[key] = flags  # (not finite, changed)

    def verify(self):
        if not self._checks:
            return
        checks, self._checks = self._checks, {}
        flags = torch.stack(list(checks.values())).cpu().tolist()
        for key, (bad, changed) in zip(checks, flags):
            self._unchecked.discard(key)
            if bad:
                self.forget()  # the next prompt applies its patches anew (and restores the layers)
                raise PatchError(_blame(self.sources[key], key.removeprefix(PREFIX)))
            self._changed += changed
            if not changed:  # strength 0, or refused by ComfyUI: nothing to compute at the next upload
                layer = self._where[key][0]
                self.by_layer[layer] = [e for e in self.by_layer[layer] if e[1] != key]
        self.layers = {i for i, entries in self.by_layer.items() if entries}
        if not self._unchecked:
            changed, unchanged = self._fixed
            _say_count(self._changed + changed, len(self.sources) - self._changed + unchanged, self.model)


def apply_to_stack(patcher, stack):
    """Bring ``patcher``'s weight patches into a streamed stack (the text encoder's layers; each key
    names a layer's weight: ``stack_takes``), once per patch set: applied on the device as each
    layer arrives, as the transformer's are."""
    patch_id = patcher.patches_uuid if patcher.patches else None
    if patch_id == stack.patch_id:
        return
    dtype = stack.layout.dtype  # the layers' own: ComfyUI rounds a patched weight back to it
    where = {k: (*stack.layer_of(k), dtype) for k in patcher.patches}
    stack.set_patch(LayerPatches(patcher.patches, where, stack.device, dtype,
                                 _weakly(lambda s: s.set_patch(None, None), stack), model=" of the text encoder")
                    if where else None, patch_id)


def stack_takes(patcher, stack) -> bool:
    """Every weight patch of ``patcher`` names a weight of the stack's layers (a LoRA on the text
    encoder's attention and MLP); patches elsewhere (its embeddings, its norms) are ComfyUI's to run."""
    return all(stack.layer_of(k) is not None for k in patcher.patches)


class LowRank:
    """One weight's patches when each is a plain LoRA (``up @ down`` times strength and alpha over
    the rank: no mid weight, DoRA, reshape, offset, function or model strength) and the patched
    weight is held in the slot's dtype: ComfyUI's ``calculate_weight`` in one kernel, whose
    ``up @ down`` has the bits of ComfyUI's torch product."""

    def __init__(self, terms, inter):
        self.terms, self.inter = terms, inter  # terms: (up, down, scale as float32)

    @classmethod
    def of(cls, entries, held, dtype, device):
        """The ``LowRank`` of ``entries`` (ModelPatcher's tuples, tensors on ``device``), or None
        where ComfyUI's code must compute them, or where no kernel can (not CUDA)."""
        if torch.device(device).type != "cuda" or held != dtype or dtype not in triton_lora.DTYPES:
            return None
        terms = []
        for strength, data, strength_model, offset, function in entries:
            if type(data) is not LoRAAdapter or strength_model != 1.0 or offset is not None or function is not None:
                return None
            up, down, alpha, mid, dora, reshape = data.weights[:6]
            if mid is not None or dora is not None or reshape is not None:
                return None
            # ComfyUI's expression: a LoRA's alpha is a CPU tensor (or None), divided by the rank
            scale = strength * (alpha / down.shape[0] if alpha is not None else 1.0)
            terms.append((up, down, float(torch.as_tensor(scale).to(torch.float32))))
        return cls(terms, mm.lora_compute_dtype(device))

    def runs_on(self, weight) -> bool:
        return weight.is_contiguous() and triton_lora.runs_on(weight.device, self.inter, weight.dtype)

    def __call__(self, weight, out, flags=None):
        """``out`` = the patched ``weight`` (``out`` may be ``weight``); ``flags``: ``add_products``'s."""
        return triton_lora.add_products(weight, self.terms, out, self.inter, flags)


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

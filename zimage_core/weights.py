"""The transformer's weights by their canonical (ComfyUI) keys, wherever they live: the fixed part's
tensors on the device and their masters, and the streamed matrices in their host masters, their
files and their device buffers. What weight patches (a LoRA) read and write, and the one face the
ComfyUI bridge's patches see; the checks that every weight is finite where it runs."""
from __future__ import annotations

import torch

from .checkpoint import Checkpoint
from .config import BIG_KEYS, ZImageConfig
from .device_copies import DeviceCopies
from .dit import ZImageDiT
from .errors import CheckpointError
from .layer_chain import LayerChain
from .weight_checks import FiniteChecks, all_finite

_MATRIX = {v: k for k, v in BIG_KEYS.items()}  # "attention.qkv" -> "qkv"


class Weights:
    def __init__(self, model: ZImageDiT, layers: LayerChain, ckpt: Checkpoint, fixed: DeviceCopies,
                 checks: FiniteChecks):
        """``layers``: the streamers of the blocks (one, or one per card of a transformer that spans cards)."""
        self.model, self.layers, self.ckpt, self.fixed, self.checks = model, layers, ckpt, fixed, checks
        self.cfg: ZImageConfig = model.cfg
        self.dtype = model.dtype                      # the fixed part's (the compute dtype)
        self.layout = layers.streamers[0].layout
        self.storage_dtype = self.layout.dtype        # the streamed matrices'
        self.device = layers.streamers[0].device      # the first card's, where ComfyUI sees the model
        self._blocks = {name: i for i, name in enumerate(self.cfg.block_names())}
        self._keys = ckpt.keys()
        self._fixed_checked = False                   # the fixed part's values were checked where they run
        self.patches_uuid = None                      # id of the weight-patch set (LoRA) now in the weights
        self.patched_keys: set = set()                # canonical keys that set changed in the fixed part
        self.set_layers: set = set()                  # streamed layers ``set`` wrote: their masters hold the values

    def layer_of(self, key):
        """(streamed block index, matrix name) for a big matrix's canonical key, else None."""
        parts = key.split(".")
        block = self._blocks.get(".".join(parts[:2]))
        matrix = _MATRIX.get(".".join(parts[2:4]))
        if len(parts) == 5 and parts[4] == "weight" and matrix is not None and block is not None:
            return block, matrix
        return None

    def shapes(self) -> dict:
        """Canonical key -> (shape, dtype) of every weight, streamed matrices included."""
        out = {k: (tuple(v.shape), v.dtype) for k, v in self.model.named_parameters()}
        for key in self._keys:
            if key not in out:
                out[key] = (self.layout.shapes[self.layer_of(key)[1]], self.storage_dtype)
        return out

    def stored_dtype(self, key) -> torch.dtype:
        """The dtype the file stores ``key`` in."""
        return self.ckpt.dtype(key)

    def base(self, key) -> torch.Tensor:
        """The weight as loaded from the file (storage dtype for streamed matrices, compute dtype
        for the rest), freshly read from the file."""
        slot = self.layer_of(key)
        if slot:
            out = torch.empty(self.layout.shapes[slot[1]], dtype=self.storage_dtype)
        else:
            out = torch.empty(self.model.get_parameter(key).shape, dtype=self.dtype)
        self.ckpt.read_into(key, out)
        return out

    def set(self, key, value: torch.Tensor):
        """Replace a weight everywhere it lives: host master (packed first if the layer was only
        file-backed), resident device copy, or parameter. Streamed layers pick the new values up
        at their next upload."""
        slot = self.layer_of(key)
        if slot is None:  # a parameter: the fixed part
            module_path, _, name = key.rpartition(".")
            self.fixed.write(self.model.get_submodule(module_path), name, value)
            self._fixed_checked = False
            return
        owner, name = slot
        s, i = self.layers.locate(owner)
        s.synchronize()
        s.drop_queued()  # a slot may hold the old weights, uploaded ahead
        s.masters.ensure_plain(i)
        self.set_layers.add(owner)
        self.checks.recheck(owner)
        s.layout.region(s.masters.host[i], name).copy_(value)
        if i in s.resident:
            s.layout.region(s.resident[i], name).copy_(value)

    def patch_layers(self, make):
        """Weight patches applied on the device to the streamed layers as they arrive
        (``LayerChain.set_patch``: ``make(device, blocks)`` gives the patch of a card's range of
        blocks, its tensors on that card), or None."""
        self.layers.set_patch(make)

    def check_fixed(self):
        """Every tensor outside the streamed layers is finite, checked once where it runs (on the
        GPU: one reduction each and one read of the results)."""
        if self._fixed_checked:
            return
        tensors = list(self.model.named_parameters())
        # the checks of a span's blocks on their cards meet on the first for one read
        ok = torch.stack([all_finite(t).to(self.device) for _, t in tensors]).cpu()
        if not bool(ok.all()):
            bad = tensors[int((~ok).nonzero()[0])][0]
            raise CheckpointError(self.ckpt.path, f"has NaN or infinite values in {bad}.",
                                  "The file is damaged: download it again.")
        self._fixed_checked = True

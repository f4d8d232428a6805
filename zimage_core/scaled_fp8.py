"""fp8 safetensors files whose weights carry per-tensor scales, as ComfyUI writes and reads them:
its "scaled fp8" exports (a ``scaled_fp8`` marker tensor, ``<layer>.scale_weight``) and its
mixed-precision quant format (each quantized layer's format in ``<layer>.comfy_quant`` or the
``_quantization_metadata`` header entry, ``<layer>.weight_scale``). A weight's value is ComfyUI's
dequantization, ``weight.to(dtype) * scale.to(dtype)``. The file takes a GGUF's part in the pack
(``GGUFFile``'s face): its layers' matrices stay fp8 in host memory and on the bus (half a bf16
layer's bytes) and are scaled where they land (``GGUFTensor.scale``).

Activations stay in the compute dtype: ``input_scale`` / ``scale_input`` (fp8 matrix products on
cards that have them, in ComfyUI) are not used. Other per-layer formats (int8, nvfp4, mxfp8, ...)
are refused by name."""
from __future__ import annotations

import json

import torch

from .errors import CheckpointError
from .gguf_file import GGUFTensor, StoredGGUF
from .safetensors_file import SafetensorsFile

FORMATS = ("float8_e4m3fn",)  # the per-layer formats read
_TYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
_FIX = "Use the bf16 file, a plain or scaled fp8 e4m3fn export, or ComfyUI's own UNETLoader for this file."


def _layer_formats(f: SafetensorsFile) -> dict:
    """{layer: its quant config} where the file names any (header metadata or ``.comfy_quant``)."""
    formats = {}
    meta = f.metadata.get("_quantization_metadata")
    if meta:
        try:
            formats.update(json.loads(meta)["layers"])
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f.path, "has a malformed _quantization_metadata entry in its header.", _FIX) from None
    for k in f.keys():
        if k.endswith(".comfy_quant"):
            try:
                formats[k[:-len(".comfy_quant")]] = json.loads(f.raw(k).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                raise CheckpointError(f.path, f"has a malformed quant entry {k}.", _FIX) from None
    return formats


def open_scaled(f: SafetensorsFile):
    """``f`` as a ``ScaledFile`` where it is a scaled or mixed-precision export, else ``f``."""
    keys = f.keys()
    scale_of = {k[:-len(end)] + ".weight": k for k in keys for end in (".scale_weight", ".weight_scale")
                if k.endswith(end)}
    legacy = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in keys)
    formats = _layer_formats(f)
    if not (legacy or formats or scale_of):
        return f
    for layer, conf in formats.items():
        fmt = conf.get("format") if isinstance(conf, dict) else conf
        if fmt not in FORMATS:
            raise CheckpointError(f.path, f"stores {layer} in ComfyUI's quant format {fmt!r}, which this pack "
                                          f"cannot read (it reads {', '.join(FORMATS)}).", _FIX)
    return ScaledFile(f, scale_of)


class ScaledFile:
    """A scaled fp8 file as a ``Checkpoint`` reads its files: the scales and markers hidden, a
    scaled weight's dtype float32 (what it is scaled to), every tensor a ``GGUFTensor`` view of the
    file's mapping (checked against the file before each read, as a GGUF's)."""

    def __init__(self, f: SafetensorsFile, scale_of: dict):
        self.file, self.path = f, f.path
        hidden = {k for k in f.keys() if k.endswith((".scaled_fp8", ".comfy_quant", ".scale_input", ".input_scale"))
                  or k == "scaled_fp8"} | set(scale_of.values())
        self.scales = {w: float(f.tensor(s).float().reshape(-1)[0]) for w, s in scale_of.items() if w in f.entries}
        self._keys = [k for k in f.keys() if k not in hidden]
        for w in self.scales:
            if f.dtype(w) != torch.float8_e4m3fn:
                raise CheckpointError(self.path, f"has a scale for {w}, which is stored as {f.dtype(w)}, not fp8 "
                                                 "e4m3fn.", _FIX)
        self.tensors = _Views(self)

    def keys(self):
        return list(self._keys)

    def shape(self, key) -> tuple:
        return self.file.shape(key)

    def dtype(self, key) -> torch.dtype:
        return torch.float32 if key in self.scales else self.file.dtype(key)

    def check_unchanged(self):
        self.file.check_unchanged()

    def read_into(self, key, out: torch.Tensor, first: int = 0):
        values = self.tensors[key].values(out.dtype).reshape(-1)
        out.view(-1).copy_(values[first:first + out.numel()])

    def mapped(self, key):
        return None  # the fixed part is read into tensors of its own (scaled where scaled)

    def stored(self, key) -> StoredGGUF:
        return StoredGGUF(self, key)

    def close(self):
        self.tensors = {}
        self.file.close()


class _Views(dict):
    """{key: GGUFTensor}, each made at its first use: a view of the file's mapping (a fresh copy
    where the tensor's offset allows no view of its dtype), with its scale."""

    def __init__(self, owner: ScaledFile):
        super().__init__()
        self.owner = owner

    def __missing__(self, key):
        o = self.owner
        o.check_unchanged()
        f = o.file
        data = f.mapped(key)
        data = (data if data is not None else f.tensor(key)).reshape(-1).view(torch.uint8)
        t = GGUFTensor(_TYPE_NAMES[f.dtype(key)], tuple(f.shape(key)), data, o.scales.get(key))
        self[key] = t
        return t

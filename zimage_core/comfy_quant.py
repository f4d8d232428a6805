"""Safetensors files whose weights ComfyUI quantizes, read as it reads them: its "scaled fp8"
exports (a ``scaled_fp8`` marker tensor, ``<layer>.scale_weight``) and its mixed-precision quant
format (each quantized layer's format in ``<layer>.comfy_quant`` or the ``_quantization_metadata``
header entry, ``<layer>.weight_scale``), with ``float8_e4m3fn`` layers (a weight's value is
``weight.to(dtype) * scale.to(dtype)``) or ``int8_tensorwise`` ones (int8 codes and a float32
scale per row or per matrix, optionally ConvRot-rotated: ``int8_rows``). The file takes a GGUF's
part in the pack (``GGUFFile``'s face): its layers' matrices stay a byte a weight in host memory
and on the bus (half a bf16 layer's bytes) and are dequantized where they land (``GGUFTensor``).

Activations stay in the compute dtype: ``input_scale`` / ``scale_input`` (fp8 matrix products on
cards that have them, in ComfyUI) are not used, nor ComfyUI's int8 activations. Other per-layer
formats (nvfp4, mxfp8, ...) are refused by name."""
from __future__ import annotations

import json

import torch

from . import int8_rows
from .errors import CheckpointError
from .gguf_file import GGUFTensor, StoredGGUF
from .safetensors_file import SafetensorsFile

FORMATS = ("float8_e4m3fn", "int8_tensorwise")  # the per-layer formats read
_TYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
               torch.int8: "I8"}
_FIX = ("Use the bf16 file, a plain or scaled fp8 e4m3fn export, an int8_tensorwise export, or ComfyUI's own "
        "UNETLoader for this file.")


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


def _format(conf) -> str | None:
    """A layer's quant format: its config's ``format``, or the config itself where it is the name."""
    return conf.get("format") if isinstance(conf, dict) else conf


def open_scaled(f: SafetensorsFile):
    """``f`` as a ``ScaledFile`` where it is a scaled or mixed-precision export, else ``f``."""
    keys = f.keys()
    scale_of = {k[:-len(end)] + ".weight": k for k in keys for end in (".scale_weight", ".weight_scale")
                if k.endswith(end)}
    legacy = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in keys)
    formats = _layer_formats(f)
    int8 = {k for k in keys if f.entries[k]["dtype"] == "I8"}
    for k in sorted(int8):
        if _format(formats.get(k.removesuffix(".weight"))) != "int8_tensorwise":
            raise CheckpointError(f.path, f"stores {k} as int8 without ComfyUI's int8_tensorwise quant config "
                                          "for it: its values cannot be told.", _FIX)
    if not (legacy or formats or scale_of):
        return f
    rotations = {}
    for layer, conf in formats.items():
        fmt = _format(conf)
        if fmt not in FORMATS:
            raise CheckpointError(f.path, f"stores {layer} in ComfyUI's quant format {fmt!r}, which this pack "
                                          f"cannot read (it reads {', '.join(FORMATS)}).", _FIX)
        if fmt == "int8_tensorwise":
            rotations[layer + ".weight"] = _rotation(conf)
    return ScaledFile(f, scale_of, rotations)


def _rotation(conf: dict) -> int:
    """An int8_tensorwise layer's ConvRot group size (0: not rotated), where ComfyUI looks for it: the
    layer's config, or its ``params``."""
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return 0
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))


class ScaledFile:
    """A scaled fp8 file as a ``Checkpoint`` reads its files: the scales and markers hidden, a
    scaled weight's dtype float32 (what it is scaled to), every tensor a ``GGUFTensor`` view of the
    file's mapping (checked against the file before each read, as a GGUF's)."""

    def __init__(self, f: SafetensorsFile, scale_of: dict, rotations: dict):
        """``scale_of``: {weight: its scale's key}; ``rotations``: {weight of an int8_tensorwise layer: its
        ConvRot group size, 0 where not rotated}."""
        self.file, self.path = f, f.path
        hidden = {k for k in f.keys() if k.endswith((".scaled_fp8", ".comfy_quant", ".scale_input", ".input_scale"))
                  or k == "scaled_fp8"} | set(scale_of.values())
        self._keys = [k for k in f.keys() if k not in hidden]
        self.scales, self.rows = {}, {}  # fp8 weights' scales; int8 weights' (row scales, rotation)
        for w, rotation in rotations.items():
            if w in f.entries:
                self.rows[w] = self._int8(w, scale_of.get(w), rotation)
        for w, s in scale_of.items():
            if w in f.entries and w not in self.rows:
                if f.dtype(w) != torch.float8_e4m3fn:
                    raise CheckpointError(self.path, f"has a scale for {w}, which is stored as {f.dtype(w)}, not "
                                                     "fp8 e4m3fn.", _FIX)
                self.scales[w] = float(f.tensor(s).float().reshape(-1)[0])
        self.tensors = _Views(self)

    def _int8(self, w, scale_key, rotation) -> tuple:
        """(row scales, rotation) of the int8_tensorwise weight ``w``, checked as ComfyUI would use them."""
        f, layer = self.file, w[:-len(".weight")]
        shape = tuple(f.shape(w))
        if f.dtype(w) != torch.int8 or len(shape) != 2:
            raise CheckpointError(self.path, f"marks {layer} int8_tensorwise, but stores it as {f.dtype(w)} "
                                             f"{list(shape)}, not an int8 matrix.", _FIX)
        if scale_key is None:
            raise CheckpointError(self.path, f"has no weight_scale for the int8 layer {layer}.", _FIX)
        scale = f.tensor(scale_key).float()
        if scale.numel() == 1:
            scale = scale.reshape(())
        elif tuple(scale.shape) != (shape[0], 1):
            raise CheckpointError(self.path, f"has a weight_scale of shape {list(scale.shape)} for {layer} "
                                             f"{list(shape)}: an int8 layer's is one per row ([{shape[0]}, 1]) "
                                             "or one in all.", _FIX)
        if rotation and not (int8_rows.is_rotation(rotation) and shape[1] % rotation == 0):
            raise CheckpointError(self.path, f"rotates {layer} (ConvRot) in groups of {rotation}, which is not a "
                                             f"power of 4 dividing its {shape[1]} inputs.", _FIX)
        return scale.contiguous(), rotation

    def keys(self):
        return list(self._keys)

    def shape(self, key) -> tuple:
        return self.file.shape(key)

    def dtype(self, key) -> torch.dtype:
        return torch.float32 if key in self.scales or key in self.rows else self.file.dtype(key)

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
        row_scale, rotation = o.rows.get(key, (None, 0))
        t = GGUFTensor(_TYPE_NAMES[f.dtype(key)], tuple(f.shape(key)), data, o.scales.get(key), row_scale, rotation)
        self[key] = t
        return t

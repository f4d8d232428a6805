"""A GGUF transformer file, as ComfyUI-GGUF's converter writes Z-Image (architecture ``lumina2``,
ComfyUI's key names, optionally behind ``model.diffusion_model.``), read with the ``gguf`` package
(imported here only, where a GGUF file is read) and memory-mapped: each tensor is its stored bytes
(a quantized one its blocks, ``quants``) and its shape in torch's order, read when asked."""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

from . import int8_rows, quants
from .errors import CheckpointError
from .ram import read_mapped
from .safetensors_file import FileChanged, read_pieces

ARCHITECTURES = ("lumina2",)    # what ComfyUI-GGUF's converter names a Z-Image (Lumina 2 family) file
PREFIX = "model.diffusion_model."
# stored types that need no dequantization, only a cast (F8_E4M3: a scaled fp8 file's, ``comfy_quant``)
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}
_FIX = "Pick a Z-Image-Turbo GGUF (e.g. z_image_turbo-Q8_0.gguf) in models/diffusion_models."


@dataclass(frozen=True)
class GGUFTensor:
    type_name: str        # GGML's name of its type: F32, F16, BF16, Q8_0, Q4_K, ... (or F8_E4M3, I8)
    shape: tuple          # in torch's order
    data: torch.Tensor    # its bytes (uint8), a view of the file's mapping
    scale: float | None = None  # a scaled fp8 weight's per-tensor scale (``comfy_quant``)
    row_scale: torch.Tensor | None = None  # an I8 weight's float32 scales, [rows, 1] or 0-d (``int8_rows``)
    rotation: int = 0     # an I8 weight's ConvRot group size (0: not rotated)

    def values(self, dtype=torch.float32) -> torch.Tensor:
        """The weights, dequantized (or cast, and scaled as ComfyUI scales them) to ``dtype``,
        where ``data`` lives."""
        if self.type_name == "I8":
            return int8_rows.dequantize(self.codes(), self.row_scale.to(self.data.device), self.rotation, dtype)
        if self.type_name in PLAIN:
            values = self.data.view(PLAIN[self.type_name]).reshape(self.shape).to(dtype)
            return values if self.scale is None else values * self.scale_in(dtype)
        return quants.dequantize(self.data, self.type_name, self.shape, dtype)

    def codes(self) -> torch.Tensor:
        """An I8 weight's codes, int8 [rows, inputs]: a view of ``data``."""
        return self.data.view(torch.int8).view(self.shape)

    def scale_in(self, dtype) -> float:
        """The scale rounded to ``dtype``: ComfyUI multiplies ``weight.to(dtype) * scale.to(dtype)``,
        and a tensor times this float rounds the product once, as that does."""
        return float(torch.tensor(self.scale, dtype=torch.float32).to(dtype))


def _field(reader, name):
    """A scalar string field's value, or None."""
    field = reader.get_field(name)
    if field is None:
        return None
    return bytes(field.parts[field.data[-1]]).decode("utf-8", errors="replace")


def _shape(reader, tensor) -> tuple:
    """ComfyUI-GGUF's recorded original shape where it wrote one, else the file's (GGML lists the
    fastest dimension first: torch's order reversed)."""
    field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
    if field is not None:
        return tuple(int(field.parts[i][0]) for i in field.data)
    return tuple(int(v) for v in reversed(tensor.shape))


def read_gguf(path) -> dict:
    """{canonical key: GGUFTensor} of a Z-Image GGUF file; a ``CheckpointError`` naming what is
    wrong for a file that is truncated, not GGUF, of another architecture, or holds a type the
    pack cannot dequantize."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(path, "is a GGUF file, and reading one needs the gguf package, which is not "
                                    "installed.", "Install it into ComfyUI's Python: python -m pip install gguf") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy: the mapping is read-only by design
            reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise CheckpointError(path, f"cannot be read as GGUF ({e}): it is damaged or truncated (an "
                                    "interrupted download?).", "Download it again.") from None
    arch = _field(reader, "general.architecture")
    if arch is not None and arch not in ARCHITECTURES:
        raise CheckpointError(path, f"is a GGUF of architecture {arch!r}, not a Z-Image transformer.", _FIX)
    prefixed = any(t.name.startswith(PREFIX) for t in reader.tensors)
    out = {}
    for t in reader.tensors:
        if prefixed and not t.name.startswith(PREFIX):
            continue
        type_name = getattr(t.tensor_type, "name", str(t.tensor_type))
        if type_name not in PLAIN and type_name not in quants.TYPES:
            readable = ", ".join([*PLAIN, *quants.TYPES])
            raise CheckpointError(path, f"stores {t.name} as {type_name}, which this pack cannot dequantize "
                                        f"(it reads {readable}).", "Use a file of one of those types.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: the array is not writable (a read-only mapping)
            data = torch.from_numpy(t.data.reshape(-1).view("uint8"))
        if data.numel() != int(t.n_bytes):
            raise CheckpointError(path, f"ends inside {t.name}: it is truncated (an interrupted download?).",
                                  "Download it again.")
        out[t.name[len(PREFIX):] if prefixed else t.name] = GGUFTensor(type_name, _shape(reader, t), data)
    return out


class GGUFFile:
    """A GGUF file as a ``Checkpoint`` reads its files (``SafetensorsFile``'s face): keys, shapes,
    dtypes (float32 for a quantized tensor: what it dequantizes to) and reads. Its tensors are views
    of the file's mapping: before each read the file is checked against the size and modification
    time it had when it was opened (a file rewritten under a mapping would kill the process)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointError(path, "does not exist.", "Check the file name and the models folder.")
        st = os.stat(self.path)
        self._identity = (st.st_size, st.st_mtime_ns)
        self.tensors = read_gguf(self.path)

    def keys(self):
        return list(self.tensors)

    def shape(self, key) -> tuple:
        return self.tensors[key].shape

    def dtype(self, key) -> torch.dtype:
        return PLAIN.get(self.tensors[key].type_name, torch.float32)

    def check_unchanged(self):
        st = os.stat(self.path)
        if (st.st_size, st.st_mtime_ns) != self._identity:
            raise FileChanged(self.path, "changed on disk after it was loaded (its size or modification time "
                                         "differ).", "Load the model again once the file is complete "
                                                     "(e.g. after a download has finished).")

    def read_into(self, key, out: torch.Tensor, first: int = 0):
        """Tensor ``key``'s values (dequantized, cast to ``out``'s dtype) into ``out``, from element
        ``first`` on, as many as ``out`` holds."""
        self.check_unchanged()
        values = self.tensors[key].values(out.dtype).reshape(-1)
        out.view(-1).copy_(values[first:first + out.numel()])

    def mapped(self, key):
        return None  # the fixed part is read into tensors of its own (dequantized where quantized)

    def stored(self, key) -> "StoredGGUF":
        return StoredGGUF(self, key)

    def close(self):
        self.tensors = {}


class StoredGGUF:
    """One tensor of a GGUF file, read on demand (``StoredTensor``'s face)."""

    def __init__(self, file: GGUFFile, key: str):
        self.file, self.key = file, key
        self.tensor = file.tensors[key]
        self.shape, self.dtype = file.shape(key), file.dtype(key)

    def read_into(self, out: torch.Tensor, first: int = 0):
        self.file.read_into(self.key, out, first)

    def cache_parts(self) -> list:
        """Its bytes as reads that bring them into the page cache (``SafetensorsFile.cache_parts``):
        its pages in the file's mapping faulted in, a piece at a time."""
        return [(n, functools.partial(self._cache, a, n)) for a, n in read_pieces(self.tensor.data.numel())]

    def _cache(self, start, nbytes, _scratch):
        self.file.check_unchanged()  # pages past a truncated file's end are not read
        read_mapped(self.tensor.data.data_ptr() + start, nbytes)

    def drop(self):
        pass  # the mapping's pages go when the kernel needs them

"""Memory-mapped safetensors reading with errors that name the file and the problem.

The header is parsed here (it is 8 bytes of length and a JSON table) so that a truncated
or foreign file is reported before any tensor is touched, and tensors are zero-copy views
of a private file mapping: nothing is read until it is used, and nothing is copied twice.
"""
from __future__ import annotations

import json
import mmap
import os
import struct

import torch

from .errors import CheckpointError

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}
_FIX_FORMAT = "Use a .safetensors export of Z-Image-Turbo (ComfyUI or diffusers layout)."


class SafetensorsFile:
    def __init__(self, path):
        self.path = os.fspath(path)
        if not self.path.endswith((".safetensors", ".sft")):
            raise CheckpointError(path, "is not a .safetensors file; only safetensors are loaded.", _FIX_FORMAT)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(path, "is empty or truncated (no safetensors header).", _FIX_FORMAT)
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, 100 << 20):
                    raise CheckpointError(path, "is not a safetensors file (bad header length).", _FIX_FORMAT)
                header = json.loads(f.read(n))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
        except FileNotFoundError:
            raise CheckpointError(path, "does not exist.", "Check the file name and the models folder.") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(path, "is not a safetensors file (header is not JSON).", _FIX_FORMAT) from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.entries = {}
        end = 0
        for key, e in header.items():
            if not isinstance(e, dict) or "dtype" not in e or "data_offsets" not in e:
                raise CheckpointError(path, f"has a malformed header entry for {key!r}.", _FIX_FORMAT)
            end = max(end, e["data_offsets"][1])
            self.entries[key] = e
        if self._base + end > size:
            missing = self._base + end - size
            raise CheckpointError(path, f"is truncated: {missing:,} bytes of tensor data are missing "
                                        f"({size:,} of {self._base + end:,} bytes present).",
                                  "Download or copy the file again.")

    def keys(self):
        return self.entries.keys()

    def shape(self, key) -> tuple:
        return tuple(self.entries[key]["shape"])

    def dtype(self, key) -> torch.dtype:
        name = self.entries[key]["dtype"]
        if name not in DTYPES:
            raise CheckpointError(self.path, f"stores {key!r} as {name}, which is not supported.",
                                  "Supported storage: bf16, fp16, fp32, fp8 e4m3fn.")
        return DTYPES[name]

    def tensor(self, key) -> torch.Tensor:
        """A zero-copy view into the mapped file."""
        e = self.entries[key]
        dtype = self.dtype(key)
        start, stop = e["data_offsets"]
        shape = tuple(e["shape"])
        if stop == start:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                offset=self._base + start)
        return flat.view(shape)

    def close(self):
        self.entries = {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views still alive keep the mapping; it goes with them
                pass
            self._map = None

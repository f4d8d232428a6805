"""safetensors reading with errors that name the file and the problem.

The header is parsed and validated here, check for check as the ``safetensors`` library does
(a JSON object of entries with a known dtype, a shape of non-negative integers, and offsets that
tile the data section exactly), so a truncated, foreign or malformed file is reported before any
tensor is touched, in one line that says what to do.

Tensors are read with ``pread`` straight into the buffer that keeps them (a pinned host master,
a staging buffer), not through a memory mapping: a mapped file that is truncated or rewritten
in place while it is loaded kills the process with SIGBUS on the next touch of the CPU, and an
interrupted re-download leaves exactly such a file. Before every read the open file is checked
against the size and modification time it had when it was opened; a file changed since then is
an error. The one exception is ``mapped``: views whose pages are locked in place for the GPU to
read (the transformer's fixed part), which the CPU does not read after the lock.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import mmap
import os
import struct
import threading
import warnings

import torch

from .errors import CheckpointError
from .ram import in_page_cache

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,  # ComfyUI's int8_tensorwise layers' codes (``comfy_quant``; refused elsewhere)
}
# every storage type of the safetensors format, with its size: a tensor of a type the pack does
# not run is still checked for size, and refused only when the model uses it
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}
MAX_HEADER = 100 << 20  # the safetensors library's limit
# A large read is split over a few threads: one thread copying from the page cache reaches about
# a third of what a machine's memory bandwidth allows (the mapped reads this replaced were copied
# by torch's own threads). The reads release the GIL.
READ_PIECE = 8 << 20
_READERS = min(8, os.cpu_count() or 1)
_pool = None
_FIX_FORMAT = "Use a .safetensors export of Z-Image-Turbo (ComfyUI or diffusers layout)."
_FIX_COPY = "Download or copy the file again."


def read_pieces(nbytes: int) -> list:
    """(start, bytes) of the pieces a read of ``nbytes`` is cut into."""
    return [(a, min(READ_PIECE, nbytes - a)) for a in range(0, nbytes, READ_PIECE)]


class FileChanged(CheckpointError):
    """The file on disk is no longer the one that was loaded."""


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsFile:
    def __init__(self, path):
        self.path = os.fspath(path)
        if not self.path.endswith((".safetensors", ".sft")):
            raise CheckpointError(path, "is not a .safetensors file; only safetensors are loaded.", _FIX_FORMAT)
        self._file = None
        try:
            self._file = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(path, "does not exist.", "Check the file name and the models folder.") from None
        except IsADirectoryError:
            raise CheckpointError(path, "is a folder, not a file.", _FIX_FORMAT) from None
        except OSError as e:  # no permission, a link loop, a disk error
            raise CheckpointError(path, f"cannot be read: {e.strerror or e}.",
                                  "Check that the user ComfyUI runs as may read it (its permissions and owner) "
                                  "and that the disk is healthy.") from None
        self._lock = threading.Lock()  # the mapping's making; seek + read where the OS has no positional read (Windows)
        self._map = None  # the file's bytes, mapped read-only on the first ``mapped``
        try:
            st = os.fstat(self._file.fileno())
            self._identity = (st.st_size, st.st_mtime_ns)
            self.entries, self.metadata, self._base = self._read_header(st.st_size)
        except BaseException:
            self.close()
            raise

    def _read_header(self, size):
        head = bytearray(8)
        if self._pread_one(memoryview(head), 0) < 8:
            raise CheckpointError(self.path, "is empty or truncated (no safetensors header).", _FIX_FORMAT)
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise CheckpointError(self.path, "is not a safetensors file (bad header length).", _FIX_FORMAT)
        raw = bytearray(n)
        self._pread_one(memoryview(raw), 8)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise CheckpointError(self.path, "is not a safetensors file (header is not JSON).", _FIX_FORMAT) from None
        if not isinstance(header, dict):
            raise CheckpointError(self.path, "is not a safetensors file (its header is not a JSON object).",
                                  _FIX_FORMAT)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CheckpointError(self.path, "has a malformed header (__metadata__ is not an object).", _FIX_FORMAT)
        spans = []
        for key, e in header.items():
            spans.append(self._check_entry(key, e) + (key,))
        # the tensors must tile the data section: no gaps, no overlaps, nothing missing or extra
        spans.sort()
        end = 0
        for start, stop, key in spans:
            if start != end:
                raise CheckpointError(self.path, f"has a malformed header: the data of {key!r} starts at byte "
                                                 f"{start:,} where {end:,} was expected (overlapping or "
                                                 "misplaced tensors).", _FIX_FORMAT)
            end = stop
        present = size - 8 - n
        if end > present:
            raise CheckpointError(self.path, f"is truncated: {end - present:,} bytes of tensor data are missing "
                                             f"({size:,} of {8 + n + end:,} bytes present).", _FIX_COPY)
        if end < present:
            raise CheckpointError(self.path, f"has {present - end:,} bytes after its last tensor; it is not a "
                                             "complete safetensors file.", _FIX_COPY)
        return header, metadata, 8 + n

    def _check_entry(self, key, e):
        def bad(what):
            return CheckpointError(self.path, f"has a malformed header entry for {key!r}: {what}.", _FIX_FORMAT)

        if not isinstance(e, dict):
            raise bad("it is not an object")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad("no dtype")
        if dtype not in _ITEMSIZE:
            raise bad(f"unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
            raise bad("its shape is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise bad("its data_offsets are not two non-negative integers in order")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"its data_offsets span {offsets[1] - offsets[0]:,} bytes, but a {dtype} tensor of shape "
                      f"{shape} has {nbytes:,}")
        return offsets[0], offsets[1]

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

    def _pread_one(self, view, offset) -> int:
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            else:
                with self._lock:
                    self._file.seek(offset + done)
                    got = self._file.readinto(view[done:])
            if not got:
                break
            done += got
        return done

    def check_unchanged(self):
        """Raise ``FileChanged`` when the file is not the one that was opened (rewritten, truncated)."""
        if self._file is None:
            raise CheckpointError(self.path, "was closed (the model was released).", "Load the model again.")
        st = os.fstat(self._file.fileno())
        if (st.st_size, st.st_mtime_ns) != self._identity:
            raise FileChanged(self.path, "changed on disk after it was loaded (its size or modification time "
                                         "differ).", "Load the model again once the file is complete "
                                                     "(e.g. after a download has finished).")

    def read_into(self, key, out: torch.Tensor):
        """Read tensor ``key`` into ``out``: a contiguous host tensor of its shape, in its stored
        dtype or any other (then it is cast)."""
        read_many([(self.stored(key), out)])

    def raw(self, key) -> bytes:
        """Tensor ``key``'s stored bytes, whatever its dtype (a quant config stored as U8)."""
        self.check_unchanged()
        start, stop = self.entries[key]["data_offsets"]
        buf = bytearray(stop - start)
        if self._pread_one(memoryview(buf), self._base + start) != len(buf):
            raise CheckpointError(self.path, f"ends inside {key}: it is truncated.", _FIX_COPY)
        return bytes(buf)

    def _span(self, key) -> tuple:
        """(offset in the file, bytes) of tensor ``key``."""
        start, stop = self.entries[key]["data_offsets"]
        return self._base + start, stop - start

    def cache_parts(self, key) -> list:
        """Tensor ``key``'s bytes as reads that bring them into the page cache (``read_ahead``):
        [(bytes, read(scratch))], each of at most ``READ_PIECE`` bytes, read into ``scratch`` (a
        bytearray of ``READ_PIECE``) and skipped where its pages are cached already."""
        offset, nbytes = self._span(key)
        return [(n, functools.partial(self._cache, offset + a, n)) for a, n in read_pieces(nbytes)]

    def _cache(self, offset, nbytes, scratch):
        if self._file is None:
            return
        if not in_page_cache(self._mapping().data_ptr() + offset, nbytes):
            self._pread_one(memoryview(scratch)[:nbytes], offset)

    def drop(self, key):
        """Tensor ``key``'s bytes leave the page cache (a copy of them is held elsewhere); a no-op
        where the OS takes no such hint."""
        if self._file is not None and hasattr(os, "POSIX_FADV_DONTNEED"):
            os.posix_fadvise(self._file.fileno(), *self._span(key), os.POSIX_FADV_DONTNEED)

    def _mapping(self) -> torch.Tensor:
        """The whole file, mapped read-only (mapping reads nothing); made once, by whichever thread
        asks first (the reads ahead ask too)."""
        with self._lock:
            if self._map is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch warns that the buffer is not writable: by design
                    self._map = torch.frombuffer(mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ),
                                                 dtype=torch.uint8)
            return self._map

    def mapped(self, key) -> torch.Tensor | None:
        """Tensor ``key`` as a read-only view of the file's pages (no copy, no read yet), or None where
        its offset does not allow a view of its dtype. Never write into it."""
        self.check_unchanged()
        start, stop = self.entries[key]["data_offsets"]
        dtype = self.dtype(key)
        if (self._base + start) % dtype.itemsize:
            return None
        return self._mapping()[self._base + start:self._base + stop].view(dtype).view(self.shape(key))

    def stored(self, key) -> "StoredTensor":
        return StoredTensor(self, key)

    def tensor(self, key) -> torch.Tensor:
        """Tensor ``key`` as a fresh host tensor in its stored dtype."""
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        self.read_into(key, out)
        return out

    def close(self):
        self.entries = {}
        self._map = None  # the mapping itself goes with the last view of it
        if self._file is not None:
            self._file.close()
        self._file = None


def read_many(items):
    """Read [(StoredTensor, out)] or [(StoredTensor, out, first)] as ``read_into`` does (``first``:
    ``out`` gets the tensor's elements from that one on, as many as it holds), all of them at once:
    every piece of every tensor goes to the reader threads together, so a layer's five matrices
    are read in parallel rather than one after the other."""
    global _pool
    jobs, casts = [], []  # (file, view, offset, key); (tensor read, destination)
    for st, out, *first in items:
        if not isinstance(st, StoredTensor):  # another format's tensor (a GGUF's): it reads itself
            st.read_into(out, *first)
            continue
        f, key = st.file, st.key
        dtype = f.dtype(key)
        if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            target = torch.empty(out.shape, dtype=dtype)
            casts.append((target, out))
        else:
            target = out
        start, stop = f.entries[key]["data_offsets"]
        start += (first[0] if first else 0) * dtype.itemsize
        stop = min(stop, start + target.numel() * dtype.itemsize)
        f.check_unchanged()
        view = memoryview(target.view(-1).view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        jobs += [(f, view[a:a + n], f._base + start + a, key) for a, n in read_pieces(stop - start)]
    if len(jobs) > 1 and _READERS > 1 and hasattr(os, "preadv"):
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix="zimage-read")
        got = list(_pool.map(lambda j: j[0]._pread_one(j[1], j[2]), jobs))
    else:
        got = [f._pread_one(view, offset) for f, view, offset, _ in jobs]
    for (f, view, _, key), n in zip(jobs, got):
        if n < len(view):
            raise FileChanged(f.path, f"ended while {key!r} was read: it was truncated after it was loaded.",
                              "Load the model again once the file is complete.")
    for target, out in casts:
        out.copy_(target)


class StoredTensor:
    """One tensor of a file, read on demand: what a host master or an upload is filled from."""

    def __init__(self, file: SafetensorsFile, key: str):
        self.file, self.key = file, key
        self.shape, self.dtype = file.shape(key), file.dtype(key)

    def read_into(self, out: torch.Tensor):
        self.file.read_into(self.key, out)

    def cache_parts(self) -> list:
        return self.file.cache_parts(self.key)

    def drop(self):
        """Its bytes leave the page cache: a pinned master holds them, and the RAM is better spent on
        bytes that are read again (the text encoder's, the resident layers')."""
        self.file.drop(self.key)

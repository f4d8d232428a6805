"""Lossless compression of a packed bf16 layer: fewer bytes over the bus, the same bits in the slot.

In a trained network's bf16 weights the high byte (sign and the top 7 bits of the exponent) takes
few values: the magnitudes of one layer span a few binades. So each weight is stored as

- its low byte as it is (the exponent's last bit and the 7 mantissa bits), and
- a 4-bit code for its high byte: the sign and the offset of the exponent's top 7 bits from the
  layer's ``base``, for the 8 values from ``base`` on (16 binades);
- the weights outside those binades (zeros, tiny values, outliers) as exceptions: their position
  and high byte, written over the decoded high byte.

That is 12 bits a weight plus 5 bytes an exception: 0.75 of bf16 when exceptions are rare. A fixed
width code keeps the decode a handful of elementwise byte operations (no table, no bit stream), so
the device decodes with torch's own kernels, no extra dependency, and the CPU runs the same code.

The format is chunked like the staging ring (``CHUNK`` elements a chunk), so a chunk's compressed
bytes can be uploaded into a small device buffer and decoded into its part of the slot while the
next chunk crosses the bus. ``encode`` runs once, when a layer gets its host master.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 32 << 20  # elements of one chunk (64 MiB of bf16, as a staging buffer)
EXCEPTION_BYTES = 5  # an int32 position and the high byte


@dataclass(frozen=True)
class Chunk:
    """Where one chunk's parts lie in its layer's compressed buffer (byte offsets) and their sizes."""
    start: int    # first element of the chunk in the layer
    numel: int
    offset: int   # bytes: codes (ceil(numel / 2)), low bytes (numel), positions (4 * n_exc), high bytes (n_exc)
    n_exc: int

    @property
    def nbytes(self) -> int:
        return compressed_bytes(self.numel, self.n_exc)


def _align4(n: int) -> int:
    return -(-n // 4) * 4


def _head(numel: int) -> int:
    """Bytes of a chunk's codes and low bytes: the positions after them start on a 4-byte boundary,
    so that they can be viewed as int32 in place."""
    return _align4(numel + (numel + 1) // 2)


def compressed_bytes(numel: int, n_exc: int) -> int:
    return _align4(_head(numel) + EXCEPTION_BYTES * n_exc)  # the next chunk starts aligned too


@dataclass(frozen=True)
class Layout:
    """A compressed layer: its base, its chunks, and the size of its buffer."""
    base: int
    chunks: tuple
    numel: int

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def _split(t: torch.Tensor):
    """A bf16 tensor's (low bytes, high bytes): little-endian byte pairs."""
    pairs = t.view(torch.uint8).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def choose_base(flat: torch.Tensor) -> int:
    """The base whose 8 exponent-top values cover the most weights of ``flat`` (bf16)."""
    hist = torch.zeros(128, dtype=torch.int64)
    for start in range(0, flat.numel(), CHUNK):
        _, hi = _split(flat[start:start + CHUNK])
        hist += torch.bincount((hi & 0x7F).to(torch.int64), minlength=128).cpu()
    covered = torch.stack([hist[b:b + 8].sum() for b in range(121)])
    return int(covered.argmax())


def _codes(hi: torch.Tensor, base: int):
    """(4-bit codes, the exceptions' mask) of high bytes ``hi``."""
    offset = (hi & 0x7F).to(torch.int16) - base
    inside = (offset >= 0) & (offset <= 7)
    codes = ((hi >> 7) << 3) | torch.where(inside, offset, 0).to(torch.uint8)
    return codes, ~inside


def plan(flat: torch.Tensor, base: int | None = None) -> Layout:
    """The compressed layout of ``flat`` (a bf16 host tensor): its base and each chunk's exceptions."""
    base = choose_base(flat) if base is None else base
    chunks, offset = [], 0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        _, hi = _split(part)
        n_exc = int(_codes(hi, base)[1].sum())
        c = Chunk(start, part.numel(), offset, n_exc)
        chunks.append(c)
        offset += c.nbytes
    return Layout(base, tuple(chunks), flat.numel())


def encode(flat: torch.Tensor, layout: Layout, out: torch.Tensor):
    """Write ``flat`` (bf16, host) compressed into ``out`` (uint8, ``layout.nbytes``)."""
    for c in layout.chunks:
        lo, hi = _split(flat[c.start:c.start + c.numel])
        codes, exc = _codes(hi, layout.base)
        parts = views(out[c.offset:c.offset + c.nbytes], c)
        if c.numel % 2:
            codes = torch.cat((codes, codes.new_zeros(1)))
        pairs = codes.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=parts["codes"])
        parts["low"].copy_(lo)
        where = exc.nonzero().view(-1)
        parts["positions"].copy_(where.to(torch.int32))
        parts["high"].copy_(hi[where])


def views(buf: torch.Tensor, c: Chunk) -> dict:
    """Chunk ``c``'s parts in ``buf``: its compressed bytes, from the chunk's first byte on."""
    n_codes = (c.numel + 1) // 2
    at = _head(c.numel)
    return {"codes": buf[:n_codes], "low": buf[n_codes:n_codes + c.numel],
            "positions": buf[at:at + 4 * c.n_exc].view(torch.int32),
            "high": buf[at + 4 * c.n_exc:at + EXCEPTION_BYTES * c.n_exc]}


def decode(src: torch.Tensor, c: Chunk, base: int, dst: torch.Tensor):
    """Chunk ``c`` from ``src`` (its compressed bytes from the chunk's first on, on ``dst``'s
    device) into ``dst`` (bf16, ``c.numel`` elements): the bits it was encoded from, on any device."""
    parts = views(src, c)
    lo, hi = _split(dst)
    lo.copy_(parts["low"])
    codes = parts["codes"]
    both = torch.stack((codes & 0x0F, codes >> 4), dim=-1).view(-1)[:c.numel]
    torch.bitwise_or((both & 8) << 4, (both & 7) + base, out=hi)
    if c.n_exc:
        hi[parts["positions"].to(torch.int64)] = parts["high"]

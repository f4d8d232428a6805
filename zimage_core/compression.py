"""Lossless compression of a packed bf16 layer: fewer bytes over the bus, the same bits in the slot.

In a trained network's bf16 weights the high byte (sign and the top 7 bits of the exponent) takes
few values: the magnitudes of one layer span a few binades. So each weight is stored as

- its low byte as it is (the exponent's last bit and the 7 mantissa bits), and
- a 4-bit code for its high byte: the sign and the offset of the exponent's top 7 bits from the
  layer's ``base``, for the 8 values from ``base`` on (16 binades);
- the weights outside those binades (zeros, tiny values, outliers) as exceptions: their position
  and high byte, written over the decoded high byte.

That is 12 bits a weight plus 5 bytes an exception: 0.75 of bf16 when exceptions are rare. A fixed
width code keeps the decode a handful of elementwise byte operations (no table, no bit stream): a
CUDA device runs them in two Triton kernels over a run of chunks (``triton_decode``), the CPU as
torch ops.

The format is chunked (``CHUNK`` elements a chunk, each with its own base), so a chunk's compressed
bytes can be uploaded into a small device buffer and decoded into its part of the slot while the
next chunk crosses the bus. ``encode`` runs once a chunk, when a layer gets its host master, on the
device that computes (a CPU takes seconds a layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import triton_decode
from .device_check import triton_check
from .device_timing import device_seconds

CHUNK = 8 << 20  # elements of one chunk (16 MiB of bf16): a chunk is the unit of a base and of encoding
# bytes of one upload of consecutive chunks, decoded in one launch: few launches a layer (each
# takes tens of microseconds of the CPU, on the upload thread beside the one queuing the step)
GROUP_BYTES = 64 << 20
# device buffers of ``GROUP_BYTES`` the runs cross into in turn. A run's copy waits until the decode
# from its buffer is done, and a decode can wait for SMs behind the step's kernels: with two the
# copies of a 7.5 GiB card's step ran at 53.4 GB/s beside 54.7 for a plain copy, with three at 54.3-55.0
BUFFERS = 3
EXCEPTION_BYTES = 5  # an int32 position and the high byte
# a layer is stored compressed only if no chunk has more exceptions than this fraction of its
# weights: its host buffer is sized for that before it is encoded (0.775 of bf16 at most)
EXCEPTIONS = 0.01


@dataclass(frozen=True)
class Chunk:
    """Where one chunk lies in its layer (elements) and in the layer's compressed buffer (bytes)."""
    start: int    # first element of the chunk in the layer
    numel: int
    offset: int   # bytes: codes (ceil(numel / 2)), low bytes (numel), positions (4 * n_exc), high bytes (n_exc)
    n_exc: int
    base: int     # the exponents' top 7 bits that code 0 stands for

    @property
    def nbytes(self) -> int:
        return compressed_bytes(self.numel, self.n_exc)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def _low(numel: int) -> int:
    """Offset of a chunk's low bytes: after its codes, on a 16-byte boundary."""
    return _align16((numel + 1) // 2)


def _head(numel: int) -> int:
    """Bytes of a chunk's codes and low bytes. Every part starts on a 16-byte boundary, so that the
    device reads them in wide loads and the positions can be viewed as int32 in place."""
    return _align16(_low(numel) + numel)


def compressed_bytes(numel: int, n_exc: int) -> int:
    return _align16(_head(numel) + EXCEPTION_BYTES * n_exc)  # the next chunk starts aligned too


def pieces(numel: int) -> list:
    """[(start, numel)] of a layer's chunks."""
    return [(start, min(CHUNK, numel - start)) for start in range(0, numel, CHUNK)]


def max_exceptions(numel: int) -> int:
    return int(numel * EXCEPTIONS)


def bound(numel: int) -> int:
    """Bytes of a compressed layer of ``numel`` weights whose chunks stay within ``EXCEPTIONS``."""
    return sum(compressed_bytes(n, max_exceptions(n)) for _, n in pieces(numel))


def expected(numel: int) -> int:
    """Bytes a compressed layer of ``numel`` weights is expected to take: without exceptions, which
    are rare (0.02% of the realistic random weights; trained ones have as few), 0.750 of bf16, where
    ``bound`` (0.775) sizes the buffer before it is encoded."""
    return sum(compressed_bytes(n, 0) for _, n in pieces(numel))


def _split(t: torch.Tensor):
    """A bf16 tensor's (low bytes, high bytes): little-endian byte pairs."""
    pairs = t.view(torch.uint8).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _codes(hi: torch.Tensor, base: int):
    """(4-bit codes, the exceptions' mask) of high bytes ``hi``."""
    offset = (hi & 0x7F).to(torch.int16) - base
    inside = (offset >= 0) & (offset <= 7)
    codes = ((hi >> 7) << 3) | torch.where(inside, offset, 0).to(torch.uint8)
    return codes, ~inside


def encode(part: torch.Tensor) -> tuple:
    """(base, exceptions, compressed bytes) of one chunk ``part`` (bf16, on any device; the bytes
    on the same device). The base is the one whose 8 exponent-top values cover the most weights."""
    lo, hi = _split(part)
    hist = torch.bincount((hi & 0x7F).to(torch.int32), minlength=128)
    base = int(hist.unfold(0, 8, 1).sum(1).argmax())
    codes, exc = _codes(hi, base)
    where = exc.nonzero().view(-1)
    out = torch.empty(compressed_bytes(part.numel(), where.numel()), dtype=torch.uint8, device=part.device)
    c = Chunk(0, part.numel(), 0, where.numel(), base)
    parts = views(out, c)
    if c.numel % 2:
        codes = torch.cat((codes, codes.new_zeros(1)))
    pairs = codes.view(-1, 2)
    torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=parts["codes"])
    parts["low"].copy_(lo)
    parts["positions"].copy_(where.to(torch.int32))
    parts["high"].copy_(hi[where])
    return base, where.numel(), out


def views(buf: torch.Tensor, c: Chunk) -> dict:
    """Chunk ``c``'s parts in ``buf``: its compressed bytes, from the chunk's first byte on."""
    n_codes, low = (c.numel + 1) // 2, _low(c.numel)
    at = _head(c.numel)
    return {"codes": buf[:n_codes], "low": buf[low:low + c.numel],
            "positions": buf[at:at + 4 * c.n_exc].view(torch.int32),
            "high": buf[at + 4 * c.n_exc:at + EXCEPTION_BYTES * c.n_exc]}


def decode(src: torch.Tensor, c: Chunk, dst: torch.Tensor):
    """Chunk ``c`` from ``src`` (its compressed bytes from the chunk's first on, on ``dst``'s
    device) into ``dst`` (bf16, ``c.numel`` elements): the bits it was encoded from. The reference
    decode, in torch ops on any device; a CUDA device decodes runs of chunks (``decode_run``)."""
    parts = views(src, c)
    lo, hi = _split(dst)
    lo.copy_(parts["low"])
    codes = parts["codes"]
    both = torch.stack((codes & 0x0F, codes >> 4), dim=-1).view(-1)[:c.numel]
    torch.bitwise_or((both & 8) << 4, (both & 7) + c.base, out=hi)
    if c.n_exc:
        hi[parts["positions"].to(torch.int64)] = parts["high"]


def groups(chunks) -> list:
    """A layer's chunks in runs of consecutive ones of at most ``GROUP_BYTES`` together: a run is
    one copy into a device buffer and one decode."""
    runs, run, size = [], [], 0
    for c in chunks:
        if run and size + c.nbytes > GROUP_BYTES:
            runs.append(tuple(run))
            run, size = [], 0
        run.append(c)
        size += c.nbytes
    return runs + [tuple(run)] if run else runs


def table(run, device) -> torch.Tensor:
    """The device's description of a run of chunks (``triton_decode``): a row a chunk of its
    offset in the run's bytes, weights, base, first weight in the layer, exceptions, and the
    offsets of its exceptions' positions and of its low bytes in the run's bytes."""
    first = run[0].offset
    return torch.tensor([[c.offset - first, c.numel, c.base, c.start, c.n_exc,
                          c.offset - first + _head(c.numel), c.offset - first + _low(c.numel)]
                         for c in run], dtype=torch.int64).to(device)


def decode_run(src: torch.Tensor, run, dst: torch.Tensor, rows: torch.Tensor | None = None):
    """A run of chunks from ``src`` (its bytes, from the run's first) into the layer ``dst``; on a
    CUDA device in two kernel launches, given the run's ``table`` (``rows``) there."""
    if dst.is_cuda:
        rows = table(run, dst.device) if rows is None else rows
        triton_decode.decode(src, rows, max(c.numel for c in run), max(c.n_exc for c in run), dst,
                             aligned=all(c.start % 16 == 0 and c.numel % 16 == 0 for c in run))
        return
    first = run[0].offset
    for c in run:
        decode(src[c.offset - first:c.offset - first + c.nbytes], c, dst[c.start:c.start + c.numel])


def encode_all(flat: torch.Tensor) -> tuple:
    """(chunks, their compressed bytes one after the other) of a whole tensor, on its device."""
    chunks, parts, offset = [], [], 0
    for start, n in pieces(flat.numel()):
        base, n_exc, packed = encode(flat[start:start + n])
        chunks.append(Chunk(start, n, offset, n_exc, base))
        parts.append(packed)
        offset += packed.numel()
    return tuple(chunks), torch.cat(parts)


def decode_all(chunks, packed: torch.Tensor, dst: torch.Tensor):
    """Every chunk from ``packed`` (all their bytes) into ``dst``: one run on any device."""
    decode_run(packed, chunks, dst)


def decode_seconds(chunks, packed: torch.Tensor, dst: torch.Tensor, repeats: int = 3) -> float:
    """Seconds a CUDA device takes to decode ``chunks`` from ``packed`` into ``dst`` (both on it),
    as the streamer does (one run, its table made beforehand, outside the timing)."""
    rows = table(chunks, dst.device)
    return device_seconds(lambda: decode_run(packed, chunks, dst, rows), repeats)


def _decode_check(device: torch.device) -> str | None:
    """None where the device decode (``triton_decode``) gives back every bf16 bit pattern that was
    encoded on this CUDA device, else why not."""
    flat = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(device)
    chunks, packed = encode_all(flat)
    out = torch.empty_like(flat)
    decode_all(chunks, packed, out)
    return None if torch.equal(out.view(torch.int16), flat.view(torch.int16)) else "its decode did not give back the same bits"


# asked by the first plan that may compress; started early where a prompt for a model that will
# stream is encoded (``transformer.check_kernels_soon``)
decodes_on = triton_check(_decode_check, "compressed streaming", "layers stream as plain bf16", "zimage-decode-check")

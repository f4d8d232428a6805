"""A low-rank weight patch's elementwise part in one Triton launch: ``weight + scale * diff``, where
``diff`` is a LoRA's ``up @ down`` in float32 (a matrix product torch makes), with every rounding
of torch's separate ops.

ComfyUI computes a LoRA into a weight as a copy of the weight in its LoRA dtype (float32, or
float16 where the device computes in float16), the scaled product in that dtype, their sum, and the
sum rounded to the model's dtype: five passes over a full matrix, three of them in float32, and a
copy into the slot. A streamed layer is patched at every upload, so on an 8 GB card that was about
40 ms a step for a rank-16 LoRA on every matrix of the streamed layers. This kernel reads the weight
and the product once and writes the patched weight once, in place.

Each op of torch's sequence is kept: the copy rounded to the LoRA dtype, the product ``scale *
diff`` computed in float32 and rounded to it, the sum rounded to it, then to the output's dtype,
each to nearest even, with no two ops fused into one rounding (``enable_fp_fusion=False``). Whether
the kernel runs on a device is decided once per pair of dtypes (``runs_on``: it must give torch's
bits); elsewhere torch's ops run, with the same bits.
"""
from __future__ import annotations

import functools
import threading

import torch

from .device_check import DeviceCheck, triton_check

BLOCK = 2048  # elements a program writes
ROWS_BYTES = 64 << 20  # the float32 product of a band of rows (``add_products``)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_scaled(base, diff, out, scale, n, orig, flags, ROUND: tl.constexpr, INTER: tl.constexpr,
                   OUT_F32: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr):
        """out = base + scale * diff (``diff`` in float32), the copy of ``base``, the product and the
        sum each rounded to the LoRA dtype ``INTER`` where it is 16-bit (``ROUND``) as torch's ops round.
        With ``CHECK``: ``flags[0]`` is raised where a value written is not finite, ``flags[1]`` where
        one differs in its bits from ``orig`` (the weight before the patch, in ``out``'s dtype)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        if CHECK:
            o = tl.load(orig + i, mask=mask, other=0.0)  # before the store: ``orig`` may be ``out``
        b = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        p = scale * tl.load(diff + i, mask=mask, other=0.0)
        if ROUND:
            b = b.to(INTER, fp_downcast_rounding="rtne").to(tl.float32)
            p = p.to(INTER, fp_downcast_rounding="rtne").to(tl.float32)
            t = (b + p).to(INTER, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            t = b + p
        if OUT_F32:
            v = t
        else:
            v = t.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + i, v, mask=mask)
        if CHECK:
            bits = tl.int32 if OUT_F32 else tl.int16
            bad = mask & ~(tl.abs(v.to(tl.float32)) < float("inf"))
            changed = mask & (v.to(bits, bitcast=True) != o.to(bits, bitcast=True))
            tl.atomic_max(flags, tl.max(bad.to(tl.int32), axis=0))
            tl.atomic_max(flags + 1, tl.max(changed.to(tl.int32), axis=0))

    return add_scaled


@functools.cache
def _tl(dtype: torch.dtype):
    """Triton's dtype of one of ``DTYPES`` (same names)."""
    import triton.language as tl

    return getattr(tl, str(dtype).removeprefix("torch."))


def add_scaled(base: torch.Tensor, diff: torch.Tensor, scale: float, out: torch.Tensor, inter: torch.dtype,
               orig: torch.Tensor | None = None, flags: torch.Tensor | None = None):
    """``out`` = torch's ``t = base.to(inter, copy=True); t += (scale * diff).to(inter); t.to(out.dtype)``
    (ComfyUI's LoRA: ``diff`` the float32 product, ``inter`` its LoRA dtype), in one launch on the
    current stream. All three contiguous, of one shape, on one CUDA device; ``out`` may be ``base``
    (in place); ``scale`` a float32 value (as torch holds a Python scalar or a CPU one). With
    ``flags`` (int32, two zeros to start): ``flags[0]`` becomes 1 where a value of ``out`` is not
    finite, ``flags[1]`` where one differs in its bits from ``orig`` (``out``'s shape and dtype; it
    may be ``out``): a patch's first result is checked as it is written, with no copy to compare."""
    n = out.numel()
    if n:
        check = flags is not None
        _kernel()[(-(-n // BLOCK),)](base, diff, out, scale, n, orig if check else out, flags if check else out,
                                     ROUND=inter != torch.float32, INTER=_tl(inter),
                                     OUT_F32=out.dtype == torch.float32, CHECK=check, BLOCK=BLOCK,
                                     enable_fp_fusion=False)


def torch_add_scaled(base: torch.Tensor, diff: torch.Tensor, scale: float, out: torch.Tensor, inter: torch.dtype):
    """What ``add_scaled`` computes, in torch's ops (ComfyUI's order)."""
    t = base.to(inter, copy=True)
    t += (scale * diff).to(inter)
    out.copy_(t)


def launches(inter: torch.dtype, dtype: torch.dtype) -> list:
    """(weight's dtype, out's dtype) of every launch a patch of ``dtype`` weights in the LoRA dtype
    ``inter`` makes (``add_products``): one LoRA from the weight into its dtype; stacked ones from
    the weight into the LoRA dtype, then from and into it, the last back into the weight's dtype."""
    return list(dict.fromkeys([(dtype, dtype), (dtype, inter), (inter, inter), (inter, dtype)]))


def add_products(weight: torch.Tensor, terms, out: torch.Tensor, inter: torch.dtype,
                 flags: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` = ``weight`` patched by each of ``terms`` ((up, down, scale): a LoRA's ``up @ down``
    times ``scale``) in turn, as ComfyUI's ``calculate_weight`` does: the sum held in the LoRA dtype
    ``inter`` between terms (its copy of the weight). ``out`` may be ``weight``. ``flags``: as
    ``add_scaled``'s, for the patched weight against ``weight``. It runs a band of
    rows at a time, ``ROWS_BYTES`` of product: the whole float32 product of a w1 is 157 MB, which
    the plan of an 8 GB card did not have beside an fp8 file's blocks (the first step of a LoRA
    image ran out of memory three times and evicted a layer each time)."""
    rows = max(1, ROWS_BYTES // (4 * weight[0].numel()))
    # calculate_weight's product is float32 (ModelPatcher leaves its intermediate dtype at the
    # default); the weight's copy, and so the sum, is in the LoRA dtype
    factors = [(up.to(weight.device, torch.float32).flatten(start_dim=1),
                down.to(weight.device, torch.float32).flatten(start_dim=1), scale) for up, down, scale in terms]
    for start in range(0, weight.shape[0], rows):
        band, dst_band = weight[start:start + rows], out[start:start + rows]
        value = band
        for n, (up, down, scale) in enumerate(factors):
            # a band of rows of the product is that band of ComfyUI's whole product, bit for bit
            # (each element is one dot product of the rank's terms; checked against ComfyUI's)
            diff = torch.mm(up[start:start + rows], down)
            last = n == len(factors) - 1
            dst = dst_band if last else torch.empty(band.shape, dtype=inter, device=weight.device)
            add_scaled(value, diff.view(band.shape), scale, dst, inter, band if last else None, flags if last else None)
            value = dst
    return out


def check(device: torch.device, inter: torch.dtype, dtype: torch.dtype) -> str | None:
    """None where the kernel gives torch's bits on ``device`` for weights in ``dtype`` patched in the
    LoRA dtype ``inter`` (values near the 16-bit roundings' edges and overflows among them), else why
    not. It launches what a patch launches (``launches``), so a LoRA's first image compiles nothing."""
    g = torch.Generator().manual_seed(11)
    # a last program that is partly masked; a multiple of 16, as every weight's size is (Triton
    # compiles an integer argument's divisibility by 16 into the kernel)
    n = 3 * BLOCK + 16
    # sums that overflow a 16-bit LoRA dtype to infinity, but no infinity minus infinity (a NaN's bits
    # are not the arithmetic's)
    base = (torch.randn(n, generator=g) * torch.logspace(-6, 4, n)).clamp(-6e4, 6e4).to(dtype).to(device)
    diff = (torch.randn(n, generator=g) * 70000 ** torch.rand(n, generator=g)).clamp(-6e4, 6e4).to(device)
    results = []  # every launch first, then the comparisons: each launch is made whatever an earlier gave
    for base_dtype, out_dtype in launches(inter, dtype):
        b = base.to(base_dtype)
        for scale in (0.37, -1.0, 3.0517578125e-05, 0.0):
            scale = float(torch.tensor(scale, dtype=torch.float32))
            want = torch.empty(n, dtype=out_dtype, device=device)
            torch_add_scaled(b, diff, scale, want, inter)
            got = torch.full_like(want, float("nan"))
            add_scaled(b, diff, scale, got, inter)
            why = f"its {base_dtype} weights patched in {inter} into {out_dtype}"
            results.append((f"{why} are not torch's", got, want))
            if out_dtype == dtype:  # a patch's last launch: the first image's checks run in it
                orig = base.to(dtype)
                got, flags = torch.full_like(want, float("nan")), torch.zeros(2, dtype=torch.int32, device=device)
                add_scaled(b, diff, scale, got, inter, orig, flags)
                results.append((f"{why}, checked, are not torch's", got, want))
                checks = torch.stack([~torch.isfinite(want).all(), (_bits(want) != _bits(orig)).any()])
                results.append((f"{why}: the checks say otherwise than torch", flags, checks.to(torch.int32)))
    for why, got, want in results:
        if not torch.equal(_bits(got), _bits(want)):
            return why
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width (NaNs and signed zeros compared as they are stored)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


_checks, _lock = {}, threading.Lock()


def _check(inter: torch.dtype, dtype: torch.dtype) -> DeviceCheck:
    with _lock:
        if (inter, dtype) not in _checks:
            _checks[inter, dtype] = triton_check(
                functools.partial(check, inter=inter, dtype=dtype), "the fused LoRA patch",
                "torch's ops patch the streamed layers instead (slower, same images)", "zimage-lora-check")
        return _checks[inter, dtype]


def runs_on(device, inter: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the kernel patches weights of ``dtype`` in the LoRA dtype ``inter`` on ``device`` (a
    CUDA device; the check, a compile and a run, happens once per pair, where first asked)."""
    if torch.device(device).type != "cuda" or inter not in DTYPES or dtype not in DTYPES:
        return False
    return _check(inter, dtype)(device)


def check_soon(device, inter: torch.dtype, dtype: torch.dtype):
    """Start that check on a thread of its own (when a model loads: its compiles, a second or more
    where Triton's cache on disk has none of them, then run beside the first image, not in the first
    LoRA image)."""
    if torch.device(device).type == "cuda" and inter in DTYPES and dtype in DTYPES:
        _check(inter, dtype).soon(device)

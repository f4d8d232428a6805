"""A LoRA's patch of one weight in one Triton launch: ``weight + scale * (up @ down)``, the product
made in the kernel, with every rounding of ComfyUI's separate torch ops.

ComfyUI computes a LoRA into a weight as the float32 product ``up @ down`` (a full-size matrix), a
copy of the weight in its LoRA dtype (float32, or float16 where the device computes in float16), the
scaled product in that dtype, their sum, and the sum rounded to the model's dtype: six passes over a
full matrix, four of them in float32, and a copy into the slot. A streamed layer is patched at every
upload, so on an 8 GB card that was about 40 ms a step for a rank-16 LoRA on every matrix of the
streamed layers. This kernel reads the weight once and writes the patched weight once, in place: the
product's elements are made in registers, a tile at a time, and never stored.

Each element of the product is a dot product over the rank: torch's float32 ``mm`` (cuBLAS) adds
its terms in the rank's order, each by a fused multiply-add into a sum that starts at zero, and so
does the kernel. Then each op of torch's sequence is kept: the copy rounded to the LoRA dtype, the
product ``scale * diff`` computed in float32 and rounded to it, the sum rounded to it, then to the
output's dtype, each to nearest even, with no two ops fused into one rounding
(``enable_fp_fusion=False``). Whether the kernel runs on a device is decided once per pair of
dtypes (``runs_on``: it must give torch's bits, products of several ranks among them); elsewhere
torch's ops run, with the same bits.
"""
from __future__ import annotations

import functools
import itertools
import threading

import torch

from .device_check import DeviceCheck, triton_check

ROWS, COLS, WARPS = 128, 64, 4  # a program's tile of the weight, and its warps
ROWS_BYTES = 64 << 20  # a band of rows of the sum held between stacked LoRAs (``add_products``)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # the sizes vary with each LoRA and band: not compiled into the kernel, so that what ``check``
    # launched is all a patch ever launches
    @triton.jit(do_not_specialize=["scale", "rows", "rank", "row0"])
    def add_product(base, up, down, out, scale, rows, cols, rank, row0, orig, flags, ROUND: tl.constexpr,
                    INTER: tl.constexpr, OUT_F32: tl.constexpr, CHECK: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
        """out = base + scale * (up @ down) for ``rows`` rows of ``cols``, ``up``'s from row ``row0``
        (``rank`` columns), ``down`` ``rank`` x ``cols``, both float32: the product's terms added in
        the rank's order by fused multiply-adds, then the copy of ``base``, the scaled product and
        the sum each rounded to the LoRA dtype ``INTER`` where it is 16-bit (``ROUND``) as torch's
        ops round. With ``CHECK``: ``flags[0]`` is raised where a value written is not finite,
        ``flags[1]`` where one differs in its bits from ``orig`` (the weight before the patch, in
        ``out``'s dtype)."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1) * COLS + tl.arange(0, COLS)
        in_rows, in_cols = r < rows, c < cols
        diff = tl.zeros((ROWS, COLS), dtype=tl.float32)
        for k in range(rank):
            u = tl.load(up + (row0 + r) * rank + k, mask=in_rows, other=0.0)
            d = tl.load(down + k * cols + c, mask=in_cols, other=0.0)
            diff = tl.fma(u[:, None], d[None, :], diff)
        i = r[:, None] * cols + c[None, :]
        mask = in_rows[:, None] & in_cols[None, :]
        if CHECK:
            o = tl.load(orig + i, mask=mask, other=0.0)  # before the store: ``orig`` may be ``out``
        b = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        p = scale * diff
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
            tl.atomic_max(flags, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
            tl.atomic_max(flags + 1, tl.max(tl.max(changed.to(tl.int32), axis=1), axis=0))

    return add_product


@functools.cache
def _tl(dtype: torch.dtype):
    """Triton's dtype of one of ``DTYPES`` (same names)."""
    import triton.language as tl

    return getattr(tl, str(dtype).removeprefix("torch."))


def add_product(base: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float, out: torch.Tensor,
                inter: torch.dtype, row0: int = 0, orig: torch.Tensor | None = None,
                flags: torch.Tensor | None = None):
    """``out`` = torch's ``t = base.to(inter, copy=True); t += (scale * (up[row0:] @ down)).to(inter);
    t.to(out.dtype)`` (ComfyUI's LoRA: ``up``, ``down`` float32, ``inter`` its LoRA dtype), in one
    launch on the current stream. ``base`` and ``out`` contiguous, of one 2-d shape, on one CUDA
    device, ``out`` possibly ``base`` (in place); ``up`` and ``down`` contiguous; ``scale`` a float32
    value (as torch holds a Python scalar or a CPU one). With ``flags`` (int32, two zeros to start):
    ``flags[0]`` becomes 1 where a value of ``out`` is not finite, ``flags[1]`` where one differs in
    its bits from ``orig`` (``out``'s shape and dtype; it may be ``out``): a patch's first result is
    checked as it is written, with no copy to compare."""
    rows, cols = out.shape
    if out.numel():
        check = flags is not None
        _kernel()[(-(-rows // ROWS), -(-cols // COLS))](
            base, up, down, out, scale, rows, cols, up.shape[1], row0, orig if check else out,
            flags if check else out, ROUND=inter != torch.float32, INTER=_tl(inter),
            OUT_F32=out.dtype == torch.float32, CHECK=check, ROWS=ROWS, COLS=COLS, num_warps=WARPS,
            enable_fp_fusion=False)


def torch_add_product(base: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float, out: torch.Tensor,
                      inter: torch.dtype):
    """What ``add_product`` computes, in torch's ops (ComfyUI's order)."""
    t = base.to(inter, copy=True)
    t += (scale * torch.mm(up, down)).to(inter)
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
    ``add_product``'s, for the patched weight against ``weight``. One LoRA is one launch over the
    whole weight; stacked ones go a band of rows at a time, ``ROWS_BYTES`` of the sum between them
    (an 8 GB card's plan for an fp8 file leaves little room beside its blocks: a w1's whole float32
    product ran it out of memory)."""
    weight2d, out2d = weight.view(weight.shape[0], -1), out.view(out.shape[0], -1)
    # calculate_weight's product is float32 (ModelPatcher leaves its intermediate dtype at the
    # default); the weight's copy, and so the sum, is in the LoRA dtype
    factors = [(up.to(weight.device, torch.float32).flatten(start_dim=1).contiguous(),
                down.to(weight.device, torch.float32).flatten(start_dim=1).contiguous(), scale)
               for up, down, scale in terms]
    total = weight2d.shape[0]
    rows = total if len(factors) == 1 else max(1, ROWS_BYTES // (inter.itemsize * weight2d.shape[1]))
    for start in range(0, total, rows):
        band, dst_band = weight2d[start:start + rows], out2d[start:start + rows]
        value = band
        for n, (up, down, scale) in enumerate(factors):
            last = n == len(factors) - 1
            dst = dst_band if last else torch.empty(band.shape, dtype=inter, device=weight.device)
            add_product(value, up, down, scale, dst, inter, start, band if last else None, flags if last else None)
            value = dst
    return out


def check(device: torch.device, inter: torch.dtype, dtype: torch.dtype) -> str | None:
    """None where the kernel gives torch's bits on ``device`` for weights in ``dtype`` patched in the
    LoRA dtype ``inter`` (values near the 16-bit roundings' edges and overflows among them, products
    of ranks 1, 7, 16 and 64, a band that starts within ``up``), else why not. It launches what a
    patch launches (``launches``), so a LoRA's first image compiles nothing."""
    g = torch.Generator().manual_seed(11)
    # a last tile partly masked; columns as many as a real weight's (the product's kernel in torch
    # may depend on them), a multiple of 16 as every weight's are (Triton compiles a size's
    # divisibility by 16 into the kernel)
    rows, cols = 3 * ROWS + 5, 3840
    # sums that overflow a 16-bit LoRA dtype to infinity, but no infinity minus infinity (a NaN's bits
    # are not the arithmetic's); signed zeros among the weights
    n = rows * cols
    base = (torch.randn(n, generator=g) * torch.logspace(-6, 4, n)).clamp(-6e4, 6e4)
    base[::97] = -0.0
    base = base.view(rows, cols).to(dtype).to(device)
    # every launch is made whatever an earlier gave, and only whether each differed is kept (a flag on
    # the device, read at the end): the compared tensors are a few MB each, a hundred of them per pair
    results = []
    for (base_dtype, out_dtype), rank in itertools.product(launches(inter, dtype), (1, 7, 16, 64)):
        # terms up to about 2e3, so that some sums pass fp16's largest value; exact and signed zeros
        up = torch.randn(rows + 3, rank, generator=g) * 16 ** torch.rand(rows + 3, rank, generator=g)
        down = torch.randn(rank, cols, generator=g) * 16 ** torch.rand(rank, cols, generator=g)
        up[::5, 0], down[0, ::11] = 0.0, -0.0
        up, down = up.to(device), down.to(device)
        b = base.to(base_dtype)
        for scale in (0.37, -1.0, 3.0517578125e-05, 0.0):
            scale = float(torch.tensor(scale, dtype=torch.float32))
            want = torch.empty(rows, cols, dtype=out_dtype, device=device)
            torch_add_product(b, up[3:], down, scale, want, inter)
            got = torch.full_like(want, float("nan"))
            add_product(b, up, down, scale, got, inter, 3)
            why = f"its {base_dtype} weights patched by a rank-{rank} product in {inter} into {out_dtype}"
            results.append((f"{why} are not torch's", _differ(got, want)))
            if out_dtype == dtype:  # a patch's last launch: the first image's checks run in it
                orig = base.to(dtype)
                got, flags = torch.full_like(want, float("nan")), torch.zeros(2, dtype=torch.int32, device=device)
                add_product(b, up, down, scale, got, inter, 3, orig, flags)
                results.append((f"{why}, checked, are not torch's", _differ(got, want)))
                checks = torch.stack([~torch.isfinite(want).all(), _differ(want, orig)])
                results.append((f"{why}: the checks say otherwise than torch", _differ(flags, checks.to(torch.int32))))
    differed = torch.stack([d for _, d in results]).tolist()
    return next((why for (why, _), d in zip(results, differed) if d), None)


def _differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Whether ``got`` differs from ``want`` (one shape and dtype) in any bit, on their device."""
    return (_bits(got) != _bits(want)).any()


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

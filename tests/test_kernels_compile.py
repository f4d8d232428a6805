"""Every Triton kernel of the pack compiled for the GPUs its users have, on the CPU, where Triton
is installed (it comes with torch's CUDA builds): the consumer cards of the last four generations
(compute capability 7.5, 8.6, 8.9, 12.0: the 6 GB cards among them) and the data-centre ones (8.0,
9.0). The GPU tests run the kernels on one H200 only; a kernel that would not compile on a user's
card would fall back to torch's ops there without a word in any test. Each kernel is compiled for the calls its module's
own entry points make (recorded, not launched), so the signatures are the real ones."""
import itertools

import pytest
import torch

from zimage_core import attention_input, elementwise, quants, triton_decode, triton_dequant, triton_lora
from zimage_core.config import FULL

CAPABILITIES = (75, 80, 86, 89, 90, 120)
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
         torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands for a compiled kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def source(kernel, args, kwargs):
    """Triton's source of one call: the arguments' types and the constexprs' values; the rest of
    ``kwargs`` are compile options."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    signature = {}
    for name in names:
        v = values[name]
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        else:
            signature[name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k not in names}
    return ASTSource(kernel, signature, {k: values[k] for k in constexprs}), options


def recorded_calls(monkeypatch):
    """Every (kernel, args, kwargs) the modules' entry points make at Z-Image's sizes, for each
    dtype and branch they take."""
    recorders = {}

    def record(module, getter):
        real = getattr(module, getter)()
        wrapped = tuple(Recorder(k) for k in real) if isinstance(real, tuple) else Recorder(real)
        monkeypatch.setattr(module, getter, lambda: wrapped)
        recorders[module.__name__] = wrapped if isinstance(wrapped, tuple) else (wrapped,)

    record(triton_lora, "_kernel")
    record(triton_dequant, "_kernel")
    record(triton_decode, "_kernels")
    record(elementwise, "_kernels")
    record(attention_input, "_kernel")

    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    rows, cols = 3 * triton_lora.ROWS + 5, 2 * triton_lora.COLS
    up, down = torch.empty(rows, 16), torch.empty(16, cols)
    for inter in dtypes:
        for dtype in dtypes:
            for base, out in triton_lora.launches(inter, dtype):
                triton_lora.add_product(torch.empty(rows, cols, dtype=base), up, down, 0.5,
                                        torch.empty(rows, cols, dtype=out), inter)
                if out == dtype:  # a patch's last launch, checked (a patch's first result)
                    triton_lora.add_product(torch.empty(rows, cols, dtype=base), up, down, 0.5,
                                            torch.empty(rows, cols, dtype=out), inter, 0,
                                            torch.empty(rows, cols, dtype=out), torch.zeros(2, dtype=torch.int32))
    for name, q in quants.TYPES.items():
        for out in dtypes:
            triton_dequant.dequantize_blocks(torch.empty(4, q.nbytes, dtype=torch.uint8), name,
                                             torch.empty(4, q.elements, dtype=out))
    for aligned in (True, False):
        triton_decode.decode(torch.empty(4096, dtype=torch.uint8), torch.zeros(3, 7, dtype=torch.int64), 4096, 16,
                             torch.empty(8192, dtype=torch.bfloat16), aligned)
    elementwise.check(torch.device("cpu"))  # its three kernels, at Z-Image's sizes
    attention_input.check(torch.device("cpu"))
    calls = [(r.kernel, args, kwargs) for rs in recorders.values() for r in rs for args, kwargs in r.calls]
    assert all(r.calls for rs in recorders.values() for r in rs), "a kernel was never called"
    return calls


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_kernel_compiles_for(capability, monkeypatch):
    triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    from triton.backends.compiler import GPUTarget

    failed = []
    for kernel, args, kwargs in recorded_calls(monkeypatch):
        src, options = source(kernel, args, kwargs)
        try:
            triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its kernel
            failed.append(f"{kernel.__name__} {kwargs}: {type(e).__name__}: {str(e)[:300]}")
    assert not failed, "\n".join(failed)


def specialization(args, kwargs, unspecialized=()) -> tuple:
    """What Triton compiles a launch for: the pointers' dtypes, each integer's divisibility by 16
    (and whether it is 1) but those of the arguments at ``unspecialized``, the constexprs and the
    compile options."""
    def of(i, v):
        if isinstance(v, torch.Tensor):
            return v.dtype
        if isinstance(v, int) and not isinstance(v, bool):
            return None if i in unspecialized else (v % 16 == 0, v == 1)
        return type(v).__name__
    return tuple(of(i, a) for i, a in enumerate(args)), tuple(sorted((k, str(v)) for k, v in kwargs.items()))


@pytest.mark.parametrize("inter", (torch.float16, torch.float32))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_the_lora_check_compiles_what_a_patch_launches(inter, dtype, monkeypatch):
    """A LoRA's first image compiles nothing: the fused patch's check, started when a model loads,
    launches every specialization that one, two and three stacked LoRAs of any rank launch on
    Z-Image's weights, checked (a patch's first result) or not."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA builds)")
    unspecialized = {i for i, p in enumerate(triton_lora._kernel().params) if p.do_not_specialize}
    kernel = Recorder(None)
    monkeypatch.setattr(triton_lora, "_kernel", lambda: kernel)
    triton_lora.check(torch.device("cpu"), inter, dtype)  # recorded, not run: its comparisons fail
    checked = {specialization(*call, unspecialized) for call in kernel.calls}
    kernel.calls.clear()
    for rows, cols in FULL.big_shapes.values():
        weight = torch.empty(rows, cols, dtype=dtype, device="meta")
        for stacked, rank in itertools.product((1, 2, 3), (1, 4, 16, 37)):
            lora = (torch.empty(rows, rank, device="meta"), torch.empty(rank, cols, device="meta"), 0.5)
            for flags in (None, torch.empty(2, dtype=torch.int32, device="meta")):  # checked: a first result
                triton_lora.add_products(weight, [lora] * stacked, weight, inter, flags)
    launched = {specialization(*call, unspecialized) for call in kernel.calls}
    assert launched and launched <= checked, launched - checked

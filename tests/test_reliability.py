"""What a user can produce must give a clear error or the right image: non-finite weights, sizes that
do not fit the memory there is, interrupts in the middle of a long step."""

import pytest
import torch

from conftest import TINY, inputs
from zimage_core import device_memory, dit, host_memory, planner
from zimage_core.checkpoint import expected_shapes
from zimage_core.config import FULL
from zimage_core.errors import CheckpointError, OutOfDeviceMemory
from tools.random_weights import write_checkpoint
from zimage_core.transformer import ZImageTransformer


class Stop(Exception):
    pass


def _pieces(monkeypatch, flops):
    """Blocks on the CPU run in pieces of ``flops`` (tiny: every block in several pieces)."""
    monkeypatch.setattr(dit, "CPU_PIECE_FLOPS", flops)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pieces_match_the_whole_block_and_streaming_stays_bit_identical(monkeypatch, tiny_file, dtype):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype=dtype)
    try:
        x, t, ctx = inputs(TINY, width=96, height=64, cap=9)
        _pieces(monkeypatch, 1e15)
        assert dit.cpu_chunks(TINY, 96, 64).rows >= 96 + 512  # one piece: the plain block
        whole = m(x, t, ctx)
        _pieces(monkeypatch, 1)
        c = dit.cpu_chunks(TINY, 96, 64)
        assert (c.rows, c.queries) == (32, 16)  # 32 image and 32 caption tokens: up to two and four pieces
        m.prepare(96, 64, resident_layers=TINY.n_blocks)
        ref = m(x, t, ctx)
        # pieces change the order of nothing but the kernels' blocking: equal to rounding
        tol = 1e-5 if dtype == "fp32" else 2e-2
        assert (ref.float() - whole.float()).abs().max() <= tol * whole.float().abs().max()
        for r in range(TINY.n_blocks):
            m.prepare(96, 64, resident_layers=r)
            assert torch.equal(m(x, t, ctx), ref), f"{r} resident layers differ in pieces"
    finally:
        m.release()


def test_an_interrupt_is_seen_between_pieces_and_the_model_survives(monkeypatch, tiny_file):
    calls = {"n": 0, "stop_at": None}

    def check():
        calls["n"] += 1
        if calls["stop_at"] is not None and calls["n"] >= calls["stop_at"]:
            raise Stop

    _pieces(monkeypatch, 1)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32", check_interrupt=check)
    try:
        x, t, ctx = inputs(TINY, width=96, height=64)
        m.prepare(96, 64, resident_layers=1)
        ref = m(x, t, ctx)
        per_forward = calls["n"]
        # blocks: 2 refiners + 4 layers, each checked after every piece and after the block
        assert per_forward > 6 * 3
        for stop in (1, 5, per_forward // 2, per_forward - 1):  # in a refiner, a layer, anywhere
            calls.update(n=0, stop_at=stop)
            with pytest.raises(Stop):
                m(x, t, ctx)
            assert calls["n"] == stop  # nothing ran past the check that raised
            calls.update(n=0, stop_at=None)
            assert torch.equal(m(x, t, ctx), ref)
    finally:
        m.release()


def _with_nan(tmp_path, key):
    """The tiny checkpoint with one value of ``key`` set to NaN."""
    path = str(tmp_path / "nan.safetensors")
    shapes = expected_shapes(TINY)
    g = torch.Generator().manual_seed(0)

    def value(k):
        v = torch.randn(shapes[k], generator=g) * 0.02
        if k == key:
            v.view(-1)[v.numel() // 2] = float("nan")
        return v
    write_checkpoint(path, TINY, values=value, dtype=torch.bfloat16)
    return path


@pytest.mark.parametrize("key", ["layers.2.feed_forward.w3.weight", "noise_refiner.0.attention.qkv.weight",
                                 "t_embedder.mlp.2.weight"])
@pytest.mark.parametrize("resident", [0, TINY.n_blocks])
def test_non_finite_weights_are_named(tmp_path, key, resident):
    path = _with_nan(tmp_path, key)
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(path, device="cpu", dtype="bf16")
    try:
        m.prepare(64, 48, resident_layers=resident)
        x, t, ctx = inputs(TINY)
        for _ in range(2):  # and again: a damaged model never runs
            with pytest.raises(CheckpointError) as e:
                m(x, t, ctx)
            msg = str(e.value)
            assert path in msg and key in msg and "NaN" in msg and "download it again" in msg, msg
    finally:
        m.release()
    assert host_memory.live_bytes() == before


def test_fp8_nan_is_found(tmp_path):
    """fp8 e4m3fn has no infinity; its NaN is a bit pattern that isfinite cannot read."""
    from zimage_core.weight_checks import all_finite
    t = torch.zeros(8, dtype=torch.float8_e4m3fn)
    assert bool(all_finite(t))
    t.view(torch.uint8)[3] = 0xFF
    assert not bool(all_finite(t))


def test_a_weight_patch_that_makes_a_layer_non_finite_is_caught(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    try:
        x, t, ctx = inputs(TINY)
        m(x, t, ctx)
        key = "layers.1.attention.out.weight"
        w = m.weights.base(key)
        w[0, 0] = float("inf")
        m.weights.set(key, w)
        with pytest.raises(CheckpointError, match="layers.1.attention.out.weight"):
            m(x, t, ctx)
    finally:
        m.release()


def test_cpu_plans_host_ram_and_names_the_largest_size():
    free = 20 * planner.GiB
    ok = planner.plan_host(FULL, free, 2048, 2048, chunk_rows=224, chunk_queries=64)
    assert ok.fits and ok.on_cpu and ok.resident_layers == FULL.n_blocks
    big = planner.plan_host(FULL, free, 8192, 8192, chunk_rows=224, chunk_queries=64)
    assert not big.fits
    w, h = big.largest_fitting
    assert w == h and w % 16 == 0 and 2048 <= w < 8192
    assert planner.plan_host(FULL, free, w, h, chunk_rows=224, chunk_queries=64).fits
    assert not planner.plan_host(FULL, free, w + 16, h + 16, chunk_rows=224, chunk_queries=64).fits
    msg = big.summary()
    assert "8192x8192 does not fit" in msg and f"Try {w}x{h}" in msg and "RAM" in msg
    wide = planner.plan_host(FULL, free, 8192, 4096, chunk_rows=224, chunk_queries=64)
    ww, wh = wide.largest_fitting
    assert abs(ww / wh - 2) < 0.05  # the same shape


def test_gpu_refusal_names_the_largest_size():
    free = int(2.0 * planner.GiB)
    p = planner.plan(FULL, free, 2048, 2048)
    assert not p.fits
    w, h = p.largest_fitting
    assert w < 2048 and planner.plan(FULL, free, w, h).fits and not planner.plan(FULL, free, w + 16, h + 16).fits
    assert f"Try {w}x{h}" in p.summary() and "GPU memory" in p.summary()


def test_the_cpu_refuses_a_size_beyond_its_ram(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    try:
        with pytest.raises(OutOfDeviceMemory, match=r"does not fit.*RAM.*Try \d+x\d+"):
            m.prepare(4096, 4096, free_bytes=device_memory.HOST_RESERVE + (100 << 20))  # 100 MiB beyond what it keeps
    finally:
        m.release()

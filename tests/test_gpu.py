"""The streamer on a real GPU: copy stream, events, pinned masters (skipped without CUDA)."""
import pytest
import torch

from conftest import TINY, chain_of, inputs
from zimage_core import attention_input, elementwise, host_memory
from tools.schedule import euler_sample
from zimage_core.device_copies import DeviceCopies, module_tensors
from zimage_core.host_memory import HostPool
from zimage_core.settings import Settings
from zimage_core.transformer import ZImageTransformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# a forced split's streamed layers all get masters (the planner names them where it plans)
EVERY_LAYER = frozenset(range(TINY.n_blocks))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_streamed_equals_resident_on_cuda(tiny_file, dtype):
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype=dtype)
    assert m.streamer.masters.master_layers == 0  # loading packs nothing
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(m, x.cuda(), ctx.cuda(), steps=4)
    assert m.streamer.masters.master_layers == 0  # resident layers came from the file through staging
    for r in range(TINY.n_blocks):
        for slots in (1, 2, 3):
            m.streamer.configure(r, slots, masters=EVERY_LAYER)
            out = euler_sample(m, x.cuda(), ctx.cuda(), steps=4)
            assert torch.equal(out, ref), (r, slots)
    assert all(h is not None and h.is_pinned() for h in m.streamer.masters.host)  # each streamed once: a pinned master
    m.release()
    assert host_memory.live_bytes() == before


@pytest.mark.parametrize("kernels", [attention_input, elementwise], ids=["attention inputs", "norms"])
def test_the_fused_kernels_run_and_give_torchs_values(tiny_file, monkeypatch, kernels):
    """The fused kernels (the attention's inputs; the norms, residuals and SiLU gate) compile here,
    agree with torch's ops to one unit in the last place, and a model's output with them is torch's
    path's but for that rounding."""
    dev = torch.device("cuda")
    assert kernels.runs_on(dev)
    assert kernels.check(dev, units=1) is None
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype="bf16")
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    fused = euler_sample(m, x.cuda(), ctx.cuda(), steps=2)
    monkeypatch.setattr(kernels, "usable", lambda *a: False)
    plain = euler_sample(m, x.cuda(), ctx.cuda(), steps=2)
    m.release()
    assert torch.allclose(fused, plain, rtol=0.05, atol=0.05), (fused - plain).abs().max()


def test_device_timing_leaves_out_a_busy_interpreter():
    """A matmul timed while another thread keeps the interpreter lock busy (as a Triton compile
    beside the first plan does) takes the device's time, not the time its launches waited."""
    import threading
    from zimage_core.device_timing import device_seconds
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    run = lambda: [x @ x.T for _ in range(5)]  # noqa: E731
    quiet = device_seconds(run)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))
    t = threading.Thread(target=spin)
    t.start()
    try:
        busy = device_seconds(run)
    finally:
        stop.set()
        t.join()
    assert busy < 1.5 * quiet, (busy, quiet)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_chain_over_two_cards_gives_the_one_card_output(tiny_file):
    """Each card streams its own range of layers over its own link, the second card's norms and
    adaLN on it, the hidden states crossing where its range begins: one card's output, bit for
    bit, with the cut inside the refiners, after them and inside the main layers."""
    m = ZImageTransformer.load(tiny_file, device="cuda:0", dtype="bf16")
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(m, x.cuda(0), ctx.cuda(0), steps=3)
    blocks = [*m.model.context_refiner, *m.model.noise_refiner, *m.model.layers]
    own = m.model.runner
    try:
        for cut, splits in ((1, [(0, 1), (2, 2)]), (2, [(1, 1), (0, 2)]), (4, [(2, 2), (1, 0)])):
            m.offload()
            m.to_device()  # every small tensor on the first card, then the second range's on the second
            pool = HostPool("transformer")
            second = DeviceCopies(module_tensors(torch.nn.ModuleList(blocks[cut:])), "cuda:1", pool)
            second.place()
            chain = chain_of(m, [cut], splits, ["cuda:0", "cuda:1"])
            m.model.runner = chain
            try:
                assert torch.equal(euler_sample(m, x.cuda(0), ctx.cuda(0), steps=3), ref), cut
            finally:
                chain.release()
                second.release()
                pool.release_all()
    finally:
        m.model.runner = own
        m.release()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_transformer_loaded_across_two_cards_gives_the_one_card_output(tiny_file):
    """Loaded on two cards: the first image cuts the layers across them, each block's norms and
    adaLN on the card that runs it, each card streaming part of its range from pinned masters; the
    sampled latent is the one-card latent, bit for bit, and releasing it leaves no pinned memory."""
    before = host_memory.live_bytes()
    one = ZImageTransformer.load(tiny_file, device="cuda:0", dtype="bf16")
    x, _, ctx = inputs(TINY, width=128, height=96)
    one.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(one, x.cuda(0), ctx.cuda(0), steps=3)
    one.release()
    m = ZImageTransformer.load(tiny_file, device=["cuda:0", "cuda:1"], dtype="bf16")
    try:
        m.prepare(128, 96, resident_layers=2)
        second = m.placement.ranges[1]
        assert [s.device.index for s in m.chain.streamers] == [0, 1] and m.chain.n_streamed == TINY.n_blocks - 2
        assert m.model.layers[-1].adaLN_modulation[0].weight.device == torch.device("cuda:1")
        assert m.model.final_layer.linear.weight.device == torch.device("cuda:0")
        assert second.stop == TINY.n_blocks and m.device_bytes("cuda:1") > 0
        for _ in range(2):
            assert torch.equal(euler_sample(m, x.cuda(0), ctx.cuda(0), steps=3), ref)
    finally:
        m.release()
    assert host_memory.live_bytes() == before


def test_planned_split_uses_free_memory(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cuda")
    p = m.prepare(256, 256)
    assert p.streamed_layers == 0  # a tiny model fits any GPU
    m.release()


def test_offload_frees_the_device_and_comes_back_identical(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cuda", initial_device="cpu")
    assert not m.on_device and m.device_bytes() == 0
    x, _, ctx = inputs(TINY, width=128, height=96)
    out = euler_sample(m, x.cuda(), ctx.cuda(), steps=2)
    assert m.on_device and m.device_bytes() > 0
    before = torch.cuda.memory_allocated()
    m.offload()
    assert m.device_bytes() == 0 and torch.cuda.memory_allocated() < before
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), out)
    m.release()


def test_layers_past_the_pinned_cap_are_read_from_the_file_identically(tiny_file):
    """No pinned master: every upload reads the file into staging, and the bits are the same."""
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype="bf16", settings=Settings(pinned_cap=0))
    assert m.streamer.masters.pinned_layers == 0
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(m, x.cuda(), ctx.cuda(), steps=3)
    m.prepare(128, 96, resident_layers=1)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=3), ref)
    m.release()


def test_the_fixed_part_is_the_files_pages_and_a_patch_gets_its_own_copy(tiny_file):
    """Stored as it runs (fp32 here), the fixed part's master is the file's pages locked in place:
    no copy in host memory. A patch of one of its tensors never writes the file's pages."""
    from zimage_core.checkpoint import Checkpoint
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype="fp32")
    assert m.fixed.pool.in_place >= m.fixed_bytes
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=1)
    ref = euler_sample(m, x.cuda(), ctx.cuda(), steps=2)
    key = "t_embedder.mlp.0.weight"
    w = m.weights.base(key)
    m.weights.set(key, w * 1.5)
    assert not torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), ref)
    m.offload()  # back from the patched master
    m.weights.set(key, w)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), ref)
    ckpt = Checkpoint(tiny_file)
    assert torch.equal(ckpt.tensor(key), w)
    ckpt.close()
    m.release()
    assert host_memory.live_bytes() == before


@pytest.mark.parametrize("resident", [0, TINY.n_blocks])
def test_non_finite_weights_are_named_on_cuda(tmp_path, resident):
    from test_reliability import _with_nan
    from zimage_core.errors import CheckpointError
    for key in ("layers.3.attention.qkv.weight", "context_refiner.0.feed_forward.w2.weight", "x_pad_token"):
        path = _with_nan(tmp_path, key)
        m = ZImageTransformer.load(path, device="cuda", dtype="bf16")
        m.prepare(64, 48, resident_layers=resident)
        x, t, ctx = inputs(TINY)
        with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
            m(x.cuda(), t.cuda(), ctx.cuda())
        m.release()


def test_a_staging_ring_of_small_chunks_is_bit_identical_on_cuda(tiny_file, monkeypatch):
    """Chunks far smaller than a layer: the ring of pinned buffers wraps inside every upload, each
    read waiting for the upload that last used its buffer; the bits are the resident ones."""
    from zimage_core import layout as layout_module
    monkeypatch.setattr(layout_module, "STAGING_CHUNK", 1000)
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype="bf16", settings=Settings(pinned_cap=TINY.fixed_params() * 2 + 4000))  # the fixed part and the ring, no master
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(m, x.cuda(), ctx.cuda(), steps=3)
    m.prepare(128, 96, resident_layers=0)
    assert len(m.streamer.masters._staging) == layout_module.STAGING_BUFFERS and all(b.is_pinned() for b, _ in m.streamer.masters._staging)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=3), ref)
    m.release()


def test_compressed_masters_are_bit_identical_on_cuda(tiny_file, monkeypatch):
    """Masters encoded on the device, stored compressed in pinned memory, uploaded a run of chunks at
    a time and decoded on the decode stream while the next run crosses: the resident output, at every
    split and slot count, with chunks small enough that every layer has several."""
    from zimage_core import compression
    monkeypatch.setattr(compression, "CHUNK", 40000)
    monkeypatch.setattr(compression, "GROUP_BYTES", 70000)  # runs of one and of two chunks
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(tiny_file, device="cuda", dtype="bf16", settings=Settings(compress="on"))
    x, _, ctx = inputs(TINY, width=128, height=96)
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    ref = euler_sample(m, x.cuda(), ctx.cuda(), steps=4)
    for r in range(TINY.n_blocks):
        for slots in (1, 2, 3):
            m.streamer.configure(r, slots, masters=EVERY_LAYER, compress=True)
            assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=4), ref), (r, slots)
    s = m.streamer
    assert all(c is not None and len(c) > 2 for c in s.masters.codes) and all(h.is_pinned() for h in s.masters.host)
    s.configure(1, 1)
    assert s.device_bytes == 2 * s.layout.nbytes + compression.BUFFERS * compression.GROUP_BYTES  # the decode's buffers count
    s.configure(0, 0)
    assert s.device_bytes == 0  # and go with the last slot
    m.release()
    assert host_memory.live_bytes() == before


def test_the_device_decode_gives_back_every_bit(monkeypatch):
    """The Triton decode of runs of chunks (odd sizes, exceptions past 2**16 in a chunk, every bf16
    bit pattern) gives the bits that were encoded, as the CPU's reference decode does."""
    from zimage_core import compression
    monkeypatch.setattr(compression, "CHUNK", 300000)  # wide loads, but not in the last run
    monkeypatch.setattr(compression, "GROUP_BYTES", 1 << 20)
    assert compression.decodes_on(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2_000_003, generator=g) * 0.02).to(torch.bfloat16)
    w[::997] = 0
    w[5::1009] = 30.0
    w[:65536] = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    chunks, packed = compression.encode_all(w.cuda())
    assert len(chunks) == 7 and all(c.n_exc for c in chunks)
    runs = compression.groups(chunks)
    assert 1 < len(runs) < len(chunks)
    out = torch.zeros_like(w, device="cuda")
    for run in runs:
        first, nbytes = run[0].offset, sum(c.nbytes for c in run)
        compression.decode_run(packed[first:first + nbytes], run, out, compression.table(run, out.device))
    ref = torch.empty_like(w)
    compression.decode_all(chunks, packed.cpu(), ref)
    assert torch.equal(out.cpu().view(torch.int16), w.view(torch.int16))
    assert torch.equal(ref.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_device_dequantizes_as_the_cpu_does(type_name):
    """GGML blocks dequantized on the GPU give the CPU's values to the bit (which equal the gguf
    package's: tests/test_quants.py), in float32 and rounded to bf16."""
    from zimage_core import quants
    elements = quants.TYPES[type_name].elements
    blocks = quants.random_blocks(type_name, 512, seed=7)
    shape = (16, 512 * elements // 16)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = quants.dequantize(blocks, type_name, shape, dtype)
        gpu = quants.dequantize(blocks.cuda(), type_name, shape, dtype)
        assert torch.equal(gpu.cpu(), cpu), (type_name, dtype)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_the_dequantization_kernel_gives_the_cpus_bits(type_name):
    """The one-launch Triton dequantization (``triton_dequant``, what the streamer runs on a GPU)
    compiles here and gives the CPU's values to the bit (the gguf package's), over many programs
    with the last one partly masked, in float32 and rounded to bf16 and fp16 as torch rounds."""
    from zimage_core import quants, triton_dequant
    q = quants.TYPES[type_name]
    blocks = quants.random_blocks(type_name, 4099, seed=5)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        assert triton_dequant.runs_on(torch.device("cuda"), type_name, dtype), "it did not compile or gave other bits (the log says)"
        want = quants.dequantize_blocks(blocks, type_name).to(dtype)
        got = torch.full((4099, q.elements), float("nan"), dtype=dtype, device="cuda")
        triton_dequant.dequantize_blocks(blocks.cuda(), type_name, got)
        assert torch.equal(got.cpu().view(bits), want.view(bits)), (type_name, dtype)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_gguf_streamed_on_cuda_computes_what_its_dequantized_weights_compute(tmp_path, tiny_file, quant):
    """A GGUF's layers streamed as their blocks and dequantized on the device (``DeviceDecode``) give,
    at every split, the image of the same transformer loaded from the gguf package's dequantized
    weights, to the bit; so do layers whose blocks the device keeps."""
    from safetensors.torch import save_file
    from test_gguf_file import reference
    from tools.gguf_weights import write_gguf
    want = reference(write_gguf(tiny_file, tmp_path / "tiny.gguf", quant))
    save_file({k: torch.from_numpy(v) for k, v in want.items()}, str(tmp_path / "ref.safetensors"))
    x, _, ctx = inputs(TINY, width=128, height=96)
    ref = ZImageTransformer.load(str(tmp_path / "ref.safetensors"), device="cuda", dtype="bf16")
    ref.prepare(128, 96, resident_layers=TINY.n_blocks)
    expected = euler_sample(ref, x.cuda(), ctx.cuda(), steps=2)
    ref.release()
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(str(tmp_path / "tiny.gguf"), device="cuda", dtype="bf16")
    assert m.streamer.config.quantized
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected)
    for r in range(TINY.n_blocks):
        for slots in (1, 2):
            m.streamer.configure(r, slots, masters=EVERY_LAYER)
            assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected), (r, slots)
    masters = [h for h in m.streamer.masters.host if h is not None]
    assert masters and all(h.dtype == torch.uint8 and h.is_pinned() for h in masters)  # blocks, pinned
    # blocks kept on the device, dequantized there into the slots with nothing crossing: the same bits
    for r, blocks in ((0, TINY.n_blocks), (1, TINY.n_blocks - 1), (1, 1)):
        m.streamer.configure(r, 2, blocks)
        kept = m.streamer.masters.on_device
        assert sum(b is not None for b in kept) == blocks
        assert all(t.data.is_cuda for b in kept if b is not None for t in b.values())
        assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected), (r, blocks)
    m.release()
    assert host_memory.live_bytes() == before


def test_a_scaled_fp8_file_streamed_on_cuda_computes_what_comfyui_dequantizes(tmp_path, tiny_file):
    """A scaled fp8 file's layers stream as their fp8 bytes and are scaled on the device (as ComfyUI
    dequantizes them, in bf16): at every split, and kept on the device, the image of the weights
    ComfyUI would compute with."""
    from safetensors.torch import save_file
    from test_scaled_fp8 import comfy_dequantized
    from tools.fp8_weights import write_scaled_fp8
    path = str(write_scaled_fp8(tiny_file, tmp_path / "tiny_fp8.safetensors"))
    save_file(comfy_dequantized(path, torch.bfloat16), str(tmp_path / "ref.safetensors"))
    _every_split_matches(path, str(tmp_path / "ref.safetensors"))


def _every_split_matches(path, ref_path):
    """The file at ``path`` streamed on the GPU gives, resident, at every split and with its blocks
    kept on the device, the image of the file at ``ref_path`` resident, to the bit."""
    x, _, ctx = inputs(TINY, width=128, height=96)
    ref = ZImageTransformer.load(ref_path, device="cuda", dtype="bf16")
    ref.prepare(128, 96, resident_layers=TINY.n_blocks)
    expected = euler_sample(ref, x.cuda(), ctx.cuda(), steps=2)
    ref.release()
    m = ZImageTransformer.load(path, device="cuda", dtype="bf16")
    m.prepare(128, 96, resident_layers=TINY.n_blocks)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected)
    for r in range(TINY.n_blocks):
        m.streamer.configure(r, 2, masters=EVERY_LAYER)
        assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected), r
    m.streamer.configure(0, 2, TINY.n_blocks)
    assert torch.equal(euler_sample(m, x.cuda(), ctx.cuda(), steps=2), expected)
    m.release()


@pytest.mark.parametrize("rotation", [0, 256], ids=["rows", "convrot"])
def test_an_int8_file_streamed_on_cuda_computes_what_comfyui_dequantizes(tmp_path, tiny_file, rotation):
    """An int8_tensorwise file's layers stream as their codes and are dequantized on the device: at
    every split, and with their codes kept on the device, the image of the weights ComfyUI would
    compute with (its formula on the CPU where the rows are only scaled; rotated back on this device,
    where the matrix product's rounding is the device's)."""
    from safetensors.torch import load_file, save_file
    from test_int8 import comfy_dequantized
    from tools.int8_weights import write_int8
    from zimage_core import int8_rows
    from zimage_core.checkpoint import COMFY_PREFIX
    path = str(write_int8(tiny_file, tmp_path / "tiny_int8.safetensors", rotation))
    want = comfy_dequantized(path, torch.bfloat16)
    if rotation:
        sd = load_file(path)
        for key in [k for k in want if COMFY_PREFIX + k[:-len(".weight")] + ".weight_scale" in sd]:
            layer = COMFY_PREFIX + key[:-len(".weight")]
            want[key] = int8_rows.dequantize(sd[layer + ".weight"].cuda(), sd[layer + ".weight_scale"].cuda(),
                                             rotation, torch.bfloat16).cpu()
    save_file(want, str(tmp_path / "ref.safetensors"))
    _every_split_matches(path, str(tmp_path / "ref.safetensors"))

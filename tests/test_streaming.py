"""Streamed output is bit-identical to resident output for every split, through eviction,
promotion and the out-of-memory evict-and-retry path."""

import pytest
import torch

from conftest import TINY, inputs
from zimage_core import host_memory
from zimage_core.errors import OutOfDeviceMemory
from zimage_core.host_memory import HostPool
from tools.schedule import euler_sample
from zimage_core.layout import PackLayout, StreamConfig, residency_order
from zimage_core.streamer import LayerStreamer
from zimage_core.settings import Settings
from zimage_core.transformer import ZImageTransformer


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request, tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype=request.param)
    yield m
    m.release()


def _run(m, resident, **kw):
    x, t, ctx = inputs(TINY, **kw)
    m.prepare(x.shape[-1] * 8, x.shape[-2] * 8, x.shape[0], resident_layers=resident)
    assert m.streamer.n_resident == resident
    return m(x, t, ctx)


def test_every_split_is_bit_identical(model):
    ref = _run(model, TINY.n_blocks)
    assert model.streamer.slots == []
    assert torch.isfinite(ref).all() and ref.abs().sum() > 0
    for r in range(TINY.n_blocks):
        out = _run(model, r)
        assert model.streamer.slots, "streamed layers need slots"
        assert torch.equal(out, ref), f"{r} resident layers differ from all resident"


def test_batch_and_odd_sizes(model):
    ref = _run(model, TINY.n_blocks, width=80, height=48, batch=2, cap=5)
    assert ref.shape == (2, 16, 6, 10)
    assert torch.equal(_run(model, 1, width=80, height=48, batch=2, cap=5), ref)


def test_slot_count_does_not_change_bits(model):
    ref = _run(model, TINY.n_blocks)
    for slots in (1, 2, 3):
        model.streamer.configure(0, slots)
        x, t, ctx = inputs(TINY)
        assert torch.equal(model(x, t, ctx), ref)


def test_evict_and_promote_keep_output(model):
    ref = _run(model, TINY.n_blocks)
    x, t, ctx = inputs(TINY)
    layer = model.streamer.layout.nbytes
    freed = model.evict(2 * layer)
    assert freed == 2 * layer and model.streamer.n_resident == TINY.n_blocks - 2
    assert torch.equal(model(x, t, ctx), ref)  # plans again: streamed layers without slots
    model.prepare(64, 48, resident_layers=TINY.n_blocks)  # memory came back: promote
    assert model.streamer.n_resident == TINY.n_blocks
    assert torch.equal(model(x, t, ctx), ref)


def test_evict_gives_the_slots_first(model):
    """Another model's room comes from the slots before any resident layer: they hold nothing
    that must cross the bus again."""
    model.prepare(64, 48, resident_layers=2)
    slots = len(model.streamer.slots)
    assert slots >= 2
    layer = model.streamer.layout.nbytes
    assert model.evict(1) == slots * layer
    assert (model.streamer.n_resident, len(model.streamer.slots)) == (2, 0)
    assert model.evict(layer) == layer and model.streamer.n_resident == 1
    x, t, ctx = inputs(TINY)
    model.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = model(x, t, ctx)
    model.prepare(64, 48, resident_layers=1)
    model.evict(1)
    assert torch.equal(model(x, t, ctx), ref)


def test_sampling_is_identical_streamed_and_resident(model):
    x, _, ctx = inputs(TINY)
    model.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = euler_sample(model, x, ctx, steps=3)
    model.prepare(64, 48, resident_layers=1)
    uploads = []
    handle = model.streamer.register_upload_hook(lambda i, upload: uploads.append(i) or upload())
    assert torch.equal(euler_sample(model, x, ctx, steps=3), ref)
    handle.remove()
    # each step's layers once: the first two steps queue the next one's first layers, the last none
    assert len(uploads) == 3 * (TINY.n_blocks - 1)


def _device_of(m, budget):
    """Make ``m``'s forwards run out of memory whenever its layers, slots, fixed part and the step's
    activations would need more than ``budget`` bytes: a small GPU, on the CPU."""
    from zimage_core import device_memory
    run = m.model.forward

    def forward(x, *args, **kwargs):
        need = m.cfg.fixed_params() * m.dtype.itemsize + m.streamer.device_bytes + device_memory.activation_bytes(
            m.cfg, x.shape[-1] * 8, x.shape[-2] * 8, x.shape[0], dtype=m.dtype, storage=m.storage_dtype)
        if need > budget:
            raise torch.OutOfMemoryError(f"a device of {budget} bytes: {need} needed")
        return run(x, *args, **kwargs)
    return forward


def test_out_of_memory_evicts_and_retries(tiny_file, monkeypatch):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    try:
        x, t, ctx = inputs(TINY)
        m.prepare(64, 48, resident_layers=TINY.n_blocks)
        ref = m(x, t, ctx)
        splits = []
        with monkeypatch.context() as mp:
            mp.setattr(m.model, "forward", _device_of(m, 1))  # far too little: must end with everything streamed
            with pytest.raises(OutOfDeviceMemory, match="even with every layer streamed"), m.status_to(splits.append):
                m(x, t, ctx)
        assert m.streamer.n_resident == 0
        # a device that holds two resident layers less than all of them
        m.prepare(64, 48, resident_layers=TINY.n_blocks)
        layer = m.streamer.layout.nbytes
        from zimage_core import device_memory
        act = device_memory.activation_bytes(TINY, 64, 48, 1, dtype=torch.float32, storage=torch.float32)
        fixed = TINY.fixed_params() * 4
        monkeypatch.setattr(m.model, "forward", _device_of(m, fixed + act + (TINY.n_blocks - 1) * layer))
        splits.clear()
        with m.status_to(splits.append):
            out = m(x, t, ctx)
        assert torch.equal(out, ref)
        assert 0 < m.streamer.n_resident < TINY.n_blocks
        assert m.streamer.device_bytes <= (TINY.n_blocks - 1) * layer
        assert splits and "streamed" in splits[-1]
    finally:
        m.release()


def test_masters_are_made_at_first_upload_within_the_cap_and_released(tiny_file):
    """Loading packs no layer; a forward gives streamed layers masters while the cap has room (the
    first ones to run), reads the rest from the file, and the output is the resident one."""
    from zimage_core.layout import PackLayout
    layer = PackLayout(TINY, torch.float32).nbytes
    fixed = TINY.fixed_params() * 4
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32", settings=Settings(pinned_cap=fixed + 2 * layer))
    assert m.streamer.masters.master_layers == 0 and host_memory.live_bytes() - before == fixed
    x, t, ctx = inputs(TINY)
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    assert m.streamer.masters.master_layers == 0  # resident layers need no host copy
    m.prepare(64, 48, resident_layers=0)
    assert torch.equal(m(x, t, ctx), ref)
    assert [i for i, h in enumerate(m.streamer.masters.host) if h is not None] == [0, 1]
    assert host_memory.live_bytes() - before == fixed + 2 * layer
    assert torch.equal(m(x, t, ctx), ref)  # masters and file reads again, same bits
    m.release()
    assert host_memory.live_bytes() == before


def test_layers_without_masters_come_through_staging_with_the_files_bytes(tiny_file):
    """Past the budget, streamed layers are read from the file into a staging buffer at every
    upload: its bytes are the file's, and the output is the resident one."""
    from zimage_core.checkpoint import Checkpoint
    fixed = TINY.fixed_params() * 4
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32", settings=Settings(pinned_cap=fixed))
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    m.prepare(64, 48, resident_layers=0)
    assert torch.equal(m(x, t, ctx), ref)
    s = m.streamer
    assert s.masters.master_layers == 0 and len(s.masters._staging) == 1  # no room for a master nor a second buffer
    last = TINY.n_blocks - 1  # the last upload of the forward
    staged = s.layout.views(s.masters._staging[0][0])
    ck = Checkpoint(tiny_file)
    for name, key in (("qkv", "attention.qkv"), ("out", "attention.out"), ("w2", "feed_forward.w2")):
        assert torch.equal(getattr(staged, name), ck.tensor(f"{TINY.block_names()[last]}.{key}.weight"))
    ck.close()
    m.release()


@pytest.mark.parametrize("chunk", [97, 1000, 1 << 30])
def test_chunked_fill_equals_a_whole_fill(tiny_file, chunk):
    """A layer packed a chunk at a time (what the staging ring does; chunk boundaries fall inside
    pieces and inside the fused matrices' rows) has the bits of a layer packed whole, from the file
    (partial reads, cast to bf16 on the way) and from tensors."""
    from zimage_core.checkpoint import Checkpoint
    from zimage_core.transformer import layer_pieces
    ck = Checkpoint(tiny_file)
    layout = PackLayout(TINY, torch.bfloat16)
    from_file = layer_pieces(ck, TINY.block_names()[1] + ".")
    from_tensors = {n: [(row, st.file.tensor(st.key)) for row, st in parts] for n, parts in from_file.items()}
    for pieces in (from_file, from_tensors):
        whole = torch.zeros(layout.numel, dtype=torch.bfloat16)
        layout.fill(whole, pieces)
        chunked = torch.zeros(layout.numel, dtype=torch.bfloat16)
        for start in range(0, layout.numel, chunk):
            part = torch.full((min(chunk, layout.numel - start),), 7.0, dtype=torch.bfloat16)
            layout.fill(part, pieces, start)
            chunked[start:start + part.numel()] = part
        for n in layout.shapes:
            assert torch.equal(layout.region(chunked, n), layout.region(whole, n)), n
    assert layout.views(whole).qkv.abs().sum() > 0
    ck.close()


def test_uploads_through_a_staging_ring_of_small_chunks_are_bit_identical(tiny_file, monkeypatch):
    """Chunks much smaller than a layer (every upload takes several turns of the ring, and the
    ring wraps inside a layer): the output is the resident one."""
    from zimage_core import layout as layout_module
    monkeypatch.setattr(layout_module, "STAGING_CHUNK", 1000)
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32", settings=Settings(pinned_cap=TINY.fixed_params() * 4))
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    m.prepare(64, 48, resident_layers=0)
    assert m.streamer.masters.chunk * 4 < m.streamer.layout.numel
    assert torch.equal(m(x, t, ctx), ref)
    m.release()


def test_fp8_storage_streams_and_matches_upcast_weights(tmp_path):
    from tools.random_weights import write_checkpoint
    path = str(tmp_path / "fp8.safetensors")
    write_checkpoint(path, TINY, dtype=torch.float8_e4m3fn, seed=2)
    m = ZImageTransformer.load(path, device="cpu", dtype="bf16")
    assert m.storage_dtype == torch.float8_e4m3fn
    assert m.streamer.layout.nbytes * 2 == ZImageTransformer.load(path, device="cpu", dtype="bf16",
                                                                  weight_dtype="bf16").streamer.layout.nbytes
    x, t, ctx = inputs(TINY)
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    m.prepare(64, 48, resident_layers=0)
    assert torch.equal(m(x, t, ctx), ref)
    up = ZImageTransformer.load(path, device="cpu", dtype="bf16", weight_dtype="bf16")
    up.prepare(64, 48, resident_layers=TINY.n_blocks)
    assert torch.equal(up(x, t, ctx), ref)


def test_forward_builds_no_autograd_graph(model):
    x, t, ctx = inputs(TINY)
    assert not any(p.requires_grad for p in model.parameters())
    assert model(x.requires_grad_(), t, ctx).grad_fn is None


def test_dropping_a_model_releases_its_host_buffers(tiny_file):
    import gc
    before = host_memory.live_bytes()
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    assert host_memory.live_bytes() > before
    del m
    gc.collect()
    assert host_memory.live_bytes() == before


def test_set_weight_reaches_resident_and_streamed_layers_and_restores(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    x, t, ctx = inputs(TINY)
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    base = m(x, t, ctx)
    keys = ["layers.0.attention.qkv.weight", f"layers.{TINY.n_layers - 1}.feed_forward.w2.weight",
            "noise_refiner.0.feed_forward.w1.weight", "x_embedder.weight"]
    for k in keys:
        m.weights.set(k, m.weights.base(k) * 1.5)
    patched = m(x, t, ctx)
    assert not torch.equal(patched, base)
    m.prepare(64, 48, resident_layers=0)
    assert torch.equal(m(x, t, ctx), patched)
    for k in keys:
        m.weights.set(k, m.weights.base(k))
    assert torch.equal(m(x, t, ctx), base)
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    assert torch.equal(m(x, t, ctx), base)
    shapes = m.state_dict()
    assert shapes["layers.0.attention.qkv.weight"].is_meta and shapes["x_embedder.weight"].device.type == "cpu"
    m.release()


def test_resident_layers_are_spread_and_nested():
    """Every count of resident layers spreads them evenly (no run of streamed layers is more than
    about twice the even share), and one more resident layer keeps the others where they are."""
    for n in (4, 7, 30, 36):
        order = residency_order(n)
        assert sorted(order) == list(range(n))
        for r in range(1, n):
            keep = sorted(order[:r])
            runs = [b - a - 1 for a, b in zip([-1] + keep, keep + [n])]
            assert max(runs) <= 2 * (n - r) / (r + 1) + 1, (n, r, keep)


def test_uploads_run_ahead_into_the_next_forward_only_when_asked():
    """Each forward uploads its streamed layers once, in order. With ``next_forward`` the slots
    freed by its last layers take the next forward's first layers (the slot of a layer moves from
    forward to forward when the streamed count is not a multiple of the slots); without it nothing
    is queued past the forward. A forward stopped midway leaves the next one right."""
    layout = PackLayout({"w": (4, 8)}, torch.float32)
    n, r, k = 7, 2, 3
    sources = [{"w": [(0, torch.full((4, 8), float(i)))]} for i in range(n)]
    s = LayerStreamer(StreamConfig(layout, "cpu"), sources, HostPool())
    s.configure(r, k)
    assert sorted(s.resident) == [1, 3] and s.streamed == [0, 2, 4, 5, 6]
    uploads = []
    s.register_upload_hook(lambda i, upload: uploads.append(i) or upload())
    for forward, ahead in enumerate([True, True, True, False]):
        s.prefetch_first()
        assert s.run_layers([], lambda i, x, w: x + [int(w["w"][0, 0])], next_forward=ahead) == list(range(n))
        s.synchronize()  # the uploads queued ahead are done (on the upload thread)
        held = sorted(int(t[0]) for t in s.slots)
        assert held == ([0, 2, 4] if ahead else [4, 5, 6]), forward
    assert len(uploads) == 4 * (n - r)

    def stop_at_5(i, x, w):
        if i == 5:
            raise KeyboardInterrupt
        return x + [int(w["w"][0, 0])]
    s.prefetch_first()
    with pytest.raises(KeyboardInterrupt):
        s.run_layers([], stop_at_5, next_forward=True)
    s.prefetch_first()
    assert s.run_layers([], lambda i, x, w: x + [int(w["w"][0, 0])]) == list(range(n))


def test_set_weight_reaches_a_layer_uploaded_ahead(tiny_file):
    """A forward that another step follows leaves the next step's first streamed layers in their
    slots; a weight patched in between must still reach them."""
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    x, t, ctx = inputs(TINY)
    key = "layers.1.feed_forward.w1.weight"
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    m.weights.set(key, m.weights.base(key) * 1.5)
    patched = m(x, t, ctx)
    m.weights.set(key, m.weights.base(key))
    m.prepare(64, 48, resident_layers=1)
    more = {"sample_sigmas": torch.tensor([1.0, 0.5, 0.0]), "sigmas": torch.tensor([1.0])}
    uploads = []
    m.streamer.register_upload_hook(lambda i, upload: uploads.append(i) or upload())
    m(x, t, ctx, transformer_options=more)
    assert uploads and int(m.streamer._queued) > int(m.streamer._base)
    m.weights.set(key, m.weights.base(key) * 1.5)
    assert torch.equal(m(x, t, ctx), patched)
    m.release()


def test_a_forward_in_ranges_that_look_ahead_differently_still_gets_every_layer():
    """A range run without ``next_forward`` leaves its slots' next uploads unqueued; the next forward
    queues them where it needs them, so every layer still runs on its own weights."""
    layout = PackLayout({"w": (4, 8)}, torch.float32)
    n = 6
    sources = [{"w": [(0, torch.full((4, 8), float(i)))]} for i in range(n)]
    s = LayerStreamer(StreamConfig(layout, "cpu"), sources, HostPool())
    s.configure(3, 3)  # as many slots as streamed layers: each slot's next upload is the next forward's
    for _ in range(3):
        s.prefetch_first()
        got = s.run_layers([], lambda i, x, w: x + [int(w["w"][0, 0])], range(0, 2))
        got = s.run_layers(got, lambda i, x, w: x + [int(w["w"][0, 0])], range(2, n), next_forward=True)
        assert got == list(range(n))


def test_uploads_under_inference_mode_as_comfyui_runs_nodes(tiny_file):
    """ComfyUI runs nodes under ``torch.inference_mode``, which is per thread: the upload thread
    writes into slots, resident buffers and masters made under it, and the output is the same."""
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16", settings=Settings(pinned_cap=0))
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    with torch.inference_mode():
        for resident in (TINY.n_blocks - 1, 2, 0, TINY.n_blocks):  # promotions and uploads from the file
            m.prepare(64, 48, resident_layers=resident)
            assert torch.equal(m(x, t, ctx), ref), resident
    m.release()


def test_streamed_layers_the_plan_leaves_in_the_file_get_no_master(tiny_file):
    """``configure(..., masters)``: the streamed layers named get masters at their first upload,
    the others keep coming from the file; masters made before stay; with no set given, the last
    one holds; the output is the same."""
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    m.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    s = m.streamer
    s.configure(0, 2, masters=frozenset({0, 3}))
    assert torch.equal(m(x, t, ctx), ref)
    assert [i for i, h in enumerate(s.masters.host) if h is not None] == [0, 3]
    s.configure(0, 2, masters=frozenset())
    assert torch.equal(m(x, t, ctx), ref) and s.masters.master_layers == 2
    s.configure(2, 2, masters=frozenset(range(TINY.n_blocks)))
    s.configure(0, 2)  # evicted beyond the plan: the planned set still holds
    assert torch.equal(m(x, t, ctx), ref) and s.masters.master_layers == TINY.n_blocks
    m.release()


def test_file_uploads_count_the_layers_read_from_the_checkpoint(tiny_file):
    """``file_uploads``: every upload that read the file (a resident layer's promotion, a streamed
    layer without a master, a master's making), none that came from a master."""
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    n, s = TINY.n_blocks, m.streamer
    m.prepare(64, 48, resident_layers=n)
    ref = m(x, t, ctx)
    assert m.file_uploads == n  # each resident layer read once, nothing since
    s.configure(0, 2, masters=frozenset({0, 3}))
    assert torch.equal(m(x, t, ctx), ref)
    s.synchronize()
    assert m.file_uploads == 2 * n  # two masters made from the file, the other layers read from it
    assert torch.equal(m(x, t, ctx), ref)
    s.synchronize()
    assert m.file_uploads == 3 * n - 2  # the two masters read nothing
    m.release()


@pytest.mark.parametrize("small_chunks", [False, True])
def test_compressed_masters_stream_the_same_bits_at_every_split(tiny_file, monkeypatch, small_chunks):
    """With ``compress`` the streamed layers' masters are stored compressed (0.75-0.78 of their bytes)
    and decoded into the slot at every upload: the output is the uncompressed model's, bit for
    bit, whatever the split; a weight patch still reaches a compressed layer. ``small_chunks``: a
    layer is encoded through both staging buffers, several chunks each (a full-size layer's
    shape: 22 chunks in 6 buffers)."""
    from zimage_core import compression, layout as layout_module
    if small_chunks:
        monkeypatch.setattr(compression, "CHUNK", 4096)
        monkeypatch.setattr(layout_module, "STAGING_CHUNK", 3 * 4096 * 2)
    x, t, ctx = inputs(TINY)
    before = host_memory.live_bytes()
    plain = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16")
    plain.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = plain(x, t, ctx)
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16", settings=Settings(compress="on"))
    try:
        for resident in (0, 2, TINY.n_blocks - 1, TINY.n_blocks, 0):
            m.prepare(64, 48, resident_layers=resident)
            assert torch.equal(m(x, t, ctx), ref)
        s = m.streamer
        assert all(c is not None for c in s.masters.codes) and s.masters.master_layers == TINY.n_blocks
        assert len(s.masters.codes[0]) == -(-s.layout.numel // compression.CHUNK)
        if small_chunks:
            assert len(s.masters._staging) == 2 and s.masters.chunk == 3 * 4096 < s.layout.numel / 2
        bound = compression.bound(s.layout.numel)
        assert all(h.dtype == torch.uint8 and h.numel() == bound for h in s.masters.host) and bound < 0.78 * s.layout.nbytes
        key = "layers.1.feed_forward.w2.weight"  # layer 1 streamed, its master compressed
        for model in (plain, m):
            model.weights.set(key, model.weights.base(key) * 1.5)
        assert s.masters.codes[plain.cfg.block_names().index("layers.1")] is None  # decoded into a plain master to be patched
        patched = plain(x, t, ctx)
        assert not torch.equal(patched, ref) and torch.equal(m(x, t, ctx), patched)
    finally:
        m.release()
        plain.release()
    assert host_memory.live_bytes() == before


def test_a_patch_of_a_layer_without_a_master_on_a_compressing_streamer_restores_every_bit(tiny_file):
    """A resident layer has no host master; a patch gives it one. Where the streamer compresses,
    that master must still be a plain one: the patch writes its values into it, and a compressed
    master written as if it were plain decodes into other weights (the layer's other matrices too)
    once the layer streams again. Patched, restored and streamed at every split: the plain model's
    outputs, bit for bit."""
    x, t, ctx = inputs(TINY)
    plain = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16")
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16", settings=Settings(compress="on"))
    try:
        for model in (plain, m):
            model.prepare(64, 48, resident_layers=2)
        ref = plain(x, t, ctx)
        assert torch.equal(m(x, t, ctx), ref)
        s = m.streamer
        layer = s.order[0]  # resident: no master yet
        assert s.masters.host[layer] is None and any(c is not None for c in s.masters.codes)
        key = f"{m.cfg.block_names()[layer]}.feed_forward.w2.weight"
        for model in (plain, m):
            model.weights.set(key, model.weights.base(key) * 1.5)
        assert s.masters.codes[layer] is None and s.masters.host[layer].dtype == torch.bfloat16
        patched = plain(x, t, ctx)
        assert not torch.equal(patched, ref) and torch.equal(m(x, t, ctx), patched)
        for model in (plain, m):
            model.weights.set(key, model.weights.base(key))
        for resident in (2, 0, TINY.n_blocks, 1):
            m.prepare(64, 48, resident_layers=resident)
            assert torch.equal(m(x, t, ctx), ref), resident
    finally:
        m.release()
        plain.release()


class _Scale:
    """A weight patch for ``LayerStreamer.set_patch``: ``matrix`` of ``layers`` times ``factor``."""

    def __init__(self, layers, matrix, factor):
        self.layers, self.matrix, self.factor = set(layers), matrix, factor
        self.verified = 0

    def apply(self, i, views):
        getattr(views, self.matrix).mul_(self.factor)

    def verify(self):
        self.verified += 1


@pytest.mark.parametrize("compress", ["off", "on"])
def test_a_patch_set_on_the_streamer_reaches_every_split_and_leaves_the_masters_alone(tiny_file, compress):
    """``set_patch``: a patch reaches resident and streamed layers alike (the same output as the same
    values written with ``set_weight``) at every split, writes no host master, and once removed
    (or replaced) every layer is its own again, bit for bit."""
    x, t, ctx = inputs(TINY)
    ref_model = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16")
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16", settings=Settings(compress=compress))
    try:
        ref_model.prepare(64, 48, resident_layers=TINY.n_blocks)
        m.prepare(64, 48, resident_layers=2)
        base = m(x, t, ctx)
        s = m.streamer
        layers = [s.order[0], s.order[-1]]  # one resident, one streamed
        names = [f"{m.cfg.block_names()[i]}.feed_forward.w1.weight" for i in layers]
        for key in names:
            ref_model.weights.set(key, ref_model.weights.base(key) * 2)
        patched = ref_model(x, t, ctx)
        masters = [None if h is None else h.clone() for h in s.masters.host]
        patch = _Scale(layers, "w1", 2)
        s.set_patch(patch)
        for resident in (2, 0, TINY.n_blocks, 1, 2):
            m.prepare(64, 48, resident_layers=resident)
            assert torch.equal(m(x, t, ctx), patched), resident
            assert torch.equal(m(x, t, ctx), patched), resident  # a resident layer is patched once
        assert patch.verified == 10
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(masters, s.masters.host[:len(masters)])
                   if a is not None)
        s.set_patch(_Scale(layers[:1], "w1", 1))  # another set: the first one's values are gone
        assert torch.equal(m(x, t, ctx), base)
        s.set_patch(None)
        for resident in (2, 0, TINY.n_blocks):
            m.prepare(64, 48, resident_layers=resident)
            assert torch.equal(m(x, t, ctx), base), resident
    finally:
        m.release()
        ref_model.release()


def test_a_model_lets_go_of_its_memory_while_another_runs_and_comes_back_the_same(tiny_file):
    """Switching checkpoints: when a second transformer plans, the first gives back its masters, its
    fixed part's and its staging (the RAM holds one model's); run again, it reads its layers from
    the file and gives the same bits, a patch of its fixed part included. A model without masters
    (every layer resident) keeps what it has, and one whose streamed layers were written by hand
    keeps them."""
    x, t, ctx = inputs(TINY)
    before = host_memory.live_bytes()
    a = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    b = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    try:
        key = "final_layer.linear.bias"
        a.weights.set(key, a.weights.base(key) + 0.5)
        a.prepare(64, 48, resident_layers=1)
        ref = a(x, t, ctx)
        assert a.streamer.masters.master_layers == TINY.n_blocks - 1 and a.pinned_bytes > 0
        held = host_memory.live_bytes()
        b.prepare(64, 48, resident_layers=1)
        assert a.pinned_bytes == 0 and a.streamer.masters.master_layers == 0 and a.device_bytes() == 0
        assert host_memory.live_bytes() < held
        other = b(x, t, ctx)
        assert not torch.equal(other, ref)  # b has no patch
        # a planned again, on the CPU with every layer resident (no masters), and b let go
        assert torch.equal(a(x, t, ctx), ref) and b.pinned_bytes == 0
        held = a.pinned_bytes
        b.prepare(64, 48, resident_layers=1)
        assert a.pinned_bytes == held and a.streamer.n_resident == TINY.n_blocks  # a keeps what it has
        key = "layers.0.attention.out.weight"
        b.weights.set(key, b.weights.base(key))
        b.prepare(64, 48, resident_layers=1)
        a.prepare(64, 48, resident_layers=1)
        assert b.pinned_bytes > 0 and b.streamer.masters.host[b.weights.layer_of(key)[0]] is not None
    finally:
        a.release()
        b.release()
    assert host_memory.live_bytes() == before

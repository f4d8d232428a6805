"""Every layout and dtype of zimage-spec.md loads to the same weights; bad files fail clearly."""
import json
import os
import struct

import pytest
import torch

from conftest import TINY
from zimage_core import host_memory
from zimage_core.checkpoint import Checkpoint, expected_shapes
from zimage_core.errors import CheckpointError
from tools.random_weights import write_checkpoint, write_safetensors
from zimage_core.settings import Settings
from zimage_core.transformer import ZImageTransformer

LAYOUTS = [("comfyui", 1), ("comfyui-prefixed", 1), ("diffusers", 1), ("diffusers", 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    path = str(d / "ref.safetensors")
    write_checkpoint(path, TINY, dtype=torch.float32, seed=3)
    ck = Checkpoint(path)
    ref = {k: ck.tensor(k).clone() for k in expected_shapes(TINY)}
    ck.close()
    return ref


@pytest.mark.parametrize("layout,shards", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_and_dtypes_load_the_same_weights(tmp_path, reference, layout, shards, dtype):
    path = str(tmp_path / "m.safetensors")
    [opened] = write_checkpoint(path, TINY, values=lambda k: reference[k], dtype=dtype, layout=layout, shards=shards)
    ck = Checkpoint(opened)
    try:
        assert ck.config == TINY
        assert ck.storage_dtype == dtype
        for k, v in reference.items():
            got = ck.tensor(k)
            assert got.dtype == dtype
            assert torch.equal(got, v.to(dtype)), k
    finally:
        ck.close()


def test_folder_with_index_and_stray_keys(tmp_path, reference):
    write_checkpoint(str(tmp_path / "diffusion_pytorch_model.safetensors"), TINY, values=lambda k: reference[k],
                     layout="diffusers", shards=2)
    ck = Checkpoint(str(tmp_path))
    assert ck.config.n_layers == TINY.n_layers
    ck.close()
    # a ComfyUI save: prefixed keys plus a stray norm_final.weight that must be ignored
    shapes = expected_shapes(TINY)
    entries = [("model.diffusion_model." + k, s, torch.bfloat16, lambda k=k: reference[k]) for k, s in shapes.items()]
    entries.append(("model.diffusion_model.norm_final.weight", (TINY.dim,), torch.bfloat16, lambda: torch.ones(TINY.dim)))
    path = str(tmp_path / "saved.safetensors")
    write_safetensors(path, entries)
    ck = Checkpoint(path)
    assert torch.equal(ck.tensor("layers.1.feed_forward.w2.weight"), reference["layers.1.feed_forward.w2.weight"].bfloat16())
    ck.close()


def test_main_layer_count_comes_from_the_keys(tmp_path):
    cfg = TINY.__class__(**{**TINY.__dict__, "n_layers": 7})
    path = str(tmp_path / "seven.safetensors")
    write_checkpoint(path, cfg)
    ck = Checkpoint(path)
    assert ck.config.n_layers == 7
    ck.close()


def _write_raw(path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _expect(path, *fragments):
    before = host_memory.live_bytes()
    with pytest.raises(CheckpointError) as e:
        ZImageTransformer.load(path, device="cpu", dtype="fp32")
    msg = str(e.value)
    assert os.fspath(path) in msg
    for f in fragments:
        assert f in msg, msg
    assert host_memory.live_bytes() == before
    return msg


def test_not_safetensors(tmp_path):
    p = tmp_path / "model.ckpt"
    p.write_bytes(b"PK\x03\x04 pickle")
    _expect(p, "only safetensors")
    p = tmp_path / "garbage.safetensors"
    p.write_bytes(os.urandom(64))
    _expect(p, "not a safetensors file")
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    _expect(p, "empty or truncated")
    _expect(tmp_path / "missing.safetensors", "does not exist")


def test_truncated(tmp_path, tiny_file):
    p = tmp_path / "cut.safetensors"
    data = open(tiny_file, "rb").read()
    p.write_bytes(data[: len(data) - 1000])
    _expect(p, "truncated", "1,000 bytes")


@pytest.mark.parametrize("key,what", [("double_blocks.0.img_attn.qkv.weight", "Flux"),
                                      ("decoder.conv_in.weight", "VAE"),
                                      ("model.embed_tokens.weight", "text encoder")])
def test_other_models_are_named(tmp_path, key, what):
    p = tmp_path / "other.safetensors"
    write_safetensors(str(p), [(key, (4, 4), torch.bfloat16, lambda: torch.zeros(4, 4))])
    _expect(p, "not a Z-Image transformer", what)


def test_missing_and_misshapen_keys(tmp_path, reference):
    shapes = expected_shapes(TINY)
    keep = {k: s for k, s in shapes.items() if k != "layers.2.attention.k_norm.weight"}
    p = tmp_path / "missing.safetensors"
    write_safetensors(str(p), [(k, s, torch.float32, lambda k=k: reference[k]) for k, s in keep.items()])
    _expect(p, "missing 1 Z-Image tensor", "layers.2.attention.k_norm.weight")
    p = tmp_path / "shape.safetensors"
    bad = dict(shapes, **{"layers.1.feed_forward.w2.weight": (TINY.dim, 10)})
    write_safetensors(str(p), [(k, s, torch.float32, lambda s=s: torch.zeros(s)) for k, s in bad.items()])
    _expect(p, "layers.1.feed_forward.w2.weight", "shape [256, 10]", "expected [256, 768]")


def test_unsupported_dtype(tmp_path, reference):
    shapes = expected_shapes(TINY)
    entries = [(k, s, torch.float32, lambda k=k: reference[k]) for k, s in shapes.items()]
    p = tmp_path / "int.safetensors"
    write_safetensors(str(p), entries)
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["x_pad_token"]["dtype"] = "I32"
    _write_raw(p, header, raw[8 + n:])
    _expect(p, "x_pad_token", "I32", "not supported")


def test_interrupt_while_packing_masters_leaves_nothing(tmp_path, tiny_file, monkeypatch):
    """Masters are packed during the first forward (on the upload thread); an interrupt there leaves no half-filled master
    and nothing counted, the next forward is right, and releasing gives everything back."""
    from conftest import inputs
    from zimage_core import layout as layout_module
    calls = {"n": 0}
    real = layout_module.PackLayout.fill

    def fill(self, flat, pieces):
        calls["n"] += 1
        if calls["n"] == 4:  # the fourth streamed layer being packed
            raise KeyboardInterrupt
        return real(self, flat, pieces)

    x, ts, ctx = inputs(TINY)
    ref_model = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    ref_model.prepare(64, 48, resident_layers=TINY.n_blocks)
    ref = ref_model(x, ts, ctx)
    ref_model.release()
    before = host_memory.live_bytes()
    t = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32")
    t.prepare(64, 48, resident_layers=0)
    monkeypatch.setattr(layout_module.PackLayout, "fill", fill)
    with pytest.raises(KeyboardInterrupt):
        t(x, ts, ctx)
    monkeypatch.setattr(layout_module.PackLayout, "fill", real)
    # the interrupted layer (the fourth) has no master; uploads queued behind it may have made theirs
    packed = t.streamer.masters.master_layers
    assert t.streamer.masters.host[3] is None and packed >= 3
    assert host_memory.live_bytes() - before == t.fixed_bytes + packed * t.streamer.layout.nbytes
    assert torch.equal(t(x, ts, ctx), ref)
    t.release()
    assert host_memory.live_bytes() == before


def test_bad_dtype_options(tiny_file):
    from zimage_core.errors import ZImageError
    with pytest.raises(ZImageError, match="compute dtype 'fp8'"):
        ZImageTransformer.load(tiny_file, device="cpu", dtype="fp8")
    with pytest.raises(ZImageError, match="weight dtype 'int8'"):
        ZImageTransformer.load(tiny_file, device="cpu", weight_dtype="int8")


def _rewrite_header(src, dst, edit):
    """Copy ``src`` to ``dst`` with its JSON header passed through ``edit(header) -> header``."""
    raw = open(src, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    _write_raw(dst, edit(json.loads(raw[8:8 + n])), raw[8 + n:])


KEY = "layers.0.feed_forward.w2.weight"


@pytest.mark.parametrize("edit,fragments", [
    (lambda h: list(h), ["not a JSON object"]),
    (lambda h: {**h, KEY: {**h[KEY], "data_offsets": [str(o) for o in h[KEY]["data_offsets"]]}},
     [KEY, "data_offsets"]),
    (lambda h: {**h, KEY: {k: v for k, v in h[KEY].items() if k != "shape"}}, [KEY, "shape"]),
    (lambda h: {**h, KEY: {**h[KEY], "shape": [10, 50]}}, [KEY, "span", "bytes"]),
    (lambda h: {**h, KEY: {**h[KEY], "data_offsets": [-64, h[KEY]["data_offsets"][1] - 64 - h[KEY]["data_offsets"][0]]}},
     [KEY, "data_offsets"]),
    (lambda h: {**h, KEY: {**h[KEY], "dtype": "Q7"}}, [KEY, "unknown dtype"]),
    (lambda h: {**h, "__metadata__": [1]}, ["__metadata__"]),
], ids=["list", "string-offsets", "no-shape", "offsets-vs-shape", "negative-offsets", "dtype", "metadata"])
def test_malformed_headers_are_named(tmp_path, tiny_file, edit, fragments):
    p = tmp_path / "bad.safetensors"
    _rewrite_header(tiny_file, p, edit)
    msg = _expect(p, *fragments)
    assert "\n" not in msg


def test_overlapping_tensors_are_refused(tmp_path, tiny_file):
    """Offsets that read another tensor's bytes (or the header's) must never load silently."""
    def shift(h):
        a, b = h[KEY]["data_offsets"]
        h[KEY]["data_offsets"] = [a - 8, b - 8]
        return h
    p = tmp_path / "overlap.safetensors"
    _rewrite_header(tiny_file, p, shift)
    _expect(p, "malformed header", KEY)


def test_trailing_bytes_are_refused(tmp_path, tiny_file):
    p = tmp_path / "long.safetensors"
    p.write_bytes(open(tiny_file, "rb").read() + b"\0" * 100)
    _expect(p, "100 bytes after its last tensor")


def test_misshapen_norm_is_the_one_named(tmp_path, reference):
    """One q_norm of the wrong size: the error names it, not its k_norm twin."""
    shapes = dict(expected_shapes(TINY), **{"layers.0.attention.q_norm.weight": (64,)})
    p = tmp_path / "qnorm.safetensors"
    write_safetensors(str(p), [(k, s, torch.float32, lambda s=s: torch.zeros(s)) for k, s in shapes.items()])
    msg = _expect(p, "layers.0.attention.q_norm.weight", "shape [64]", "expected [128]")
    assert "k_norm" not in msg


def test_file_changed_after_loading_is_an_error_not_a_crash(tmp_path, tiny_file):
    """A file truncated or rewritten in place while loaded (an interrupted re-download): layers read
    from it give a clear error; the process lives, and the model still releases cleanly."""
    import shutil
    from conftest import inputs
    p = tmp_path / "live.safetensors"
    shutil.copy(tiny_file, p)
    before = host_memory.live_bytes()
    t = ZImageTransformer.load(str(p), device="cpu", dtype="fp32", settings=Settings(pinned_cap=0))  # every layer read from the file
    t.prepare(64, 48, resident_layers=1)  # the other layers are read at every step
    x, ts, ctx = inputs(t.cfg)
    t(x, ts, ctx)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match="changed on disk after it was loaded"):
        t(x, ts, ctx)
    with open(p, "r+b") as f:  # rewritten to the same size: the modification time tells
        f.truncate(size)
    os.utime(p, ns=(1, 1))
    with pytest.raises(CheckpointError, match="changed on disk"):
        t(x, ts, ctx)
    t.release()
    assert host_memory.live_bytes() == before


def test_a_file_that_changes_while_a_master_is_encoded_leaves_no_master(tmp_path, tiny_file):
    """Compressed masters are encoded from the file at the first forward, their reads on a thread of
    their own: a file truncated before then gives the clear error, no half-encoded master stays, and
    the pool gives back everything."""
    import shutil
    from conftest import inputs
    p = tmp_path / "live.safetensors"
    shutil.copy(tiny_file, p)
    before = host_memory.live_bytes()
    t = ZImageTransformer.load(str(p), device="cpu", dtype="bf16", settings=Settings(compress="on"))
    t.prepare(64, 48, resident_layers=1)
    x, ts, ctx = inputs(t.cfg)
    s = t.streamer
    fixed = s.pool.used  # the fixed part's masters
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    with pytest.raises(CheckpointError, match="changed on disk after it was loaded"):
        t(x, ts, ctx)
    assert all(c is not None for h, c in zip(s.masters.host, s.masters.codes) if h is not None)
    assert s.pool.used == fixed + sum(h.numel() for h in s.masters.host if h is not None) + sum(
        b.numel() * b.element_size() for b, _ in s.masters._staging)
    t.release()
    assert host_memory.live_bytes() == before


def test_a_scale_beside_a_weight_that_is_not_fp8_is_refused(tmp_path, reference):
    """Scaled exports are read (tests/test_scaled_fp8.py); a scale beside a bf16 weight is no export
    ComfyUI makes: refused, not guessed at."""
    shapes = expected_shapes(TINY)
    entries = [(k, s, torch.bfloat16, lambda k=k: reference[k]) for k, s in shapes.items()]
    entries.append(("layers.0.feed_forward.w1.scale_weight", (1,), torch.float32, lambda: torch.ones(1)))
    p = tmp_path / "scaled.safetensors"
    write_safetensors(str(p), entries)
    _expect(p, "has a scale for layers.0.feed_forward.w1.weight", "not fp8 e4m3fn", "bf16 file")


def test_a_master_that_maps_the_file_is_never_written(tiny_file):
    """A tensor that is a view of the file's pages (as the fixed part's is on a GPU) and its own
    master (no room to copy it): a patch gives it a tensor of its own; the file stays as it was."""
    from zimage_core.device_copies import DeviceCopies, module_tensors
    from zimage_core.host_memory import HostPool, maps_file
    ckpt = Checkpoint(tiny_file)
    key = "t_embedder.mlp.0.weight"
    original = ckpt.tensor(key)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(ckpt.mapped(key, torch.float32), requires_grad=False)
    assert maps_file(module.weight) and torch.equal(module.weight, original)
    copies = DeviceCopies(module_tensors(module), "cpu", HostPool(pin=False, cap_bytes=0))
    copies.load()
    copies.write(module, "weight", original * 2)
    assert not maps_file(module.weight) and torch.equal(module.weight, original * 2)
    with copies.running():
        assert torch.equal(module.weight, original * 2)
    assert torch.equal(ckpt.tensor(key), original)
    assert ckpt.mapped(key, torch.bfloat16) is None  # stored as fp32: no view in another dtype
    ckpt.close()


@pytest.mark.parametrize("make", ["link loop", "no permission"])
def test_a_file_the_system_refuses_to_open(tmp_path, tiny_file, make):
    """One line naming the file and what to check, not an OSError's traceback (root reads any file,
    so the permission case runs only as another user)."""
    path = str(tmp_path / "z_image.safetensors")
    if make == "link loop":
        os.symlink(path, path)
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads every file: the permission case needs another user")
        import shutil
        shutil.copyfile(tiny_file, path)
        os.chmod(path, 0)
    before = host_memory.live_bytes()
    with pytest.raises(CheckpointError, match="cannot be read: .*Check that the user ComfyUI runs as may read it"):
        ZImageTransformer.load(path, device="cpu", dtype="fp32")
    assert host_memory.live_bytes() == before


def test_compression_asked_for_and_not_used_is_said_once(tiny_file, caplog):
    """ZIMAGE_COMPRESSION=on on a model whose layers cannot be compressed (fp32 on the CPU): said
    once, with why, not silently ignored."""
    t = ZImageTransformer.load(tiny_file, device="cpu", dtype="fp32", settings=Settings(compress="on"))
    with caplog.at_level("INFO", logger="zimage"):
        for size in ((64, 48), (48, 64)):
            t.prepare(*size)
    said = [r.getMessage() for r in caplog.records if "ZIMAGE_COMPRESSION=on" in r.getMessage()]
    assert len(said) == 1 and "not used, its layers are float32 here" in said[0], said

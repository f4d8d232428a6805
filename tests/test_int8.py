"""ComfyUI's int8_tensorwise files (``tools.int8_weights``: int8 codes, a float32 scale per row,
optionally ConvRot-rotated): the transformer computes what the weights ComfyUI dequantizes compute,
at every split, its streamed layers' masters keeping a byte a weight; malformed ones are refused by
name."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, inputs
from tools.int8_weights import write_int8
from zimage_core import int8_rows
from zimage_core.checkpoint import COMFY_PREFIX, Checkpoint
from zimage_core.errors import CheckpointError
from zimage_core.transformer import ZImageTransformer


def comfy_dequantized(path, dtype) -> dict:
    """{canonical key: value} of an int8_tensorwise file as ComfyUI dequantizes it for ``dtype``
    (comfy-kitchen's reference: ``codes.float() * scale``, then each group of inputs times the
    transposed Hadamard matrix, then the cast), written out here on its own."""
    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".comfy_quant")):
            continue
        layer = k[:-len(".weight")]
        if layer + ".comfy_quant" not in sd:
            out[k.removeprefix(COMFY_PREFIX)] = v.to(dtype)
            continue
        conf = json.loads(bytes(sd[layer + ".comfy_quant"].tolist()))
        w = v.float() * sd[layer + ".weight_scale"]
        if conf.get("convrot"):
            g = conf["convrot_groupsize"]
            h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
            h = h4
            while h.shape[0] < g:
                h = torch.kron(h, h4)
            h = h / g ** 0.5
            w = torch.matmul(w.reshape(w.shape[0], -1, g), h.T).reshape(w.shape)
        out[k.removeprefix(COMFY_PREFIX)] = w.to(dtype)
    return out


@pytest.mark.parametrize("rotation", [0, 256], ids=["rows", "convrot"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_int8_file_computes_what_comfyui_dequantizes(tmp_path, tiny_file, rotation, dtype):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    path = str(write_int8(tiny_file, tmp_path / "tiny_int8.safetensors", rotation))
    save_file(comfy_dequantized(path, torch_dtype), str(tmp_path / "ref.safetensors"))
    ck = Checkpoint(path)
    assert ck.streams_blocks and ck.config == TINY
    ck.close()
    x, t, ctx = (v.to(torch_dtype) if v.is_floating_point() and v.dim() > 1 else v for v in inputs(TINY))
    ref = ZImageTransformer.load(str(tmp_path / "ref.safetensors"), device="cpu", dtype=dtype)
    expected = ref(x, t, ctx)
    ref.release()
    m = ZImageTransformer.load(path, device="cpu", dtype=dtype)
    s = m.streamer
    for resident in (TINY.n_blocks, 1, 0):
        m.prepare(64, 48, resident_layers=resident)
        assert torch.equal(m(x, t, ctx), expected), resident
    # the streamed layers' masters keep the codes, a byte a weight (the scales stay with the file's tensors)
    masters = [i for i in range(TINY.n_blocks) if s.masters.blocks[i] is not None]
    assert masters and all(s.masters.blocks[i]["w2"].type_name == "I8" for i in masters)
    assert s.masters.master_bytes == s.layout.numel
    # and the blocks a plan keeps on the device (the CPU stands in) give the same
    s.configure(0, 2, TINY.n_blocks)
    assert s.masters.blocks_on_device == TINY.n_blocks and torch.equal(m(x, t, ctx), expected)
    m.release()


def test_rows_dequantized_a_piece_at_a_time_are_the_whole_matrix_s(monkeypatch):
    """The pack dequantizes a few hundred rows at a time (``ROWS_PIECE_WEIGHTS``), ComfyUI a matrix:
    at Z-Image's shapes a row's values do not depend on the rows rotated beside it (a matrix product
    of a handful of rows may round differently: the pieces are never that small)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (1500, 3840), generator=g, dtype=torch.int8)
    scale = torch.rand(1500, 1, generator=g) * 1e-3
    monkeypatch.setattr(int8_rows, "ROWS_PIECE_WEIGHTS", codes.numel())
    whole = int8_rows.dequantize(codes, scale, 256, torch.float32)
    monkeypatch.setattr(int8_rows, "ROWS_PIECE_WEIGHTS", 409 * 3840)  # the last piece shorter
    assert torch.equal(int8_rows.dequantize(codes, scale, 256, torch.float32), whole)
    h = int8_rows.hadamard(64, torch.device("cpu"))
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)  # orthogonal: the rotation loses nothing


def _rewrite(path, change):
    sd = load_file(str(path))
    change(sd)
    save_file(sd, str(path))
    return str(path)


QKV = COMFY_PREFIX + "layers.1.attention.qkv"


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop(QKV + ".comfy_quant"), "stores model.diffusion_model.layers.1.attention.qkv.weight as int8 "
                                              "without ComfyUI's int8_tensorwise quant config"),
    (lambda sd: sd.__setitem__(QKV + ".comfy_quant", torch.tensor(list(json.dumps(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 100}).encode()), dtype=torch.uint8)),
     r"rotates model.diffusion_model.layers.1.attention.qkv \(ConvRot\) in groups of 100, which is not a power of 4"),
    (lambda sd: sd.__setitem__(QKV + ".weight_scale", sd[QKV + ".weight_scale"].reshape(1, -1)),
     r"has a weight_scale of shape \[1, 768\] for model.diffusion_model.layers.1.attention.qkv \[768, 256\]"),
    (lambda sd: sd.pop(QKV + ".weight_scale"), "has no weight_scale for the int8 layer"),
    (lambda sd: sd.__setitem__(QKV + ".weight", sd[QKV + ".weight"].to(torch.bfloat16)),
     r"marks model.diffusion_model.layers.1.attention.qkv int8_tensorwise, but stores it as torch.bfloat16"),
], ids=["no config", "rotation", "scale shape", "no scale", "not int8"])
def test_a_malformed_int8_file_is_refused_by_name(tmp_path, tiny_file, change, message):
    path = _rewrite(write_int8(tiny_file, tmp_path / "int8.safetensors", 256), change)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(path)


def test_a_patch_on_an_int8_file_patches_its_dequantized_weights(tmp_path, tiny_file):
    """A weight patch (a LoRA's place, ``set_patch``) reaches an int8 layer's dequantized values where
    they land, streamed, resident and kept on the device alike: the output of the same patch on the
    weights ComfyUI dequantizes; removed, the layer is its own again."""
    from test_streaming import _Scale
    path = str(write_int8(tiny_file, tmp_path / "tiny_int8.safetensors", 256))
    save_file(comfy_dequantized(path, torch.float32), str(tmp_path / "ref.safetensors"))
    x, t, ctx = inputs(TINY)
    ref = ZImageTransformer.load(str(tmp_path / "ref.safetensors"), device="cpu", dtype="fp32")
    m = ZImageTransformer.load(path, device="cpu", dtype="fp32")
    try:
        ref.prepare(64, 48, resident_layers=TINY.n_blocks)
        m.prepare(64, 48, resident_layers=1)
        base = m(x, t, ctx)
        s = m.streamer
        layers = [s.order[0], s.order[-1]]  # one resident, one streamed
        ref.streamer.set_patch(_Scale(layers, "w2", 1.5))
        patched = ref(x, t, ctx)
        s.set_patch(_Scale(layers, "w2", 1.5))
        for resident, blocks in ((1, 0), (0, 0), (1, TINY.n_blocks - 1), (TINY.n_blocks, 0)):
            s.configure(resident, 2, blocks)
            assert torch.equal(m(x, t, ctx), patched), (resident, blocks)
        s.set_patch(None)
        s.configure(1, 2)
        assert torch.equal(m(x, t, ctx), base)
    finally:
        m.release()
        ref.release()

"""Scaled fp8 files as ComfyUI writes them (``tools.fp8_weights``: the legacy ``scaled_fp8`` layout
and the mixed-precision quant layout): the transformer computes what the weights ComfyUI would
dequantize compute (``weight.to(dtype) * scale.to(dtype)``), at every split, its streamed layers'
masters keeping the fp8 bytes; a format the pack cannot read is refused by name, nothing left open."""
import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY, inputs
from tools.fp8_weights import write_scaled_fp8
from zimage_core.checkpoint import COMFY_PREFIX, Checkpoint
from zimage_core.errors import CheckpointError
from zimage_core.transformer import ZImageTransformer


def comfy_dequantized(path, dtype) -> dict:
    """{canonical key: value} of a scaled fp8 file as ComfyUI dequantizes it for ``dtype``."""
    from safetensors import safe_open
    out = {}
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        for k in keys:
            if k.endswith((".scale_weight", ".weight_scale", ".scale_input", ".comfy_quant")) or k.endswith("scaled_fp8"):
                continue
            w = f.get_tensor(k)
            layer = k[:-len(".weight")]
            scale = next((f.get_tensor(layer + s) for s in (".scale_weight", ".weight_scale") if layer + s in keys), None)
            out[k.removeprefix(COMFY_PREFIX)] = w.to(dtype) * scale.to(dtype) if scale is not None else w.to(dtype)
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["scaled_fp8", "mixed"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_scaled_fp8_file_computes_what_comfyui_dequantizes(tmp_path, tiny_file, mixed, dtype):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    path = str(write_scaled_fp8(tiny_file, tmp_path / "tiny_fp8.safetensors", mixed=mixed))
    save_file(comfy_dequantized(path, torch_dtype), str(tmp_path / "ref.safetensors"))
    ck = Checkpoint(path)
    assert ck.streams_blocks and ck.config == TINY
    ck.close()
    x, t, ctx = inputs(TINY)
    ref = ZImageTransformer.load(str(tmp_path / "ref.safetensors"), device="cpu", dtype=dtype)
    expected = ref(x.to(torch_dtype), t, ctx.to(torch_dtype))
    ref.release()
    m = ZImageTransformer.load(path, device="cpu", dtype=dtype)
    s = m.streamer
    assert s.config.quantized
    for resident in (TINY.n_blocks, 1, 0):
        m.prepare(64, 48, resident_layers=resident)
        assert torch.equal(m(x.to(torch_dtype), t, ctx.to(torch_dtype)), expected), resident
    # the streamed layers' masters keep the fp8 bytes: a byte a weight
    masters = [i for i in range(TINY.n_blocks) if s.masters.blocks[i] is not None]
    assert masters and all(s.masters.blocks[i]["qkv"].type_name == "F8_E4M3" for i in masters)
    assert s.masters.master_bytes == s.layout.numel
    m.release()


def test_a_quant_format_the_pack_cannot_read_is_named(tmp_path, tiny_file):
    path = write_scaled_fp8(tiny_file, tmp_path / "nvfp4.safetensors", mixed=True,
                            formats={"layers.1.feed_forward.w2.weight": "nvfp4"})
    with pytest.raises(CheckpointError, match="layers.1.feed_forward.w2 in ComfyUI's quant format 'nvfp4', which this "
                                              r"pack cannot read \(it reads float8_e4m3fn, int8_tensorwise\)"):
        Checkpoint(str(path))

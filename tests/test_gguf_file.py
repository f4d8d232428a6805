"""GGUF transformer files as ComfyUI-GGUF's converter writes them (``tools.gguf_weights``): every
tensor read back as the gguf package dequantizes it, the transformer computing what its dequantized
weights compute with its layers streamed as their blocks, and each bad file refused in one line
naming what is wrong."""
import os

import numpy as np
import pytest
import torch

from conftest import TINY, inputs
from tools.gguf_weights import write_gguf
from zimage_core.checkpoint import COMFY_PREFIX, Checkpoint
from zimage_core.errors import CheckpointError
from zimage_core.gguf_file import read_gguf
from zimage_core.settings import Settings
from zimage_core.transformer import ZImageTransformer

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) writes the test files")


def reference(path) -> dict:
    """{key: float32 values} of a GGUF file as the gguf package reads and dequantizes it."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name.removeprefix(COMFY_PREFIX)] = values.reshape(tuple(int(v) for v in reversed(t.shape)))
    return out


@pytest.mark.parametrize("quant, prefix", [("Q8_0", False), ("Q4_0", True), ("Q4_1", False), ("Q5_0", False)])
def test_every_tensor_reads_back_as_the_gguf_package_reads_it(tmp_path, tiny_file, quant, prefix):
    want = reference(write_gguf(tiny_file, tmp_path / "tiny.gguf", quant, prefix))
    got = read_gguf(str(tmp_path / "tiny.gguf"))
    assert set(got) == set(want)
    quantized = [k for k, t in got.items() if t.type_name == quant]
    assert len(quantized) == 5 * TINY.n_blocks  # every big matrix, stored quantized
    for key, t in got.items():
        assert tuple(t.shape) == want[key].shape, key
        assert np.array_equal(t.values().numpy(), want[key]), key
    # the stored bytes are the file's, not a copy: a quantized matrix takes its blocks' bytes
    k = quantized[0]
    assert got[k].data.numel() < got[k].values().numel() * 2


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_gguf_loads_and_computes_what_its_dequantized_weights_compute(tmp_path, tiny_file, quant):
    """The transformer loaded from a GGUF gives, at every split, the output of the same transformer
    loaded from a safetensors file of the weights the gguf package dequantizes; its streamed layers'
    masters keep their blocks (K-quants: the writer's random valid blocks)."""
    from safetensors.torch import save_file

    want = reference(write_gguf(tiny_file, tmp_path / "tiny.gguf", quant))
    save_file({k: torch.from_numpy(v) for k, v in want.items()}, str(tmp_path / "ref.safetensors"))
    ck = Checkpoint(str(tmp_path / "tiny.gguf"))
    assert ck.config == TINY and ck.streams_blocks
    ck.close()
    stored = read_gguf(str(tmp_path / "tiny.gguf"))
    assert stored["layers.0.attention.qkv.weight"].type_name == quant and stored["x_pad_token"].type_name == "F32"
    x, t, ctx = inputs(TINY)
    ref = ZImageTransformer.load(str(tmp_path / "ref.safetensors"), device="cpu", dtype="fp32")
    expected = ref(x, t, ctx)
    ref.release()
    m = ZImageTransformer.load(str(tmp_path / "tiny.gguf"), device="cpu", dtype="fp32")
    s = m.streamer
    assert s.config.quantized
    for resident in (TINY.n_blocks, 2, 0):
        m.prepare(64, 48, resident_layers=resident)
        assert torch.equal(m(x, t, ctx), expected), resident
    # the streamed layers' masters hold their blocks (34 bytes for 32 Q8_0 weights, 210 for 256 Q6_K
    # ones), not their fp32 values
    masters = [i for i in range(TINY.n_blocks) if s.masters.blocks[i] is not None]
    assert masters and all(s.masters.host[i].dtype == torch.uint8 for i in masters)
    assert s.masters.master_bytes < 0.3 * s.layout.nbytes
    # a weight written into a quantized layer (set_weight) makes its master plain, and comes back
    key = f"{TINY.block_names()[masters[0]]}.feed_forward.w2.weight"
    m.weights.set(key, m.weights.base(key) * 1.5)
    assert s.masters.plain(masters[0]) and not torch.equal(m(x, t, ctx), expected)
    m.weights.set(key, m.weights.base(key))
    assert torch.equal(m(x, t, ctx), expected)
    m.release()


def _write(path, arch, tensors):
    """A GGUF of ``tensors`` {name: (bytes or values, raw type or None)}."""
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw_type) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    _write(tmp_path / "flux.gguf", "flux", {"double_blocks.0.img_attn.qkv.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(CheckpointError, match=r"flux.gguf: is a GGUF of architecture 'flux', not a Z-Image"):
        read_gguf(str(tmp_path / "flux.gguf"))


def test_a_type_the_pack_cannot_dequantize_is_named(tmp_path):
    # IQ4_NL blocks are as long as Q4_0's (18 bytes for 32 weights): a file that stores one
    blocks = gguf.quants.quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q4_0)
    _write(tmp_path / "iq.gguf", "lumina2", {"layers.0.attention.qkv.weight": (blocks, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(CheckpointError) as e:
        read_gguf(str(tmp_path / "iq.gguf"))
    msg = str(e.value)
    assert "as IQ4_NL, which this pack cannot dequantize" in msg and "Q8_0" in msg and "\n" not in msg


def test_a_truncated_gguf_is_refused(tmp_path, tiny_file):
    path = write_gguf(tiny_file, tmp_path / "cut.gguf")
    os.truncate(path, os.path.getsize(path) * 2 // 3)
    with pytest.raises(CheckpointError, match=r"cut.gguf: .*(truncated|damaged)"):
        read_gguf(str(path))
    os.truncate(path, 100)  # inside the header
    with pytest.raises(CheckpointError, match=r"cut.gguf: .*(truncated|damaged)"):
        read_gguf(str(path))


def test_a_gguf_changed_under_a_loaded_model_is_refused(tmp_path, tiny_file):
    """Its layers are read from the file's mapping: a file rewritten since it was loaded (a new
    download over it) stops the next upload with a clear error instead of reading it."""
    from zimage_core.safetensors_file import FileChanged

    path = write_gguf(tiny_file, tmp_path / "live.gguf")
    # no room for masters: every upload reads the file
    m = ZImageTransformer.load(str(path), device="cpu", dtype="fp32", settings=Settings(pinned_cap=0))
    m.prepare(64, 48, resident_layers=0)
    os.utime(path, ns=(0, 0))
    with pytest.raises(FileChanged, match="live.gguf: changed on disk"):
        m(*inputs(TINY))
    m.release()


def test_a_gguf_with_a_mismatched_shape_is_refused_and_leaves_nothing(tmp_path, tiny_file):
    """One matrix of another model's size: the loader names it and its shapes, in one line, and no
    host memory stays claimed."""
    from zimage_core import host_memory
    ck = Checkpoint(tiny_file)
    tensors = {k: (ck.tensor(k, dtype=torch.float32).numpy(), None) for k in ck.keys()}
    ck.close()
    key = "layers.1.feed_forward.w2.weight"
    rows, cols = tensors[key][0].shape
    tensors[key] = (np.zeros((rows, cols + 32), np.float32), None)
    _write(tmp_path / "odd.gguf", "lumina2", tensors)
    before = host_memory.live_bytes()
    with pytest.raises(CheckpointError) as e:
        ZImageTransformer.load(str(tmp_path / "odd.gguf"), device="cpu", dtype="fp32")
    msg = str(e.value)
    assert f"has {key} with shape [{rows}, {cols + 32}], expected [{rows}, {cols}]" in msg and "\n" not in msg
    assert host_memory.live_bytes() == before


def test_blocks_kept_on_the_device_compute_what_streamed_blocks_compute(tmp_path, tiny_file):
    """Layers whose blocks the device keeps (``HostMasters.keep_on_device``; the CPU stands in for
    the device) are dequantized into their slot as they come: the output is the streamed one to the
    bit, no host master is made for them, the device counts their bytes, and a smaller split drops
    them."""
    path = str(write_gguf(tiny_file, tmp_path / "tiny.gguf", "Q8_0"))
    x, t, ctx = inputs(TINY)
    m = ZImageTransformer.load(path, device="cpu", dtype="fp32")
    m.prepare(64, 48, resident_layers=0)
    expected = m(x, t, ctx)
    m.release()
    m = ZImageTransformer.load(path, device="cpu", dtype="fp32")
    s, n = m.streamer, TINY.n_blocks
    m.prepare(64, 48, resident_layers=0)
    s.configure(1, 2, n - 1)
    kept = [i for i in range(n) if s.masters.on_device[i] is not None]
    assert len(kept) == n - 1 and s.split == (1, 2, n - 1) and s.order[0] not in kept
    assert s.device_bytes == 3 * s.layout.nbytes + sum(s.masters.stored_bytes[i] for i in kept)
    assert s.masters.device_bytes < 0.3 * (n - 1) * s.layout.nbytes  # Q8_0's blocks, not fp32 values
    read = []
    for _ in range(2):
        assert torch.equal(m(x, t, ctx), expected)
        s.synchronize()
        read.append(m.file_uploads)
    # the file is read once a layer: the resident one's upload, each kept layer's first fill
    assert read == [n, n]
    assert all(s.masters.host[i] is None for i in kept)  # nothing of theirs in host memory
    s.configure(1, 2, 1)
    assert s.split == (1, 2, 1) and s.masters.device_bytes == s.masters.stored_bytes[s.order[1]]
    assert torch.equal(m(x, t, ctx), expected)
    m.release()
    assert s.masters.blocks_on_device == 0

"""Another model run from pinned host masters (``DeviceCopies``: a VAE) and its layer stack streamed
through slots from its own tensors (``StreamedStack``: a text encoder): same output as the model
run whole, and every weight held in host memory once (a tensor that gets a master is pointed at
it; a streamed layer has none)."""
import copy
import os

import pytest
import torch

from zimage_core.device_copies import DeviceCopies, module_tensors
from zimage_core.host_memory import HostPool, live_bytes
from zimage_core.stack_streaming import StreamedStack, UnsupportedStack

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Encoder(torch.nn.Module):
    """An embedding and a final norm outside a stack of blocks, like a text encoder."""

    def __init__(self, d=32, n=5, vocab=50):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.norm = torch.nn.LayerNorm(d)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) * self.scale


def encoder_and_output(device, seed):
    """An Encoder kept on the host, token ids on ``device`` and the output of the model run whole there."""
    torch.manual_seed(seed)
    enc = Encoder().requires_grad_(False)
    ids = torch.randint(0, 50, (2, 7), device=device)
    whole = enc.to(device)(ids)
    return enc.cpu(), ids, whole


def addresses(module):
    return {k: v.data_ptr() for k, v in module.state_dict().items()}


def values(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def same_values(module, saved):
    return all(torch.equal(v, saved[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_streamed_stack_equals_whole_model(device, slots):
    enc, ids, whole = encoder_and_output(device, seed=0)
    own, where = values(enc), addresses(enc.layers)
    before = live_bytes()
    # every layer through the slots, even where the GPU has room for them
    stack = StreamedStack(enc, device, HostPool(), slots=slots, max_resident=0)
    if slots < len(enc.layers):
        assert stack.loaded_bytes < sum(p.nbytes for p in enc.parameters())
    assert stack.tables == [enc.embed]  # looked up on the host: neither uploaded nor counted
    # between runs only the tensors outside the stack; the slots are a run's working memory
    assert stack.loaded_bytes == enc.norm.weight.nbytes * 2 + enc.scale.nbytes
    assert stack.run_bytes == slots * stack.layout.nbytes
    for _ in range(3):  # the slots are reused across the forwards of a run, and made again for the next
        with stack.running():
            assert enc.embed.weight.device.type == "cpu"
            assert stack.device_bytes() == stack.loaded_bytes + stack.run_bytes
            assert torch.equal(enc(ids), whole)
            assert torch.equal(enc(ids), whole)
        assert not stack.streamer.slots
    # between runs the model holds its own values in its own tensors, the only copy in host
    # memory: the layers were uploaded from them, with no masters of their own
    assert same_values(enc, own) and addresses(enc.layers) == where
    assert all(p.device.type == "cpu" for p in enc.parameters())
    assert stack.streamer.masters.master_layers == 0
    assert stack.device_bytes() == stack.loaded_bytes
    assert stack.unload() == stack.loaded_bytes and stack.device_bytes() == 0
    stack.release()
    assert live_bytes() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stack_the_gpu_has_room_for_stays_there_between_runs():
    enc, ids, whole = encoder_and_output("cuda", seed=2)
    stack = StreamedStack(enc, "cuda", HostPool(), slots=2)
    uploads = []
    stack.streamer.register_upload_hook(lambda i, upload: uploads.append(i) or upload())
    for _ in range(2):
        with stack.running():
            assert torch.equal(enc(ids), whole)
        assert stack.streamer.n_resident == len(enc.layers) and not stack.streamer.slots
        assert not uploads  # nothing streamed: the second run uploads nothing
    assert stack.device_bytes() > stack.loaded_bytes  # more than it needs, from memory nobody held
    assert stack.unload() > 0 and stack.device_bytes() == 0
    stack.release()
    stack = StreamedStack(enc, "cuda", HostPool(), slots=2, max_resident=1)
    with stack.running():
        assert torch.equal(enc(ids), whole)
        assert stack.streamer.n_resident == 1 and len(stack.streamer.slots) == 2
    assert stack.streamer.n_resident == 1 and not stack.streamer.slots  # the resident layer stays
    stack.release()


class AddToWeight:
    """A weight patch for ``LayerStreamer.set_patch``: ``delta`` added to one matrix of some layers
    (the bridge's ``LayerPatches`` computes ComfyUI's arithmetic the same way, into ``views``)."""

    def __init__(self, layers, name, delta):
        self.layers, self.name, self.delta, self.verified = set(layers), name, delta, 0

    def apply(self, i, views):
        views[self.name].add_(self.delta)

    def verify(self):
        self.verified += 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident", [0, 5])
def test_a_weight_patch_reaches_every_streamed_layer_and_goes_again(device, resident):
    """A patch (a LoRA on a text encoder) is applied to each layer where it runs, through the slots
    or once in a resident buffer, checked at the end of each run; the model's own tensors are never
    written; without it the layers give their own values again."""
    enc, ids, whole = encoder_and_output(device, seed=3)
    own = values(enc)
    patched = copy.deepcopy(enc).to(device)
    for i in (1, 3):
        patched.layers[i].mlp[0].weight.data.add_(0.25)
    want = patched(ids)
    stack = StreamedStack(enc, device, HostPool(), slots=2, max_resident=resident)
    assert stack.layer_of("layers.3.mlp.0.weight") == (3, "mlp.0.weight")
    assert stack.layer_of("norm.weight") is None and stack.layer_of("embed.weight") is None
    patch = AddToWeight((1, 3), "mlp.0.weight", 0.25)
    stack.set_patch(patch, "set-a")
    for _ in range(2):  # streamed: applied at every upload; resident: once, and kept
        with stack.running():
            assert torch.equal(enc(ids), want)
    assert patch.verified == 2 and stack.patch_id == "set-a"
    assert same_values(enc, own)
    stack.set_patch(None, None)
    with stack.running():
        assert torch.equal(enc(ids), whole)
    stack.release()


def test_interrupted_forward_restores_the_model_and_the_next_run_is_right():
    torch.manual_seed(1)
    enc = Encoder().requires_grad_(False)
    ids = torch.randint(0, 50, (1, 5))
    whole = enc(ids)
    stack = StreamedStack(enc, "cpu", HostPool(), slots=2)

    def stop(*_):
        raise KeyboardInterrupt
    h = enc.layers[3].register_forward_pre_hook(stop)
    with pytest.raises(KeyboardInterrupt), stack.running():
        enc(ids)
    h.remove()
    assert all(p.device.type == "cpu" for p in enc.parameters())
    assert torch.equal(enc(ids), whole)  # the model itself is untouched
    with stack.running():
        assert torch.equal(enc(ids), whole)


def test_a_model_moved_outside_inference_mode_streams_and_is_left_as_it_was():
    """ComfyUI loads a model inside a prompt's inference mode, and its classic model manager moves
    it back to the CPU outside it (``/free``): its tensors then have no version counter, and no op
    can view them. The stack streams from them, looks its table up in them and gives the output of
    the model as it was, and its layers and table keep their own tensors."""
    torch.manual_seed(0)
    ref = Encoder().requires_grad_(False)
    torch.manual_seed(0)
    with torch.inference_mode():
        enc = Encoder().requires_grad_(False).to(torch.float64)  # loaded
    enc.to(torch.float32)  # moved back, outside inference mode
    ids = torch.randint(0, 50, (2, 7))
    with pytest.raises(RuntimeError, match="version counter"):
        enc.embed.weight.view(-1)
    own = {k: v for k, v in enc.named_parameters() if not k.startswith("norm.")}  # the final norm gets a master
    stack = StreamedStack(enc, "cpu", HostPool(), slots=2, max_resident=0)
    for _ in range(2):
        with torch.inference_mode(), stack.running():
            out = enc(ids)
        assert torch.equal(out, ref(ids))
    assert all(v is own[k] for k, v in enc.named_parameters() if k in own)


def test_a_model_without_a_uniform_stack_is_refused():
    enc = Encoder()
    enc.layers[2].mlp[0] = torch.nn.Linear(32, 64)  # a layer of another shape
    enc.layers[2].mlp[2] = torch.nn.Linear(64, 32)
    with pytest.raises(UnsupportedStack, match="differ"):
        StreamedStack(enc, "cpu", HostPool())
    with pytest.raises(UnsupportedStack, match="no stack"):
        StreamedStack(torch.nn.Linear(3, 3), "cpu", HostPool())


@pytest.mark.parametrize("device", DEVICES)
def test_device_copies_run_in_the_dtypes_the_loader_casts_to(device):
    """A model holding its file's fp32 tensors and run in bf16 (as ComfyUI v0.28 loads a VAE): the
    copies are bf16, the model's own tensors stay fp32, and the output is that of the model cast."""
    enc, ids, _ = encoder_and_output(device, seed=3)
    entries = module_tensors(enc)
    cast = copy.deepcopy(enc).to(device=device, dtype=torch.bfloat16)
    want = cast(ids)
    copies = DeviceCopies(entries, device, HostPool(), [torch.bfloat16] * len(entries))
    assert copies.loaded_bytes == sum(t.numel() * 2 for t in enc.state_dict().values())
    with copies.running():
        assert all(v.dtype == torch.bfloat16 for v in enc.state_dict().values())
        assert torch.equal(enc(ids), want)
    assert all(v.dtype == torch.float32 for v in enc.state_dict().values())
    copies.release()


@pytest.mark.parametrize("device", DEVICES)
def test_device_copies_equal_the_model_and_leave_it_as_it_was(device):
    enc, ids, whole = encoder_and_output(device, seed=2)
    own = values(enc)
    before = live_bytes()
    pool = HostPool()
    copies = DeviceCopies(module_tensors(enc), device, pool)
    assert copies.loaded_bytes == sum(t.nbytes for t in enc.state_dict().values())
    for _ in range(2):
        with copies.running():
            assert all(v.device == ids.device for v in enc.state_dict().values())
            assert torch.equal(enc(ids), whole)
        # between runs: the model's values, each tensor its master (the only host copy), packed in
        # one buffer per dtype
        assert same_values(enc, own) and all(v.device.type == "cpu" for v in enc.state_dict().values())
        assert all(pool.holds(v) for v in enc.state_dict().values())
        assert len(pool._buffers) == len({v.dtype for v in enc.state_dict().values()})
    own_addresses = addresses(enc)
    assert copies.device_bytes() == copies.loaded_bytes
    assert copies.unload() == copies.loaded_bytes and copies.device_bytes() == 0

    def stop(*_):
        raise KeyboardInterrupt
    h = enc.layers[1].register_forward_pre_hook(stop)
    with pytest.raises(KeyboardInterrupt), copies.running():  # loads again, then is interrupted
        enc(ids)
    h.remove()
    assert addresses(enc) == own_addresses and same_values(enc, own)
    copies.release()
    pool.release_all()
    assert live_bytes() == before


def mapped_state_dict(module, path, writable=False):
    """``module``'s tensors as its loader would hand them over from a private read-only memory
    mapping of a safetensors file (as ComfyUI's does with Dynamic VRAM): views of the mapped file,
    no copy."""
    import json
    import mmap
    import struct
    import warnings

    from safetensors.torch import save_file

    from zimage_core.safetensors_file import DTYPES
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    (n,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8:8 + n])
    header.pop("__metadata__", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the buffer is read-only by design
        data = torch.frombuffer(mapped, dtype=torch.uint8)[8 + n:]
    return {k: data[e["data_offsets"][0]:e["data_offsets"][1]].view(DTYPES[e["dtype"]]).view(e["shape"])
            for k, e in header.items()}


def test_file_mapped_tensors_are_viewed_in_a_shared_mapping(tmp_path):
    from zimage_core.host_memory import _file_views
    enc = Encoder()
    sd = mapped_state_dict(enc, tmp_path / "enc.safetensors")
    views = _file_views(list(sd.values()))
    assert views is not None
    for t, v in zip(sd.values(), views):  # the same bytes (the same pages), through another mapping
        assert torch.equal(t, v) and v.dtype == t.dtype and v.data_ptr() != t.data_ptr()
    assert _file_views([torch.empty(1 << 20)]) is None  # ordinary memory is never locked in place
    # nor a private mapping that could have been written: its pages may not be the file's
    assert _file_views(list(mapped_state_dict(enc, tmp_path / "w.safetensors", writable=True).values())) is None
    # nor a file whose name now stands for another one (a new download put in its place)
    (tmp_path / "new.safetensors").write_bytes((tmp_path / "enc.safetensors").read_bytes())
    os.replace(tmp_path / "new.safetensors", tmp_path / "enc.safetensors")
    assert _file_views(list(sd.values())) is None
    assert HostPool(pin=False).pin_in_place(list(sd.values())) is None  # nothing to lock without CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_file_mapped_weights_are_locked_in_place_and_stream_identically(tmp_path):
    enc, ids, whole = encoder_and_output("cuda", seed=3)
    enc.load_state_dict(mapped_state_dict(enc, tmp_path / "enc.safetensors"), assign=True)
    where = addresses(enc)
    before = live_bytes()
    pool = HostPool()
    stack = StreamedStack(enc, "cuda", pool, slots=2, max_resident=0)
    assert stack.streamer.pinned_sources and pool.in_place > 0
    for _ in range(2):
        with stack.running():
            assert torch.equal(enc(ids), whole)
    assert addresses(enc.layers) == {k: where[f"layers.{k}"] for k in addresses(enc.layers)}
    assert not stack.streamer.masters._staging  # uploaded from where they are
    stack.release()
    assert live_bytes() == before
    pool = HostPool()  # a whole model from its file's pages, the model's own tensors untouched
    copies = DeviceCopies(module_tensors(enc), "cuda", pool)
    with copies.running():
        assert torch.equal(enc(ids), whole)
    assert addresses(enc) == where and pool.in_place == pool.used > 0  # no copies
    copies.release()
    pool.release_all()
    assert live_bytes() == before

"""What a user can produce, against the session's real ComfyUI server: a model file truncated in
place while it is loaded, a checkpoint with NaN in it, a size far beyond the machine's RAM through a
stock KSampler, and an interrupt in the middle of one long step. Each gives a clear error (or stops
in time), the server lives, and the next good prompt makes its image. (A loaded model reading a
file changed under it is tests/test_checkpoint.py's: here the loader sees the change first.)
"""
import os
import time

import pytest

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import UNET, put_nan, sparse_twin
from test_comfy_server import failing_run, messages, node_of, pack_workflow

pytestmark = needs_comfyui

LIVE = "z_image_live.safetensors"      # a twin (zero weights) the tests truncate and restore
NAN = "z_image_nan.safetensors"        # a twin with one NaN in a main layer's FFN
NAN_KEY = "layers.0.feed_forward.w2.weight"


@pytest.fixture(scope="module")
def server(comfy_server, comfy_base_dir):
    """The session's server, with a twin of the model to truncate and one with a NaN."""
    folder = os.path.join(comfy_base_dir, "models", "diffusion_models")
    for name in (LIVE, NAN):
        sparse_twin(os.path.join(folder, UNET), os.path.join(folder, name))
    put_nan(os.path.join(folder, NAN), NAN_KEY)
    yield comfy_server, folder
    for name in (LIVE, NAN):
        os.remove(os.path.join(folder, name))


def _error(client, wf):
    err = failing_run(client, wf)
    print(f"\nComfyUI {comfyui_version()}: {err['node_type']}: {err['exception_message']}")
    return err


def _works(client, **kw):
    entry = client.run(pack_workflow(**kw))
    assert entry["status"]["completed"]


def test_model_file_truncated_in_place_while_loaded(server):
    client, folder = server
    live = os.path.join(folder, LIVE)
    _works(client, unet=LIVE, prefix="live")
    size = os.path.getsize(live)
    os.truncate(live, size // 2)  # what an interrupted re-download leaves behind
    status, raw, _ = client.request("POST", "/free", {"unload_models": True})
    assert status == 200, raw
    err = _error(client, pack_workflow(unet=LIVE, prefix="live_cut", seed=43))
    msg = err["exception_message"]
    assert LIVE in msg and ("changed on disk" in msg or "truncated" in msg), msg
    assert "again" in msg, msg  # what to do
    _works(client, prefix="after_cut")  # another model, same server
    sparse_twin(os.path.join(folder, UNET), live)  # the download finished
    _works(client, unet=LIVE, prefix="live_restored", seed=44)


def test_checkpoint_with_nan_is_named(server):
    client, _ = server
    err = _error(client, pack_workflow(unet=NAN, prefix="nan"))
    msg = err["exception_message"]
    assert NAN in msg and NAN_KEY in msg and "NaN" in msg and "download it again" in msg, msg
    _works(client, prefix="after_nan")


def test_a_size_beyond_the_ram_is_refused_with_one_that_fits(server):
    """8192x8192 through stock nodes (the pack's sampler node caps its sizes) with the pack's MODEL
    and prompt: the pack's workflow with its sampler swapped for ComfyUI's KSampler on an empty
    8192x8192 latent (the loaders and the encode are the pack workflow's, often cached)."""
    client, _ = server
    wf = pack_workflow(prefix="huge")
    sampler, encode = node_of(wf, "ZImageSampler"), node_of(wf, "ZImageTextEncode")
    model = wf[sampler]["inputs"]["model"]
    wf[sampler] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": 42, "steps": 1, "cfg": 1.0, "sampler_name": "res_multistep", "scheduler": "simple",
        "positive": [encode, 0], "negative": ["zero", 0], "latent_image": ["huge", 0], "denoise": 1.0}}
    wf["zero"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": [encode, 0]}}
    wf["huge"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 8192, "height": 8192, "batch_size": 1}}
    err = _error(client, wf)
    msg = err["exception_message"]
    assert "8192x8192 does not fit" in msg and "RAM" in msg and "Try " in msg, msg
    _works(client, prefix="after_huge")


def test_interrupt_inside_one_large_step(server):
    """On the CPU one 2048x2048 step of this model takes minutes; an interrupt stops it in pieces."""
    client, _ = server
    start = len(client.log_text())
    pid, _ = client.post(pack_workflow(width=2048, height=2048, steps=1, prefix="large"))
    end = time.monotonic() + 300
    while "(2048x2048)" not in client.log_text()[start:]:  # the step has been planned and is running
        assert time.monotonic() < end, client.log_tail()
        assert not client.history(pid), client.history(pid)
        time.sleep(0.2)
    time.sleep(3)
    t0 = time.monotonic()
    client.interrupt()
    entry = client.wait(pid, 120, poll=0.1)
    took = time.monotonic() - t0
    print(f"\nComfyUI {comfyui_version()}: interrupt inside a 2048x2048 step returned after {took:.2f} s")
    assert "execution_interrupted" in messages(entry), entry["status"]
    assert took < 2.0
    _works(client, prefix="after_large")

"""Errors that name what caused them, through the session's real ComfyUI server: a LoRA with a NaN
is named by its file (the model file is not blamed), a text encoder that gives NaN is named at the
encode (before any sampling), a LoRA's console line counts the weights it really changed, and a
malformed ZIMAGE_* setting is said at start-up and refused at each prompt's first Z-Image node. And
a prompt longer than Z-Image was trained on is said (the core tests check that it is planned for).
"""
import os

import pytest
import torch
from safetensors.torch import save_file

from comfy_env import comfyui_version, needs_comfyui
from comfy_server import TE, UNET, make_base_dir, put_nan, sparse_twin, start_server, stop_server
from test_comfy_server import failing_run, lora_workflow, node_of, pack_run, pack_workflow  # noqa: F401 (pack_run: a fixture)

pytestmark = needs_comfyui

DIM, FFN = 3840, 10240  # the test transformer's width and its MLP's (comfy_server.transformer_weights)
TE_NAN = "qwen_nan.safetensors"


def _lora_keys(name, out_dim, in_dim, rank=4, nan=False, scale=0.05):
    """ComfyUI's LoRA layout for transformer key ``name`` (``layers.0.attention.out``)."""
    g = torch.Generator().manual_seed(len(name) + out_dim)
    up, down = torch.randn(out_dim, rank, generator=g) * scale, torch.randn(rank, in_dim, generator=g) * scale
    if nan:
        up[0, 0] = float("nan")
    prefix = "lora_unet_" + name.replace(".", "_")
    return {f"{prefix}.lora_up.weight": up, f"{prefix}.lora_down.weight": down, f"{prefix}.alpha": torch.tensor(4.0)}


LORAS = {
    "lora_nan.safetensors": _lora_keys("layers.0.attention.out", DIM, DIM, nan=True),
    # finite values whose product overflows float32 (3.4e38)
    "lora_huge.safetensors": _lora_keys("layers.0.attention.out", DIM, DIM, scale=1e20),
    # one key that fits, one whose matrices do not (ComfyUI refuses it at the patch)
    "lora_one_bad.safetensors": {**_lora_keys("layers.0.attention.out", DIM, DIM),
                                 **_lora_keys("layers.0.feed_forward.w1", 100, DIM)},
    "lora_other_model.safetensors": _lora_keys("input_blocks.0.0", 320, 4),  # an SD1.5 UNet's key
    "lora_all_bad.safetensors": {**_lora_keys("layers.0.feed_forward.w1", 100, DIM),
                                 **_lora_keys("layers.0.feed_forward.w2", 100, FFN),
                                 **_lora_keys("layers.0.feed_forward.w3", 100, DIM)},
}


@pytest.fixture(scope="module")
def server(comfy_server, comfy_base_dir):
    """The session's server with the LoRAs above and a text encoder with one NaN in a norm."""
    loras = os.path.join(comfy_base_dir, "models", "loras")
    os.makedirs(loras, exist_ok=True)
    for name, sd in LORAS.items():
        save_file(sd, os.path.join(loras, name))
    te = os.path.join(comfy_base_dir, "models", "text_encoders")
    sparse_twin(os.path.join(te, TE), os.path.join(te, TE_NAN))
    put_nan(os.path.join(te, TE_NAN), "model.layers.0.input_layernorm.weight")
    yield comfy_server
    os.remove(os.path.join(te, TE_NAN))
    for name in LORAS:
        os.remove(os.path.join(loras, name))


def _console(client, wf, fails=False):
    """Run ``wf``; what the server printed meanwhile (and the error where it ``fails``)."""
    before = len(client.log_text())
    result = failing_run(client, wf) if fails else client.run(wf)
    return client.log_text()[before:], result


def test_a_lora_with_nan_is_named_and_the_model_file_is_not_blamed(server, pack_run):
    log, err = _console(server, lora_workflow("lora_nan.safetensors", prefix="lora_nan"), fails=True)
    msg = err["exception_message"]
    print(f"\nComfyUI {comfyui_version()}: {err['exception_type']}: {msg}")
    assert err["exception_type"] == "zimage.PatchError", err
    assert msg.startswith("The LoRA lora_nan.safetensors (LoraLoaderModelOnly, node 100) has NaN"), msg
    assert "for layers.0.attention.out.weight and" in msg
    assert "The model file is fine" in msg and UNET not in msg
    # the weights the failed patch set wrote are restored: the next image without the LoRA is the same image
    entry = server.run(pack_workflow(prefix="after_lora_nan"))
    img = server.image(entry, node_of(pack_workflow(), "SaveImage"))
    assert img.tobytes() == pack_run[1].tobytes()


def test_a_lora_that_overflows_a_weight_is_named_with_its_strength(server):
    log, err = _console(server, lora_workflow("lora_huge.safetensors", strength=2.0, prefix="lora_huge"), fails=True)
    msg = err["exception_message"]
    print(f"\nComfyUI {comfyui_version()}: {err['exception_type']}: {msg}")
    assert err["exception_type"] == "zimage.PatchError", err
    assert msg.startswith("The LoRA lora_huge.safetensors (LoraLoaderModelOnly, node 100) at strength 2 makes "
                          "layers.0.attention.out.weight overflow"), msg
    assert "Lower the LoRA's strength" in msg and UNET not in msg


@pytest.mark.parametrize("lora, line", [
    ("lora_one_bad.safetensors", "Z-Image: 1 weight patched; 1 left unchanged"),
    ("lora_all_bad.safetensors", "Z-Image: 0 weights patched; 3 left unchanged"),
])
def test_the_console_counts_the_weights_a_lora_changed(server, lora, line):
    log, _ = _console(server, lora_workflow(lora, prefix=lora[:-12]))
    print(f"\nComfyUI {comfyui_version()}, {lora}: "
          + " | ".join(s.strip() for s in log.splitlines() if "Z-Image:" in s and "patched" in s))
    assert line in log, log[-4000:]
    assert "string_to_seed has moved" not in log


def test_a_lora_for_another_model_is_said_once(server):
    log, _ = _console(server, lora_workflow("lora_other_model.safetensors", prefix="lora_other"))
    said = [s for s in log.splitlines() if "changes none of this model's weights" in s]
    print(f"\nComfyUI {comfyui_version()}: " + " | ".join(s.strip() for s in said))
    assert len(said) == 1 and "lora_other_model.safetensors (LoraLoaderModelOnly, node 100)" in said[0], log[-4000:]


def test_a_prompt_longer_than_trained_on_is_said(server):
    # just past 512 tokens: the CPU's text encoder takes most of a minute for it (all 36 layers run)
    wf = pack_workflow(prompt="a red house by a green river under a blue sky, " * 46, steps=1, prefix="long")
    log, _ = _console(server, wf)
    said = [s for s in log.splitlines() if "Z-Image: this prompt is" in s]
    print(f"\nComfyUI {comfyui_version()}: " + " | ".join(s.strip() for s in log.splitlines() if "Z-Image:" in s))
    assert len(said) == 1 and "trained on prompts of up to 512" in said[0], log[-4000:]
    tokens = int(said[0].split("this prompt is ")[1].split()[0])
    assert 512 < tokens <= 1024 and "plans for 1024 prompt tokens" in said[0], said


def test_a_text_encoder_with_nan_is_named_at_the_encode(server):
    wf = pack_workflow(prefix="te_nan")
    wf[node_of(wf, "CLIPLoader")]["inputs"]["clip_name"] = TE_NAN
    log, err = _console(server, wf, fails=True)
    msg = err["exception_message"]
    print(f"\nComfyUI {comfyui_version()}: {err['node_type']}: {err['exception_type']}: {msg}")
    assert err["node_type"] == "ZImageTextEncode" and err["exception_type"] == "zimage.TextEncoderError", err
    assert f"text encoder from {TE_NAN} (CLIPLoader, node {node_of(wf, 'CLIPLoader')})" in msg
    assert "fp16" not in msg and "lower cfg" not in msg
    assert "0/2" not in log  # stopped before the sampler's first step


def test_a_bad_setting_is_said_at_start_up_and_refused_at_every_prompt(tmp_path):
    client = start_server(make_base_dir(str(tmp_path)), log_name="comfyui-bad-settings.log",
                          env={"ZIMAGE_PINNED_GIB": "lots", "ZIMAGE_COMPRESSION": "fast"})
    try:
        start = client.log_text()
        for words in ("ZIMAGE_PINNED_GIB is 'lots'", "ZIMAGE_COMPRESSION is 'fast'"):
            assert start.count(words) == 1 and "nodes are loaded" in start, start[-4000:]
        assert "ZImageModelLoader" in client.get("/object_info")
        for i in range(2):  # every prompt, not only the first
            err = failing_run(client, pack_workflow(prefix=f"bad_settings_{i}"))
            # ComfyUI runs the encode or the loader first: whichever it is refuses
            assert err["node_type"] in ("ZImageModelLoader", "ZImageTextEncode"), err
            assert err["exception_type"] == "zimage.SettingError", err
            assert "ZIMAGE_PINNED_GIB is 'lots'" in err["exception_message"]
            assert "ZIMAGE_COMPRESSION is 'fast'" in err["exception_message"]
    finally:
        stop_server(client)

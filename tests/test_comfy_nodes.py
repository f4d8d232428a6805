"""The pack's nodes as a server shows and runs them: tooltips and names, and numbers or latents that are
NaN or infinite refused with one line by the node they reach (ComfyUI's validation lets NaN through:
it only compares with min and max), after which the server serves the next good prompt.

Python's json.dumps writes NaN and Infinity, and ComfyUI's aiohttp server reads them, so an API
client can send them. The server tests need COMFYUI_PATH (they skip otherwise); the checks' own
tests run everywhere."""
import importlib.util
import os

import pytest
import torch

from comfy_env import comfyui_version, needs_comfyui
from test_comfy_server import PACK_NODES, failing_run, messages, node_of, object_info, pack_workflow  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = float("nan"), float("inf")


def load_checks():
    """nodes/checks.py alone: the nodes package imports ComfyUI."""
    spec = importlib.util.spec_from_file_location("zimage_node_checks", os.path.join(ROOT, "nodes", "checks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the checks, without ComfyUI ------------------------------------------------------------------

@pytest.mark.parametrize("value", [NAN, INF, -INF, -0.5, 100.5, "3"])
def test_number_refuses(value):
    with pytest.raises(ValueError) as e:
        load_checks().number("cfg", value, 0.0, 100.0, "Z-Image-Turbo uses 1")
    msg = str(e.value)
    assert msg.startswith(f"cfg is {value}: give a number from 0.0 to 100.0") and "\n" not in msg, msg


@pytest.mark.parametrize("value", [0.0, 1, 3.5, 100.0])
def test_number_accepts(value):
    assert load_checks().number("cfg", value, 0.0, 100.0, "Z-Image-Turbo uses 1") == value


def test_finite_latent():
    checks = load_checks()
    latent = torch.zeros(1, 16, 4, 4)
    checks.finite_latent(latent, "unused")
    latent[0, 3, 1, 1], latent[0, 4, 2, 2] = NAN, -INF
    with pytest.raises(RuntimeError) as e:
        checks.finite_latent(latent, "The image came out non-finite")
    msg = str(e.value)
    assert "2 of 256" in msg and "bf16" in msg and "lower cfg" in msg and "\n" not in msg, msg


# -- against a real server --------------------------------------------------------------------------

@needs_comfyui
def test_every_input_has_a_tooltip(object_info):
    for name in PACK_NODES:
        info = object_info[name]
        for section in ("required", "optional"):
            for input_name, spec in info["input"].get(section, {}).items():
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                assert opts.get("tooltip"), f"{name}.{input_name} has no tooltip"


@needs_comfyui
def test_names_and_descriptions(object_info):
    """The four nodes sort together in the node library under one name, and say one number per fact."""
    names = {object_info[n]["display_name"] for n in PACK_NODES}
    assert names == {"Z-Image Model Loader (streaming)", "Z-Image Text Encode (streaming)",
                     "Z-Image Sampler (streaming)", "Z-Image Decode (streaming)"}, names
    assert "0.56 GiB" in object_info["ZImageTextEncode"]["description"]
    loader = object_info["ZImageModelLoader"]["description"].lower()
    assert "spread through the stack" in loader and "leading" not in loader and "trailing" not in loader
    if tuple(int(p) for p in comfyui_version().split(".")[:2]) >= (0, 20):  # v0.8 has no search aliases
        for n in PACK_NODES:
            assert "zimage" in object_info[n].get("search_aliases", []), object_info[n]


@needs_comfyui
def test_loader_says_when_a_number_is_unused(comfy_server):
    """resident_layers applies only with vram max_resident_layers: set with auto, the loader says so."""
    wf = pack_workflow(prefix="unused_number", seed=6)
    wf[node_of(wf, "ZImageModelLoader")]["inputs"].update(vram="auto", resident_layers=12)
    log_start = len(comfy_server.log_text())
    comfy_server.run(wf)
    assert ("resident_layers 12 is not used with vram auto (only with vram max_resident_layers)"
            in comfy_server.log_text()[log_start:]), comfy_server.log_tail()



def assert_one_line(err, node_type, *words):
    msg = err["exception_message"].strip()
    print(f"\nComfyUI {comfyui_version()}: {err['node_type']}: {err['exception_type']}: {msg}")
    assert err["node_type"] == node_type, err
    assert "\n" not in msg and "Traceback" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@needs_comfyui
@pytest.mark.parametrize("node_type, name, value, words", [
    ("ZImageSampler", "cfg", NAN, ["cfg is nan", "from 0.0 to 100.0", "uses 1"]),
    ("ZImageSampler", "shift", NAN, ["shift is nan", "from 0.0 to 100.0", "uses 3"]),
    ("ZImageModelLoader", "leave_free_gb", NAN, ["leave_free_gb is nan", "from 0.0 to 1024.0"]),
])
def test_nan_input_refused_by_the_node(comfy_server, node_type, name, value, words):
    wf = pack_workflow(prefix="nan_input")
    wf[node_of(wf, node_type)]["inputs"][name] = value
    if name == "leave_free_gb":
        wf[node_of(wf, node_type)]["inputs"]["vram"] = "leave_free_gb"
    assert_one_line(failing_run(comfy_server, wf), node_type, *words)


@needs_comfyui
@pytest.mark.parametrize("devices, words", [
    ("cuda:7", ["leaves out", "where ComfyUI runs the sampler", "write auto"]),
    ("banana", ["'banana' is not a device", "cuda:0, cuda:1"]),
])
def test_devices_the_loader_cannot_span_are_refused_in_one_line(comfy_server, object_info, devices, words):
    """The loader's optional devices input: a list that leaves out ComfyUI's own device, or names
    no device, says so."""
    assert object_info["ZImageModelLoader"]["input"]["optional"]["devices"][1]["default"] == "auto"
    wf = pack_workflow(prefix="devices", loader={"devices": devices})
    assert_one_line(failing_run(comfy_server, wf), "ZImageModelLoader", *words)


@needs_comfyui
def test_an_api_prompt_without_devices_runs(comfy_server):
    """API prompts written before the loader had a devices input still run (on ComfyUI's card)."""
    wf = pack_workflow(prefix="no_devices", seed=5)
    del wf[node_of(wf, "ZImageModelLoader")]["inputs"]["devices"]
    entry = comfy_server.run(wf)
    assert "execution_error" not in messages(entry), messages(entry)


@needs_comfyui
@pytest.mark.parametrize("value", [INF, -INF])
def test_infinite_leave_free_gb_refused(comfy_server, value):
    """Infinity is out of range for ComfyUI's own validation: the prompt is refused before it runs."""
    wf = pack_workflow(prefix="inf_input")
    loader = node_of(wf, "ZImageModelLoader")
    wf[loader]["inputs"].update(vram="leave_free_gb", leave_free_gb=value)
    _, resp = comfy_server.post(wf, check=False)
    assert resp["_http_status"] == 400, resp
    errors = resp["node_errors"][loader]["errors"]
    assert any(e["details"] == "leave_free_gb" for e in errors), errors


@needs_comfyui
def test_non_finite_sample_refused_by_the_sampler(comfy_server):
    """A prompt's conditioning made NaN upstream (a stock node with a NaN strength) makes a NaN latent:
    the sampler says so, instead of passing on a black image."""
    wf = pack_workflow(prefix="nan_latent")
    encode, sampler = node_of(wf, "ZImageTextEncode"), node_of(wf, "ZImageSampler")
    wf["90"] = {"class_type": "ConditioningAverage", "inputs": {
        "conditioning_to": [encode, 0], "conditioning_from": [encode, 0], "conditioning_to_strength": NAN}}
    wf[sampler]["inputs"]["positive"] = ["90", 0]
    assert_one_line(failing_run(comfy_server, wf), "ZImageSampler", "non-finite", "bf16", "lower cfg")


@needs_comfyui
def test_non_finite_latent_refused_by_the_decode(comfy_server):
    wf = pack_workflow(prefix="nan_decode")
    decode = node_of(wf, "ZImageDecode")
    wf["90"] = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    wf["91"] = {"class_type": "LatentMultiply", "inputs": {"samples": ["90", 0], "multiplier": NAN}}
    wf[decode]["inputs"]["samples"] = ["91", 0]
    assert_one_line(failing_run(comfy_server, wf), "ZImageDecode", "NaN or infinity", "bf16")


@needs_comfyui
def test_good_prompt_after_refusals(comfy_server):
    """Runs after the refusals above (file order): the server and the pack still make an image."""
    wf = pack_workflow(prefix="after_nan", seed=5)
    entry = comfy_server.run(wf)
    img = comfy_server.image(entry, node_of(wf, "SaveImage"))
    assert img.size == (128, 128)

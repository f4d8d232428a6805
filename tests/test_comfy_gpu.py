"""The pack's workflow and the official template through a real ComfyUI server on the GPU, with
ComfyUI's Dynamic VRAM on and off where the version has it (v0.20.1, v0.28.0; v0.8.0 has only the
classic loader). Skipped without CUDA.

Dynamic VRAM changes how ComfyUI holds the other models' weights (the file's own tensors, cast as
they load), which is where the pack's text encoder and VAE meet ComfyUI: a VAE decode that failed
only on a GPU with Dynamic VRAM went unseen by the CPU suites. The images are compared with the
official template's, and the difference is printed; on the GPU the two use different attention
kernels in bf16, so the bound here is loose (the CPU suite asserts identical images).

The text encoder here is Qwen3-4B whole (36 layers, 8 GB, written once per ComfyUI version): with
Dynamic VRAM, v0.33.0's own encode of the CPU suite's two-layer file fails ("mat1 and mat2 shapes
cannot be multiplied" in a q_proj: its weight prefetch meets the weights the file lacks), which
would test the file, not the pack.
"""
import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from comfy_env import COMFYUI_PATH, comfyui_version, needs_comfyui, run_check
from comfy_identity import differences, run_session, session, table, write_loras
from comfy_server import ROOT, TE_LAYERS_FULL, make_base_dir, server_flags, start_server, stop_server
from tools.server_processes import child_setup
from test_comfy_server import image_stats, node_of, official_template, pack_workflow

pytestmark = [needs_comfyui, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# mean absolute pixel difference (0-255) allowed between the pack's image and the official one
GPU_PARITY_MEAN = 8.0


def _has_dynamic_vram() -> bool:
    with open(os.path.join(COMFYUI_PATH or "", "comfy", "cli_args.py")) as f:
        return "--disable-dynamic-vram" in f.read()


@pytest.fixture(scope="module")
def gpu_base_dir(tmp_path_factory):
    return make_base_dir(str(tmp_path_factory.mktemp("comfy_gpu_base")), te_layers=TE_LAYERS_FULL)


@pytest.fixture(scope="module")
def full_size_base_dir(tmp_path_factory):
    """The whole random model: 30 main layers (12 GB) and the 36-layer text encoder."""
    base = make_base_dir(str(tmp_path_factory.mktemp("comfy_gpu_full")), te_layers=TE_LAYERS_FULL,
                         full_transformer=True)
    write_loras(base, layers=30)
    return base


@contextlib.contextmanager
def simulated_card(gib, folder, gpu=0):
    """Another process holds GPU ``gpu``'s memory but ``gib`` GiB ("full": nothing held)."""
    if gib == "full":
        yield
        return
    flag = os.path.join(folder, f"ballast-{gpu}-{gib}.ready")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "ballast.py"), "--leave-gib", gib,
                             "--flag", flag], env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu)),
                            preexec_fn=child_setup)
    try:
        end = time.monotonic() + 120
        while not os.path.exists(flag):
            assert proc.poll() is None and time.monotonic() < end, "the ballast did not hold the memory"
            time.sleep(0.2)
        yield
    finally:
        proc.kill()
        proc.wait()


CARDS = ("full", "11.5", "7.5", "5.5")


def test_the_same_images_on_every_card(full_size_base_dir):
    """One session of images (comfy_identity.py) at 1024x1024, 8 steps, on the whole GPU and three
    simulated cards, one server each: every image the same to the bit on every card, and the first
    prompt's image the same when it comes again at the end of its server's session."""
    by_card = {}
    for card in CARDS:
        start = time.monotonic()
        with simulated_card(card, full_size_base_dir):
            client = start_server(full_size_base_dir, server_flags(), cpu=False, log_name=f"comfyui-card-{card}.log")
            try:
                by_card[card] = run_session(client, session(1024, (1344, 768), 8, {}, f"card{card}"))
            finally:
                stop_server(client)
        print(f"card {card}: {len(by_card[card])} images in {time.monotonic() - start:.0f} s: {by_card[card]}", flush=True)
    print(f"\nComfyUI {comfyui_version()} on the GPU, pixel hashes by card (GiB free):\n{table(by_card)}")
    assert not differences(by_card), differences(by_card)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_small_cards_make_the_one_card_images(full_size_base_dir):
    """The loader's devices (auto) spans two 5.5 GiB cards, neither of which holds the model: every
    image of the session is the whole first card's image, bit for bit."""
    by_card = {}
    for cards in (("full",), ("5.5", "5.5")):
        with contextlib.ExitStack() as held:
            for gpu, gib in enumerate(cards):
                held.enter_context(simulated_card(gib, full_size_base_dir, gpu))
            name = "+".join(cards)
            client = start_server(full_size_base_dir, server_flags(), cpu=False, log_name=f"comfyui-cards-{name}.log")
            try:
                by_card[name] = run_session(client, session(1024, (1344, 768), 8, {}, f"cards{name}"))
                if len(cards) > 1:
                    assert "on the GPUs: cuda:0 layers" in client.log_text()  # the layers spanned both cards
            finally:
                stop_server(client)
    print(f"\nComfyUI {comfyui_version()}, one card and two, pixel hashes:\n{table(by_card)}")
    assert not differences(by_card), differences(by_card)


@pytest.mark.parametrize("dynamic", ["on", "off"])
def test_the_pack_on_the_gpu_matches_the_official_template(gpu_base_dir, dynamic):
    if dynamic == "on" and not _has_dynamic_vram():
        pytest.skip(f"ComfyUI {comfyui_version()} has no Dynamic VRAM")
    flags = server_flags() + (["--disable-dynamic-vram"] if dynamic == "off" and _has_dynamic_vram() else [])
    client = start_server(gpu_base_dir, flags + ["--verbose", "DEBUG"], cpu=False,
                          log_name=f"comfyui-gpu-dynamic-{dynamic}.log")
    try:
        # the pack, the official template, the pack again (a new prompt: ComfyUI's cache would serve the
        # first one's image): the third image's models come back after every model was unloaded, and
        # its decode comes after ComfyUI's own VAEDecode has loaded the same VAE (with Dynamic VRAM,
        # marking its modules as ComfyUI's): it still runs from the pack's copies
        wf = pack_workflow(prefix=f"gpu_pack_{dynamic}")
        ours, stats = image_stats(client.image(client.run(wf), node_of(wf, "SaveImage")))
        ref, _ = image_stats(client.image(client.run(official_template(prefix=f"gpu_official_{dynamic}")), "10"))
        diff = abs(ours - ref)
        print(f"\nComfyUI {comfyui_version()} on the GPU, Dynamic VRAM {dynamic}: pack vs official largest pixel "
              f"difference {int(diff.max())}, mean {diff.mean():.3f}; pack {stats}")
        assert ref.std() > 1.0 and ours.std() > 1.0, "a flat image: the comparison would prove nothing"
        assert diff.mean() <= GPU_PARITY_MEAN
        # ComfyUI lets its VAE go (as its model manager does on a small card to load the transformer)
        after_official = len(client.log_text())
        status, raw, _ = client.request("POST", "/free", {"unload_models": True})
        assert status == 200, raw[:300]
        end = time.monotonic() + 60
        while "Unloading AutoencodingEngine" not in client.log_text()[after_official:]:
            assert time.monotonic() < end, "ComfyUI did not unload its VAE"
            time.sleep(0.2)
        wf = pack_workflow(prompt="a lighthouse on a cliff at dusk", prefix=f"gpu_pack_{dynamic}_again")
        again, stats = image_stats(client.image(client.run(wf), node_of(wf, "SaveImage")))
        print(f"the pack after the official template: {stats}")
        assert again.std() > 1.0 and not (again == ours).all()
        assert "decoding through the pack's device copies" in client.log_text()[after_official:]
        # from the first prompt on: a trimmed ComfyUI may fail to import some of its own optional nodes
        log = client.log_text().split("got prompt", 1)[-1]
        assert "Traceback" not in log, log[-6000:]
        assert "layers on the GPU" in log  # the pack streamed on the GPU, not on the CPU
    finally:
        stop_server(client)


def test_the_fused_lora_patch_gives_comfyuis_bits(tmp_path):
    """A plain LoRA's patch on the GPU (one kernel, its product included: ``bridge.patches.LowRank``)
    equals ComfyUI's own ``calculate_weight`` and rounding to the bit, into a copy and in place, in
    bf16 and fp16, with alpha a float32 or bf16 tensor or absent, one LoRA or two stacked, on each of
    Z-Image's matrix shapes (the product made in tiles; stacked LoRAs a band of rows at a time); and
    checked as it is written (a patch's first result: not finite, changed), an overflow to infinity
    among them."""
    res = run_check(tmp_path, "comfy_lora_kernel_check.py", timeout=600)
    print(f"\nComfyUI {comfyui_version()}: LoRA dtype {res.pop('lora_dtype')}")
    for case, r in res.items():
        print(f"  {case}: {r}")
    assert all(r["ran"] and r["same"] and r["changed"] and r["checks"] for r in res.values()), res

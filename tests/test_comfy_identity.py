"""The same prompt and seed give the same image at every split of the transformer and at every
point of a session, through the session's real ComfyUI server on the CPU: one session of images
(comfy_identity.py, two prompts: the CPU's text encode takes seconds) with every layer resident,
two and none (the loader's max_resident_layers), compared to the bit. The GPU counterpart runs it
on simulated cards (test_comfy_gpu.py)."""
from comfy_env import comfyui_version, needs_comfyui
from comfy_identity import differences, run_session, session, table, write_loras

pytestmark = needs_comfyui

SPLITS = {"all resident": {}, "2 resident": {"vram": "max_resident_layers", "resident_layers": 2},
          "none resident": {"vram": "max_resident_layers", "resident_layers": 0}}


def test_the_same_images_at_every_split(comfy_server, comfy_base_dir):
    write_loras(comfy_base_dir, layers=1)
    by_split = {name: run_session(comfy_server, session(128, (192, 128), 2, loader, f"split{i}", prompts=2))
                for i, (name, loader) in enumerate(SPLITS.items())}
    print(f"\nComfyUI {comfyui_version()} on the CPU, pixel hashes by split:\n{table(by_split)}")
    log = comfy_server.log_text()
    for kept in (0, 2):  # the splits were the ones asked for
        assert f"on the CPU, {kept} of 5 layers kept, {5 - kept} streamed from host memory" in log
    assert not differences(by_split), differences(by_split)

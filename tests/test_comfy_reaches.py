"""Where the pack relies on ComfyUI's internals (bridge/reaches.py): each reach still
holds on the ComfyUI tree under test, and a changed one fails naming itself."""
import pytest

from comfy_env import comfyui_version, needs_comfyui, run_check
from bridge import reaches as cr


@needs_comfyui
def test_every_reach_into_comfyui_still_holds(tmp_path):
    res = run_check(tmp_path, "comfy_reaches_check.py", timeout=300)
    assert res["reaches"] >= 15
    assert not res["problems"], f"ComfyUI {comfyui_version()} changed:\n" + "\n".join(res["problems"])


class Patcher:
    def load(self, device_to=None, lowvram_model_memory=0):
        pass


@pytest.mark.parametrize("probe, words", [
    (lambda: cr._methods(Patcher, load=("device_to", "full_load")), ["Patcher.load", "full_load"]),
    (lambda: cr._methods(Patcher, partially_unload=()), ["Patcher.partially_unload is gone"]),
    (lambda: cr._attributes(Patcher, "model_size"), ["has no model_size"]),
    (lambda: cr._source_mentions(Patcher, "self.patches_uuid"), ["no longer mentions self.patches_uuid"]),
])
def test_a_changed_reach_is_named(probe, words):
    """The probes the list is made of report what changed (here against a class made to differ)."""
    msg = probe()
    assert msg and all(w in msg for w in words), msg
    assert cr._methods(Patcher, load=("device_to",)) is None and cr._attributes(Patcher, "load") is None


@needs_comfyui
@pytest.mark.parametrize("flags", [["--use-pytorch-cross-attention"], []])
def test_torchs_attention_only_for_comfyuis_default_on_the_cards_that_prefer_cudnn(tmp_path, flags):
    """With ComfyUI's default (PyTorch's SDPA, which the flag forces on the CPU), the cards of compute
    capability 9.0 and 10.0 run torch's own choice; every other card, and every other attention
    ComfyUI runs (its sub-quadratic one on the CPU here), ComfyUI's."""
    res = run_check(tmp_path, "comfy_attention_check.py", *flags, timeout=300)
    torchs = {"9.0", "10.0"} if flags else set()
    assert res == {k: "torch" if k in torchs else "comfy" for k in res} and len(res) == 7, res

"""The bridge to ComfyUI: the only part of the pack that imports ``comfy`` (the rest of the core
imports only torch, so it runs and is tested without ComfyUI). The nodes call what is here and
nothing else of the core.

    model.py         the pack's MODEL: ZImageModel (Lumina2 over the streamed transformer), ZImagePatcher
    patches.py       weight patches (LoRA) computed as ComfyUI does, on the device as each layer arrives; checked, counted
    prompt.py        the node ComfyUI is running and the model files upstream of it, for errors that name them
    pinned.py        another model's patcher while the pack runs it (asks for little, unloads for free)
    text_encoder.py  the prompt's encode, the text encoder's layers streamed
    vae.py           the decode, in one piece per image, tiled only as a last resort
    sampler.py       text to image with ComfyUI's samplers on Z-Image's shifted schedule
    memory.py        the RAM ComfyUI keeps free, the host budget's first claim, the retry on an emptied GPU
    reaches.py       every reach into ComfyUI beyond its public API, with the versions it was checked on
"""
import importlib

# what the nodes call -> the module that holds it. Imported on first use (PEP 562), so that
# ``bridge.reaches`` imports without ComfyUI: the CPU tests check its probes.
_API = {"STORAGE_DTYPES": "..transformer", "Settings": "..transformer", 
        "ZImagePatcher": ".model", "load_model": ".model", "describe": ".model", "PinnedPatcher": ".pinned", "SAMPLERS": ".sampler",
        "SCHEDULERS": ".sampler", "sample": ".sampler", "encode": ".text_encoder",
        "streamed_text_encoder": ".text_encoder", "decode": ".vae", "pinned_vae": ".vae"}
__all__ = list(_API)


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name], __name__), name)

"""The bridge to ComfyUI: the only part of the pack beside the nodes that imports ComfyUI, and the
only part the nodes call (the core, ``zimage_core``, imports only torch, so it runs and is tested
without ComfyUI). Each module is imported by name where it is used; this package imports nothing,
so ``bridge.reaches`` imports without ComfyUI (the CPU tests check its probes).

    model.py         the pack's MODEL: ZImageModel (Lumina2 over the streamed transformer), ZImagePatcher, the loader
    patches.py       weight patches (LoRA) computed as ComfyUI does, on the device as each layer arrives; checked, counted
    prompt.py        the node ComfyUI is running and the model files upstream of it, for errors that name them
    ui.py            what the user meets: the model files ComfyUI lists, a node's status line
    pinned.py        another model's patcher while the pack runs it (asks for little, unloads for free)
    text_encoder.py  the prompt's encode, the text encoder's layers streamed
    vae.py           the decode, in one piece per image, tiled only as a last resort
    sampler.py       text to image with ComfyUI's samplers on Z-Image's shifted schedule
    memory.py        the RAM ComfyUI keeps free, the host budget's first claim, the retry on an emptied GPU
    reaches.py       every reach into ComfyUI beyond its public API, with the versions it was checked on
"""

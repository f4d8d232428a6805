import contextlib
import logging

import comfy.model_management as mm
import torch
from comfy_api.latest import io

from ..zimage_core import comfy as zcomfy
from .checks import finite_latent
from .status import aliases, node_id, show

log = logging.getLogger("zimage")
# Measured peak of the Flux AE decoder: about 2.2 KB per output pixel in bf16, 4.4 KB in fp32
# (ComfyUI's estimate is about twice that, which would evict transformer layers for nothing).
BYTES_PER_PIXEL_PER_DTYPE_BYTE = 1100


def decode_bytes(vae, shape):
    return shape[-2] * shape[-1] * 64 * BYTES_PER_PIXEL_PER_DTYPE_BYTE * vae.vae_dtype.itemsize + (256 << 20)


def decode_full(vae, samples):
    """Decode on the GPU in one piece per image. Room comes through the model manager, which
    asks the loaded models (a streamed transformer evicts layers) for it. The VAE's weights come
    from pinned host masters where the pack can hold them, so the model manager unloading the VAE
    to make room for the transformer costs nothing, and loading it again is one fast upload
    (ComfyUI's classic path copies its weights to pageable memory and back: 0.13 s per image)."""
    need = decode_bytes(vae, samples.shape)
    pinned = zcomfy.pinned_vae(vae)
    mm.load_models_gpu([vae.patcher if pinned is None else pinned], memory_required=need, force_full_load=True)
    out = []
    with torch.no_grad(), (contextlib.nullcontext() if pinned is None else pinned.part.running()):
        for i in range(samples.shape[0]):
            x = samples[i:i + 1].to(device=vae.device, dtype=vae.vae_dtype)
            img = vae.first_stage_model.decode(x).to(vae.output_device).float()
            out.append(vae.process_output(img))
    if pinned is not None:
        pinned.part.pool.report("VAE")
    return torch.cat(out).movedim(1, -1)


class ZImageDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ZImageDecode",
            display_name="Z-Image Decode (streaming)",
            category="Z-Image",
            description="Full VAE decode on the GPU, making room by evicting transformer layers. Falls back to a "
                        "tiled decode (with a warning) only when even an emptied GPU cannot hold it.",
            inputs=[io.Vae.Input("vae", tooltip="The Flux VAE: a VAELoader with ae.safetensors."),
                    io.Latent.Input("samples", tooltip="The latent from Z-Image Sampler (streaming) or a KSampler.")],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
            **aliases("vae decode"),
        )

    @classmethod
    def execute(cls, vae, samples):
        latent = samples["samples"]
        if latent.ndim == 5:
            latent = latent[:, :, 0]
        finite_latent(latent, "The latent to decode holds NaN or infinity: the image would be black")
        try:
            return io.NodeOutput(decode_full(vae, latent))
        except mm.OOM_EXCEPTION:
            log.info("Z-Image: the decode ran out of memory in the room it asked for; emptying the GPU and retrying")
        mm.free_memory(1e30, vae.device)  # everything else off the GPU, then one more full try
        try:
            return io.NodeOutput(decode_full(vae, latent))
        except mm.OOM_EXCEPTION:
            pass
        mm.soft_empty_cache()
        text = ("Z-Image: the VAE decode does not fit even on an emptied GPU at "
                f"{latent.shape[-1] * 8}x{latent.shape[-2] * 8}; decoding tiled (slower, slightly different).")
        log.warning(text)
        show(node_id(cls), text)
        return io.NodeOutput(vae.decode_tiled(latent))

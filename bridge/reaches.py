"""Every place the pack relies on ComfyUI beyond its public node API, in one list: what it uses,
where, and the ComfyUI versions it was checked on. This is what breaks when ComfyUI updates.

``check()`` imports ComfyUI (it must be importable and initialised, as in a running server) and
returns one message per reach that no longer holds; the test suite runs it against each ComfyUI
tree it is given and fails naming the reach. Public API is preferred where ComfyUI has one; what
is listed here has none.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

CHECKED = "v0.8.0, v0.20.1, v0.28.0, v0.33.0"
SINCE_V020 = "v0.20.1, v0.28.0, v0.33.0"  # the reaches v0.8 has no counterpart of


@dataclass(frozen=True)
class Reach:
    what: str                       # what the pack relies on
    where: str                      # the pack's code that relies on it
    test: Callable[[], str | None]  # None while it holds, else what changed
    versions: str = CHECKED         # the ComfyUI versions it was checked on


def _params(fn, *names) -> str | None:
    have = inspect.signature(fn).parameters
    missing = [n for n in names if n not in have]
    return f"{fn.__qualname__} has no parameter {', '.join(missing)}" if missing else None


def _methods(cls, **signatures) -> str | None:
    for name, params in signatures.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__}.{name} is gone"
        problem = _params(fn, *params)
        if problem:
            return problem
    return None


def _source_mentions(obj, *names) -> str | None:
    src = inspect.getsource(obj)
    missing = [n for n in names if n not in src]
    return f"{getattr(obj, '__name__', obj)} no longer mentions {', '.join(missing)}" if missing else None


def _attributes(obj, *names) -> str | None:
    missing = [n for n in names if not hasattr(obj, n)]
    return f"{getattr(obj, '__name__', obj)} has no {', '.join(missing)}" if missing else None


def _file_mentions(name, *texts) -> str | None:
    """A file of ComfyUI's root that cannot be imported here (``execution.py`` imports ComfyUI's
    ``nodes``, which a process with the pack on its path finds as the pack's own)."""
    import os

    import folder_paths  # a module of ComfyUI's root
    with open(os.path.join(os.path.dirname(os.path.abspath(folder_paths.__file__)), name)) as f:
        src = f.read()
    missing = [t for t in texts if t not in src]
    return f"{name} no longer has {', '.join(missing)}" if missing else None


def _optional(module_name, attr) -> str | None:
    """Something only newer versions have: absent is fine, present must be what the pack reads."""
    import importlib
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    if hasattr(module, attr) and not isinstance(getattr(module, attr), int):
        return f"{module_name}.{attr} is no longer a byte count"
    return None


def reaches() -> list:
    import comfy_execution.utils
    import folder_paths
    import latent_preview

    import comfy.conds
    import comfy.float
    import comfy.ldm.modules.attention
    import comfy.lora
    import comfy.model_base
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    import comfy.model_sampling
    import comfy.patcher_extension
    import comfy.sample
    import comfy.samplers
    import comfy.sd
    import comfy.supported_models
    import comfy.utils

    return [
        Reach("ModelPatcher's loading protocol, overridden by the pack's patchers: load, partially_load, "
              "partially_unload, unpatch_model, patch_model, model_size, loaded_size", "model.py: ZImagePatcher, "
              "pinned.py: PinnedPatcher",
              lambda: _methods(mp.ModelPatcher, load=("device_to", "lowvram_model_memory", "force_patch_weights",
                                                      "full_load"),
                               partially_load=("device_to", "extra_memory", "force_patch_weights"),
                               partially_unload=("device_to", "memory_to_free"),
                               unpatch_model=("device_to", "unpatch_weights"),
                               patch_model=("device_to", "lowvram_model_memory", "load_weights"),
                               model_size=(), loaded_size=(), add_callback=("call_type", "callback"))),
        Reach("The bookkeeping ComfyUI reads off a model, written by the pack: model_loaded_weight_memory, "
              "model_lowvram, device", "model.py: ZImagePatcher._sync",
              lambda: _source_mentions(mp, "model_loaded_weight_memory", "model_lowvram")),
        Reach("Weight patches and hooks on a patcher: patches, patches_uuid, forced_hooks", "pinned.py: pinned_patcher, "
              "patches.py: apply",
              lambda: _source_mentions(mp.ModelPatcher.__init__, "self.patches", "self.patches_uuid",
                                       "self.forced_hooks")),
        Reach("Which patchers ComfyUI holds on the GPU: model_management.current_loaded_models and "
              "LoadedModel.model", "pinned.py: loaded_by_comfy, model.py: take_back_memory",
              lambda: _attributes(mm, "current_loaded_models") or _source_mentions(mm.LoadedModel, "def model")),
        Reach("Dynamic VRAM marks the modules it manages with an attribute _v (absent before v0.20)",
              "pinned.py: pinned_patcher, vae.py: pinned_vae",
              lambda: _source_mentions(mp, "m._v = ") if hasattr(mp, "ModelPatcherDynamic") else None,
              SINCE_V020),
        Reach("model_mmap_residency and pinned_memory_size, overridden to say the pack's host copies are "
              "its own (only in newer versions)", "model.py: ZImagePatcher, pinned.py: PinnedPatcher",
              lambda: None if not hasattr(mp.ModelPatcher, "pinned_memory_size") else
              _methods(mp.ModelPatcher, pinned_memory_size=()), SINCE_V020),
        Reach("The dtype a model runs each tensor in, archived as <name>_comfy_model_dtype by "
              "model_management.archive_model_dtypes (with Dynamic VRAM the file's tensors are loaded as "
              "they are; absent in v0.8)", "pinned.py: run_dtypes",
              lambda: _source_mentions(mm.archive_model_dtypes, "_comfy_model_dtype")
              if hasattr(mm, "archive_model_dtypes") else None, SINCE_V020),
        Reach("The RAM-pressure cache's headroom, comfy.memory_management.RAM_CACHE_HEADROOM (absent in v0.8)",
              "memory.py: _ram_cache_headroom",
              lambda: _optional("comfy.memory_management", "RAM_CACHE_HEADROOM"), SINCE_V020),
        Reach("The Z-Image base model: model_base.Lumina2 with memory_required(input_shape, cond_shapes) and "
              "extra_conds(**kwargs), subclassed", "model.py: ZImageModel",
              lambda: _methods(comfy.model_base.Lumina2, memory_required=("input_shape",), extra_conds=())),
        Reach("The Z-Image model config built from a hand-written unet_config: supported_models.ZImage, "
              "supported_inference_dtypes, set_inference_dtype", "model.py: unet_config, load_model",
              lambda: _attributes(comfy.supported_models, "ZImage")
              or _attributes(comfy.supported_models.ZImage, "supported_inference_dtypes", "set_inference_dtype")),
        Reach("ModelPatcher's weight-patch formula, re-implemented: lora.calculate_weight(patches, weight, key), "
              "float.stochastic_rounding(value, dtype, seed), string_to_seed (utils; model_patcher in v0.8), "
              "model_management.lora_compute_dtype", "patches.py: apply; model.py: load_model",
              lambda: _params(comfy.lora.calculate_weight, "patches", "weight", "key")
              or _params(comfy.float.stochastic_rounding, "value", "dtype", "seed")
              or (None if hasattr(comfy.utils, "string_to_seed") else _attributes(mp, "string_to_seed"))
              or _attributes(mm, "lora_compute_dtype")
              or _source_mentions(mp.ModelPatcher.patch_weight_to_device, "calculate_weight",
                                  "stochastic_rounding", "string_to_seed")),
        Reach("The model manager's calls: load_models_gpu(models, memory_required, force_full_load), "
              "free_memory(memory_required, device), unet_dtype, unet_manual_cast, get_torch_device, "
              "unet_offload_device, throw_exception_if_processing_interrupted", "the bridge",
              lambda: _params(mm.load_models_gpu, "models", "memory_required", "force_full_load")
              or _params(mm.free_memory, "memory_required", "device")
              or _params(mm.unet_dtype, "model_params", "supported_dtypes", "weight_dtype")
              or _attributes(mm, "unet_manual_cast", "get_torch_device", "unet_offload_device",
                             "throw_exception_if_processing_interrupted", "OOM_EXCEPTION", "soft_empty_cache")),
        Reach("ComfyUI's attention kernel: optimized_attention(q, k, v, heads, ..., skip_reshape), and its "
              "default, attention_pytorch", "model.py: comfy_attention, attention",
              lambda: (_params(comfy.ldm.modules.attention.optimized_attention, "skip_reshape")
                       if callable(comfy.ldm.modules.attention.optimized_attention) else "optimized_attention is gone")
              or _attributes(comfy.ldm.modules.attention, "attention_pytorch")),
        Reach("Prompt embeddings wrapped as conds.CONDRegular", "model.py: ZImageModel.extra_conds",
              lambda: _attributes(comfy.conds, "CONDRegular")),
        Reach("A patcher's load callback: patcher_extension.CallbacksMP.ON_LOAD", "pinned.py: pinned_patcher",
              lambda: _attributes(comfy.patcher_extension.CallbacksMP, "ON_LOAD")),
        Reach("VAE.decode, re-implemented for a decode in one piece: first_stage_model, patcher, vae_dtype, "
              "device, output_device, process_output, decode_tiled", "vae.py: decode, pinned_vae",
              lambda: _source_mentions(comfy.sd.VAE, "self.first_stage_model", "self.patcher", "self.vae_dtype",
                                       "self.device", "self.output_device", "self.process_output",
                                       "def decode_tiled")),
        Reach("Sampling as KSampler samples: sample.sample(..., sigmas, callback, disable_pbar, seed), "
              "prepare_noise, fix_empty_latent_channels, samplers.calculate_sigmas, KSampler.SAMPLERS and "
              "SCHEDULERS, the flow schedule ModelSamplingAuraFlow installs (ModelSamplingDiscreteFlow with "
              "CONST, set_parameters(shift, multiplier)), latent_preview.prepare_callback",
              "sampler.py: sample, shifted_sigmas",
              lambda: _params(comfy.sample.sample, "model", "noise", "steps", "cfg", "sampler_name", "scheduler",
                              "positive", "negative", "latent_image", "denoise", "sigmas", "callback",
                              "disable_pbar", "seed")
              or _params(comfy.sample.prepare_noise, "latent_image", "seed")
              or _params(comfy.sample.fix_empty_latent_channels, "model", "latent_image")
              or _params(comfy.samplers.calculate_sigmas, "model_sampling", "scheduler_name", "steps")
              or _attributes(comfy.samplers.KSampler, "SAMPLERS", "SCHEDULERS")
              or _params(comfy.model_sampling.ModelSamplingDiscreteFlow.set_parameters, "shift", "multiplier")
              or _attributes(comfy.model_sampling, "CONST")
              or _params(latent_preview.prepare_callback, "model", "steps")),
        Reach("ModelPatcher.add_patches(patches, strength_patch, strength_model) returning the keys it added, "
              "overridden to remember which LoRA loader a patch came from", "model.py: ZImagePatcher.add_patches",
              lambda: _params(mp.ModelPatcher.add_patches, "patches", "strength_patch", "strength_model")
              or _source_mentions(mp.ModelPatcher.add_patches, "return list(p)")),
        Reach("The node being executed and its prompt: comfy_execution.utils.get_executing_context() (prompt_id, "
              "node_id), PromptServer.instance.prompt_queue.get_current_queue_volatile() with running items "
              "(number, prompt_id, prompt, ...): the tests' damaged LoRA named by its file shows the layout holds",
              "prompt.py: running_node",
              lambda: _attributes(comfy_execution.utils, "get_executing_context")
              or _attributes(comfy_execution.utils.ExecutionContext, "prompt_id", "node_id")
              or _file_mentions("execution.py", "def get_current_queue_volatile(self)")),
        Reach("The diffusion models' folders and a walk of one: folder_paths.get_folder_paths(name), "
              "recursive_search(directory, excluded_dir_names) returning (relative paths, folders)",
              "ui.py: _gguf_files",
              lambda: _params(folder_paths.get_folder_paths, "folder_name")
              or _params(folder_paths.recursive_search, "directory", "excluded_dir_names")),
    ]


def check() -> list:
    """One line per reach that no longer holds: what the pack relies on, where, and what changed."""
    problems = []
    for r in reaches():
        try:
            change = r.test()
        except Exception as e:  # a module or class that is gone
            change = f"{type(e).__name__}: {e}"
        if change:
            problems.append(f"{r.what} ({r.where}; checked on {r.versions}): {change}")
    return problems

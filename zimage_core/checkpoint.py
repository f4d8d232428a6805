"""Z-Image transformer checkpoints in every layout found in the wild, as one canonical view.

The canonical key names are ComfyUI's (fused ``attention.qkv``); official / diffusers files
(separate q/k/v, ``all_x_embedder.2-1``, sharded with an index) are mapped onto them. Nothing
is loaded here: each canonical key yields the stored pieces it is made of, read when asked.
"""
from __future__ import annotations

import json
import os
import re

import torch

from .config import BIG_KEYS, ZImageConfig
from .errors import CheckpointError
from .gguf_file import GGUFFile
from .comfy_quant import ScaledFile, open_scaled
from .safetensors_file import SafetensorsFile

COMFY_PREFIX = "model.diffusion_model."
_IGNORED = {"norm_final.weight"}
_DIFFUSERS_RENAMES = [
    ("all_x_embedder.2-1.", "x_embedder."),
    ("all_final_layer.2-1.", "final_layer."),
    (".attention.to_out.0.", ".attention.out."),
    (".attention.norm_q.", ".attention.q_norm."),
    (".attention.norm_k.", ".attention.k_norm."),
]
_QKV = re.compile(r"^(.*\.attention\.)to_([qkv])\.weight$")


def diffusers_keys(key: str) -> list:
    """Canonical ``key`` -> [(diffusers key, part)]: the renames above backwards, and a fused q/k/v
    projection as its three parts (rows 0, 1, 2 of three; None: the whole tensor)."""
    if key.endswith(".attention.qkv.weight"):
        base = key[:-len("qkv.weight")]
        return [(f"{base}to_{n}.weight", i) for i, n in enumerate("qkv")]
    for a, b in _DIFFUSERS_RENAMES:
        key = key.replace(b, a) if b.startswith(".") else (a + key[len(b):] if key.startswith(b) else key)
    return [(key, None)]
_OTHER_MODELS = [
    ("double_blocks.", "a Flux transformer"),
    ("decoder.conv_in.weight", "a VAE"),
    ("encoder.conv_in.weight", "a VAE"),
    ("model.layers.0.self_attn.q_proj.weight", "a text encoder"),
    ("model.embed_tokens.weight", "a text encoder"),
    ("input_blocks.0.0.weight", "a Stable Diffusion UNet"),
    ("joint_blocks.0.", "an SD3 transformer"),
]
_FIX = "Pick a Z-Image-Turbo diffusion model (e.g. z_image_turbo_bf16.safetensors) in models/diffusion_models."


def expected_shapes(cfg: ZImageConfig) -> dict:
    """Every canonical key of a Z-Image transformer and its shape."""
    d, hd = cfg.dim, cfg.head_dim
    out = {}

    def block(prefix, modulated):
        for name, shape in cfg.big_shapes.items():
            out[f"{prefix}{BIG_KEYS[name]}.weight"] = shape
        out[f"{prefix}attention.q_norm.weight"] = (hd,)
        out[f"{prefix}attention.k_norm.weight"] = (hd,)
        for n in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            out[f"{prefix}{n}.weight"] = (d,)
        if modulated:
            out[f"{prefix}adaLN_modulation.0.weight"] = (4 * d, cfg.t_dim)
            out[f"{prefix}adaLN_modulation.0.bias"] = (4 * d,)

    for i in range(cfg.n_layers):
        block(f"layers.{i}.", True)
    for i in range(cfg.n_refiner_layers):
        block(f"noise_refiner.{i}.", True)
        block(f"context_refiner.{i}.", False)
    patch = cfg.in_channels * cfg.patch_size ** 2
    out.update({
        "x_embedder.weight": (d, patch), "x_embedder.bias": (d,),
        "t_embedder.mlp.0.weight": (cfg.t_hidden, cfg.t_dim), "t_embedder.mlp.0.bias": (cfg.t_hidden,),
        "t_embedder.mlp.2.weight": (cfg.t_dim, cfg.t_hidden), "t_embedder.mlp.2.bias": (cfg.t_dim,),
        "cap_embedder.0.weight": (cfg.cap_feat_dim,),
        "cap_embedder.1.weight": (d, cfg.cap_feat_dim), "cap_embedder.1.bias": (d,),
        "final_layer.linear.weight": (patch, d), "final_layer.linear.bias": (patch,),
        "final_layer.adaLN_modulation.1.weight": (d, cfg.t_dim), "final_layer.adaLN_modulation.1.bias": (d,),
        "x_pad_token": (1, d), "cap_pad_token": (1, d),
    })
    return out


class Checkpoint:
    """A Z-Image checkpoint: canonical keys -> stored pieces, plus its config."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files = []
        try:
            for p in _shard_paths(self.path):
                self.files.append(GGUFFile(p) if p.endswith(".gguf") else SafetensorsFile(p))
                if isinstance(self.files[-1], SafetensorsFile):
                    self.files[-1] = open_scaled(self.files[-1])
            self._index = self._canonical_index()
            self.config = self._read_config()
            self._validate()
        except BaseException:
            self.close()
            raise

    # -- reading -----------------------------------------------------------------------------

    def keys(self) -> list:
        """Every canonical key the file provides."""
        return list(self._index)

    def pieces(self, key):
        """[(row_offset, StoredTensor)] that make up canonical ``key``."""
        return [(row, f.stored(k)) for row, f, k in self._index[key]]

    def read_into(self, key, out: torch.Tensor):
        """Canonical ``key`` into ``out`` (its shape; any dtype, cast on the way)."""
        for row, piece in self.pieces(key):
            piece.read_into(out[row:row + piece.shape[0]])

    def tensor(self, key, dtype=None) -> torch.Tensor:
        """Canonical ``key`` as a fresh host tensor, in ``dtype`` or as stored."""
        out = torch.empty(self._shape(key), dtype=dtype or self.dtype(key))
        self.read_into(key, out)
        return out

    def mapped(self, key, dtype) -> torch.Tensor | None:
        """Canonical ``key`` as a read-only view of the file's pages where it is stored whole in
        ``dtype`` (``SafetensorsFile.mapped``), else None."""
        parts = self._index[key]
        if len(parts) != 1 or self.dtype(key) != dtype:
            return None
        _, f, k = parts[0]
        return f.mapped(k)

    def check_unchanged(self):
        """Raise when a file of the checkpoint changed on disk since it was opened."""
        for f in self.files:
            f.check_unchanged()

    def dtype(self, key) -> torch.dtype:
        _, f, k = self._index[key][0]
        return f.dtype(k)

    @property
    def streams_blocks(self) -> bool:
        """A GGUF (or a scaled fp8 file) whose layers' matrices are each one stored tensor: its layers
        can stream as stored (``StreamConfig.quantized``)."""
        return all(isinstance(f, (GGUFFile, ScaledFile)) for f in self.files) and all(
            len(self._index[k]) == 1 for k in self._index if k.endswith(tuple(f"{v}.weight" for v in BIG_KEYS.values())))

    @property
    def storage_dtype(self) -> torch.dtype:
        """How the big layer matrices are stored in the file."""
        return self.dtype("layers.0.attention.qkv.weight")

    def close(self):
        for f in self.files:
            f.close()
        self.files = []

    # -- layout ------------------------------------------------------------------------------

    def _canonical_index(self):
        raw = {k: (f, k) for f in self.files for k in f.keys()}
        if sum(k.startswith(COMFY_PREFIX) for k in raw) > 5:
            raw = {k[len(COMFY_PREFIX):]: v for k, v in raw.items() if k.startswith(COMFY_PREFIX)}
        index = {}
        for key, (f, src) in raw.items():
            if key in _IGNORED:
                continue
            m = _QKV.match(key)
            if m:
                index.setdefault(m.group(1) + "qkv.weight", []).append(("qkv" + m.group(2), f, src))
                continue
            for a, b in _DIFFUSERS_RENAMES:
                key = key.replace(a, b) if a.startswith(".") else (b + key[len(a):] if key.startswith(a) else key)
            index[key] = [(0, f, src)]
        for key, parts in index.items():
            if parts[0][0] in ("qkvq", "qkvk", "qkvv"):
                order = {p[0]: p for p in parts}
                if set(order) != {"qkvq", "qkvk", "qkvv"}:
                    raise CheckpointError(self.path, f"has only part of the q/k/v projections for {key}.",
                                          "The file is incomplete; download it again.")
                rows, fused = 0, []
                for name in ("qkvq", "qkvk", "qkvv"):
                    _, f, src = order[name]
                    fused.append((rows, f, src))
                    rows += f.shape(src)[0]
                index[key] = fused
        return index

    def _shape(self, key):
        parts = self._index[key]
        shapes = [f.shape(k) for _, f, k in parts]
        if len(shapes) == 1:
            return shapes[0]
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def _read_config(self) -> ZImageConfig:
        if "cap_embedder.1.weight" not in self._index:
            keys = set(self._index)
            what = next((name for marker, name in _OTHER_MODELS
                         if any(k.startswith(marker) or k == marker for k in keys)), None)
            problem = "is not a Z-Image transformer (it has no cap_embedder.1.weight)"
            problem += f"; it looks like {what}." if what else "."
            raise CheckpointError(self.path, problem, _FIX)
        # each size is read from every tensor that carries it and the most common value wins, so a
        # single misshapen tensor is the one _validate names, not the ones that agree with the rest
        dim = self._common(r"(layers|noise_refiner|context_refiner)\.\d+\.attention_norm1\.weight$", 0)
        head_dim = self._common(r"(layers|noise_refiner|context_refiner)\.\d+\.attention\.[qk]_norm\.weight$", 0)
        ffn_dim = self._common(r"(layers|noise_refiner|context_refiner)\.\d+\.feed_forward\.w[13]\.weight$", 0)
        try:
            cap_dim = self._shape("cap_embedder.1.weight")[1]
            t_hidden, t_dim = self._shape("t_embedder.mlp.0.weight")
            patch_in = self._shape("x_embedder.weight")[1]
        except (KeyError, ValueError):
            dim = None
        if None in (dim, head_dim, ffn_dim) or not head_dim or dim % head_dim:
            raise CheckpointError(self.path, "is missing its main layers or an embedder; it is not a complete "
                                             "Z-Image transformer.", _FIX)
        n_layers = _count(self._index, "layers")
        n_ref = _count(self._index, "noise_refiner")
        a0 = head_dim // 4
        return ZImageConfig(dim=dim, n_layers=n_layers, n_refiner_layers=n_ref, n_heads=dim // head_dim,
                            ffn_dim=ffn_dim, cap_feat_dim=cap_dim, in_channels=patch_in // 4,
                            t_dim=t_dim, t_hidden=t_hidden,
                            axes_dims=(a0, (head_dim - a0) // 2, (head_dim - a0) // 2))

    def _common(self, pattern, axis):
        """The most common size along ``axis`` of the tensors whose keys match ``pattern``."""
        sizes = [self._shape(k)[axis] for k in self._index if re.match(pattern, k) and len(self._shape(k)) > axis]
        return max(set(sizes), key=sizes.count) if sizes else None

    def _validate(self):
        want = expected_shapes(self.config)
        missing = [k for k in want if k not in self._index]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(self.path, f"is missing {len(missing)} Z-Image tensor(s): {shown}.",
                                  "The file is incomplete or from another model; download it again.")
        for k, shape in want.items():
            if tuple(self._shape(k)) != tuple(shape):
                raise CheckpointError(self.path, f"has {k} with shape {list(self._shape(k))}, expected "
                                                 f"{list(shape)}.", _FIX)
            self.dtype(k)  # raises on unsupported storage


def _count(index, stem):
    ids = {int(m.group(1)) for k in index for m in [re.match(rf"^{stem}\.(\d+)\.", k)] if m}
    return max(ids) + 1 if ids else 0


def _shard_paths(path):
    """A single file, a ``*.safetensors.index.json``, or a folder holding one of either."""
    if os.path.isdir(path):
        idx = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors.index.json")]
        files = [f for f in sorted(os.listdir(path)) if f.endswith((".safetensors", ".sft"))]
        if idx:
            return _shard_paths(os.path.join(path, idx[0]))
        if len(files) == 1:
            return [os.path.join(path, files[0])]
        raise CheckpointError(path, "is a folder without a single .safetensors file or a "
                                    "*.safetensors.index.json.", "Point at the file or at the index.")
    if path.endswith(".index.json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except FileNotFoundError:
            raise CheckpointError(path, "does not exist.", "Check the path.") from None
        except (KeyError, ValueError, TypeError):
            raise CheckpointError(path, "is not a safetensors index (no weight_map).", _FIX) from None
        base = os.path.dirname(path)
        return [os.path.join(base, n) for n in sorted(set(weight_map.values()))]
    return [path]

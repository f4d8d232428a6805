"""Z-Image transformer hyper-parameters, read from a checkpoint's tensor shapes."""
from __future__ import annotations

from dataclasses import dataclass

# The five matrices of a block that are worth streaming, in packing order: name -> key in the block
BIG_KEYS = {"qkv": "attention.qkv", "out": "attention.out", "w1": "feed_forward.w1",
            "w3": "feed_forward.w3", "w2": "feed_forward.w2"}


@dataclass(frozen=True)
class ZImageConfig:
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    ffn_dim: int = 10240
    cap_feat_dim: int = 2560
    in_channels: int = 16
    patch_size: int = 2
    t_dim: int = 256
    t_hidden: int = 1024
    axes_dims: tuple = (32, 48, 48)
    rope_theta: float = 256.0
    norm_eps: float = 1e-5
    time_scale: float = 1000.0
    pad_multiple: int = 32

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def big_shapes(self) -> dict:
        """``BIG_KEYS``' matrices and their shapes."""
        d, f = self.dim, self.ffn_dim
        shapes = {"qkv": (3 * d, d), "out": (d, d), "w1": (f, d), "w3": (f, d), "w2": (d, f)}
        return {name: shapes[name] for name in BIG_KEYS}

    def image_tokens(self, width: int, height: int) -> int:
        p = self.patch_size * 8
        n = (width // p) * (height // p)
        return n + (-n) % self.pad_multiple

    def small_layer_params(self, modulated: bool = True) -> int:
        """Parameters of a block that always stay on the GPU: norms and adaLN."""
        n = 4 * self.dim + 2 * self.head_dim
        if modulated:
            n += 4 * self.dim * (self.t_dim + 1)
        return n

    def big_layer_params(self) -> int:
        return sum(a * b for a, b in self.big_shapes.values())

    @property
    def n_blocks(self) -> int:
        """Blocks whose big matrices stream: the refiners (context, then noise) and the main layers."""
        return self.n_layers + 2 * self.n_refiner_layers

    def block_names(self) -> list:
        """Every streamable block's key prefix, in the order a forward runs them."""
        r = range(self.n_refiner_layers)
        return ([f"context_refiner.{i}" for i in r] + [f"noise_refiner.{i}" for i in r]
                + [f"layers.{i}" for i in range(self.n_layers)])

    def fixed_params(self) -> int:
        """Everything that is never streamed: embedders, final layer, pad tokens, and the norms
        and adaLN of every block."""
        d = self.dim
        n = self.n_refiner_layers * (self.small_layer_params(True) + self.small_layer_params(False))
        n += self.n_layers * self.small_layer_params(True)
        n += d * self.in_channels * self.patch_size ** 2 + d  # x_embedder
        n += self.t_hidden * self.t_dim + self.t_hidden + self.t_dim * self.t_hidden + self.t_dim
        n += self.cap_feat_dim + d * self.cap_feat_dim + d  # cap_embedder
        n += self.in_channels * self.patch_size ** 2 * (d + 1) + d * (self.t_dim + 1)  # final layer
        return n + 2 * d  # pad tokens

    def total_params(self) -> int:
        return self.fixed_params() + self.n_blocks * self.big_layer_params()


FULL = ZImageConfig()

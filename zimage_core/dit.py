"""The Z-Image DiT in plain PyTorch, numerically the model of ComfyUI's ``NextDiT`` (Z-Image config).

Blocks hold only their small parameters (norms, adaLN). The five big matrices of every block
arrive as a ``BigWeights`` argument, so the same kernels run whether a matrix is a resident
tensor or a view of a streaming slot: that is what makes streamed output bit-identical.
Called the way ComfyUI calls its diffusion models:
``model(x, timesteps, context, num_tokens, attention_mask=None, transformer_options={})``,
with ``timesteps`` = sigma and the output negated (the sampler sees noise - x0).

A ``Chunks`` argument runs every block in pieces of the sequence (projections and FFN by rows,
attention by queries) with a ``tick`` between pieces: on the CPU a 2048x2048 block is a minute of
work, and an interrupt is only seen between pieces; the FFN's hidden states then exist for one
piece at a time.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import attention_input, elementwise
from .config import ZImageConfig
from .devices import to_device


class Chunks(NamedTuple):
    """Run blocks ``rows`` tokens (``queries`` for attention) at a time, calling ``tick()`` between
    pieces (an interrupt check)."""
    rows: int
    queries: int
    tick: Callable[[], None]


# On the CPU a block runs in pieces of about this much work, so that an interrupt (checked between
# pieces) stops a 2048x2048 step within a second or so even on two cores
CPU_PIECE_FLOPS = 2e10


def cpu_chunks(cfg: ZImageConfig, width, height, batch=1, tick: Callable[[], None] = lambda: None) -> Chunks:
    """The pieces a forward on the CPU runs its blocks in: about ``CPU_PIECE_FLOPS`` each (rows for the
    projections and the FFN, queries for the attention), with ``tick()`` between them."""
    tokens = batch * (cfg.image_tokens(width, height) + 512)
    rows = int(CPU_PIECE_FLOPS / (2 * batch * cfg.dim * max(3 * cfg.dim, cfg.ffn_dim)))
    queries = int(CPU_PIECE_FLOPS / (4 * batch * tokens * cfg.dim))
    return Chunks(max(32, rows // 32 * 32), max(16, queries // 16 * 16), tick)


def _pieces(n, size):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _rowwise(fn, x, size, tick):
    """fn over row pieces of x [B, L, ...], concatenated."""
    out = []
    for a, b in _pieces(x.shape[1], size):
        out.append(fn(x[:, a:b]))
        tick()
    return torch.cat(out, dim=1)


class BigWeights(NamedTuple):
    qkv: torch.Tensor
    out: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


def clamp_fp16(x):
    """fp16 activations overflow to inf in Z-Image; ComfyUI clamps at the same three places."""
    if x.dtype == torch.float16:
        return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


def linear(x, w, b=None):
    """F.linear in the activation dtype; a weight stored narrower (fp8) is upcast on the device."""
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), b)


def rope(pos, dim, theta):
    """Rotation matrices for one axis, computed as ComfyUI does (fp64 frequencies, fp32 result)."""
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).to(torch.float32)


def rope_freqs(ids, axes_dims, theta):
    """[B, L, 3] position ids -> [B, L, 1, head_dim/2, 2, 2]."""
    emb = torch.cat([rope(ids[..., i], axes_dims[i], theta) for i in range(ids.shape[-1])], dim=-3)
    return emb.unsqueeze(2)


def sdpa_attention(q, k, v, heads):
    """[B, H, L, D] q, k, v -> [B, L, H*D]. ComfyUI's ``optimized_attention`` has this signature,
    so inside ComfyUI the same attention kernel as its native Z-Image can be used."""
    b, _, n, d = q.shape
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, heads * d)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Module):
    def __init__(self, n_in, n_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class _QKNorms(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        # their weights only: ``attention_input`` applies them, without an eps of their own as ComfyUI
        self.q_norm = RMSNorm(head_dim, None)
        self.k_norm = RMSNorm(head_dim, None)


class Block(nn.Module):
    """A joint transformer block; ``modulated`` blocks (main layers, noise refiners) use adaLN."""

    def __init__(self, cfg: ZImageConfig, modulated: bool, attention_fn=sdpa_attention):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.attention = _QKNorms(cfg.head_dim)
        for name in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
            setattr(self, name, RMSNorm(cfg.dim, cfg.norm_eps))
        self.modulated = modulated
        self.attention_fn = attention_fn
        if modulated:
            self.adaLN_modulation = nn.Sequential(Linear(cfg.t_dim, 4 * cfg.dim))

    def attend(self, x, freqs, w: BigWeights, chunks: Chunks | None = None):
        b, n, _ = x.shape
        qkv = linear(x, w.qkv) if chunks is None else _rowwise(lambda y: linear(y, w.qkv), x, chunks.rows, chunks.tick)
        q, k, v = attention_input.make(qkv, self.attention.q_norm.weight, self.attention.k_norm.weight, freqs,
                                       self.n_heads, self.head_dim)
        if chunks is None:
            return linear(self.attention_fn(q, k, v, self.n_heads), w.out)
        out = []
        for a, e in _pieces(n, chunks.queries):
            out.append(linear(self.attention_fn(q[:, :, a:e], k, v, self.n_heads), w.out))
            chunks.tick()
        return torch.cat(out, dim=1)

    def ffn(self, x, w: BigWeights, chunks: Chunks | None = None):
        def run(y):
            return linear(clamp_fp16(elementwise.silu_gate(linear(y, w.w1), linear(y, w.w3))), w.w2)
        return run(x) if chunks is None else _rowwise(run, x, chunks.rows, chunks.tick)

    def forward(self, x, freqs, adaln, w: BigWeights, chunks: Chunks | None = None):
        if self.modulated:
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln).chunk(4, dim=1)
            x = self._gated(x, self.attend(self._scaled(x, self.attention_norm1, 1 + scale_msa), freqs, w, chunks),
                            self.attention_norm2, gate_msa.tanh())
            x = self._gated(x, self.ffn(self._scaled(x, self.ffn_norm1, 1 + scale_mlp), w, chunks),
                            self.ffn_norm2, gate_mlp.tanh())
        else:
            x = x + self.attention_norm2(clamp_fp16(self.attend(self.attention_norm1(x), freqs, w, chunks)))
            x = x + self.ffn_norm2(self.ffn(self.ffn_norm1(x), w, chunks))
        return x

    @staticmethod
    def _scaled(x, norm: RMSNorm, scale):
        """norm(x) * scale, scale [B, D] (adaLN's 1 + scale)."""
        return elementwise.scaled_norm(x, norm.weight, norm.eps, scale)

    @staticmethod
    def _gated(x, y, norm: RMSNorm, gate):
        """x + gate * norm(y), gate [B, D] (adaLN's tanh(gate)); y clamped first where fp16."""
        return elementwise.gated_residual(x, clamp_fp16(y), norm.weight, norm.eps, gate)


class _TimestepEmbedder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mlp = nn.Sequential(Linear(cfg.t_dim, cfg.t_hidden), nn.SiLU(), Linear(cfg.t_hidden, cfg.t_dim))


class _FinalLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.linear = Linear(cfg.dim, cfg.patch_size ** 2 * cfg.in_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), Linear(cfg.t_dim, cfg.dim))

    def forward(self, x, c):
        scale = self.adaLN_modulation(c)
        x = F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale.unsqueeze(1))
        return self.linear(x)


class ZImageDiT(nn.Module):
    """Small parameters live here. The big matrices of every block (context refiners, noise
    refiners, main layers, in that order) come from a runner (``run_layers(x, layer_fn, blocks,
    next_forward)``, ``n_streamed``, ``prefetch_first()``) that owns residency and streaming.
    ``attention(q, k, v, heads)``: the attention kernel (ComfyUI's, where ComfyUI runs the model)."""

    def __init__(self, cfg: ZImageConfig, dtype=torch.bfloat16, runner=None, attention=sdpa_attention):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.x_embedder = Linear(cfg.in_channels * cfg.patch_size ** 2, cfg.dim)
        self.t_embedder = _TimestepEmbedder(cfg)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, cfg.norm_eps), Linear(cfg.cap_feat_dim, cfg.dim))
        self.noise_refiner = nn.ModuleList(Block(cfg, True, attention) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(Block(cfg, False, attention) for _ in range(cfg.n_refiner_layers))
        self.layers = nn.ModuleList(Block(cfg, True, attention) for _ in range(cfg.n_layers))
        self.final_layer = _FinalLayer(cfg)
        self.x_pad_token = nn.Parameter(torch.empty(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.empty(1, cfg.dim))
        self.runner = runner

    def forward(self, x, timesteps, context, num_tokens=None, attention_mask=None, transformer_options={},
                chunks: Chunks | None = None, tick: Callable[[], None] = lambda: None, **kwargs):
        """``tick()`` runs between blocks (and between pieces with ``chunks``): an interrupt check."""
        # attention_mask is ignored, as ComfyUI v0.20 does for Z-Image: pad tokens are attended.
        cfg, p = self.cfg, self.cfg.patch_size
        dev = self.x_pad_token.device
        bs, _, h, w = x.shape
        # the inputs cross the bus before the first layer uploads queue up on the copy engine
        x = x.to(device=dev, dtype=self.dtype)
        timesteps, context = timesteps.to(dev), context.to(device=dev, dtype=self.dtype)
        self.runner.prefetch_first()
        x = F.pad(x, (0, (-w) % p, 0, (-h) % p), mode="circular")
        H, W = x.shape[-2:]
        t = 1.0 - timesteps
        t = self.t_embedder.mlp(timestep_embedding(t * cfg.time_scale, cfg.t_dim).to(self.dtype))

        cap = self.cap_embedder(context)
        cap = _pad(cap, self.cap_pad_token, cfg.pad_multiple)
        n_cap = cap.shape[1]
        cap_ids = torch.zeros(bs, n_cap, 3, dtype=torch.float32, device=dev)
        cap_ids[:, :, 0] = torch.arange(n_cap, dtype=torch.float32, device=dev) + 1.0

        img = self.x_embedder(x.view(bs, -1, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2))
        ht, wt = H // p, W // p
        img_ids = torch.zeros(bs, ht * wt, 3, dtype=torch.float32, device=dev)
        img_ids[:, :, 0] = n_cap + 1
        img_ids[:, :, 1] = torch.arange(ht, dtype=torch.float32, device=dev).view(-1, 1).repeat(1, wt).flatten()
        img_ids[:, :, 2] = torch.arange(wt, dtype=torch.float32, device=dev).view(1, -1).repeat(ht, 1).flatten()
        n_img = img.shape[1]
        img = _pad(img, self.x_pad_token, cfg.pad_multiple)
        img_ids = F.pad(img_ids, (0, 0, 0, img.shape[1] - n_img))

        cap_freqs = rope_freqs(cap_ids, cfg.axes_dims, cfg.rope_theta)
        img_freqs = rope_freqs(img_ids, cfg.axes_dims, cfg.rope_theta)
        r = cfg.n_refiner_layers
        follows = bool(self.runner.n_streamed) and another_forward_follows(transformer_options)

        def stage(blocks, first, freqs, adaln):
            near = {}  # freqs and adaln on each device that runs these blocks (``LayerChain``), crossed once

            def run(i, y, big):
                if y.device not in near:
                    near[y.device] = [None if t is None else to_device(t, y.device) for t in (freqs, adaln)]
                y = blocks[i - first](y, *near[y.device], big, chunks)
                tick()
                return y
            return run

        # every range looks ahead alike: a refiner's slot may be the next forward's first
        cap = self.runner.run_layers(cap, stage(self.context_refiner, 0, cap_freqs, None), range(0, r),
                                     next_forward=follows)
        img = self.runner.run_layers(img, stage(self.noise_refiner, r, img_freqs, t), range(r, 2 * r),
                                     next_forward=follows)
        xs = torch.cat((to_device(cap, img.device), img), dim=1)  # a chain may cut between the refiners
        freqs = torch.cat((cap_freqs, img_freqs), dim=1)
        xs = self.runner.run_layers(xs, stage(self.layers, 2 * r, freqs, t), range(2 * r, cfg.n_blocks),
                                    next_forward=follows)

        out = self.final_layer(to_device(xs, dev), t)[:, n_cap:n_cap + n_img]
        out = out.view(bs, ht, wt, p, p, -1).permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)
        return -out[:, :, :h, :w]


def another_forward_follows(transformer_options) -> bool:
    """Whether the sampler calls the model again after this call, read from the schedule that
    ComfyUI's samplers (and ``euler_sample``) put in ``transformer_options``: a sigma above the
    schedule's last nonzero one means more steps follow. Unknown means no."""
    schedule, now = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if schedule is None or now is None:
        return False
    last = min((s for s in schedule.tolist() if s > 0), default=0.0)
    return float(now.max()) > last


def _pad(x, token, multiple):
    extra = (-x.shape[1]) % multiple
    return torch.cat((x, token.to(x.dtype).unsqueeze(0).repeat(x.shape[0], extra, 1)), dim=1)

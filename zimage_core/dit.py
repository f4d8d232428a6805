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


class Scratch:
    """Where a forward's modulated blocks write their activations between the matrix products: one
    device buffer per forward (and card), each op's output a view at a fixed place in it, reused by
    every block in the order the stream runs them, and the residual updated in place. A block then
    asks the allocator for little more than the attention's output, where it made 23 allocations
    before: inside ComfyUI every one passes comfy-aimdo's hooks, a few microseconds each and some
    over 100 (torch.profiler, a server on a nearly full 8 GB card), on the host that queues the
    kernels.

    The places, in columns of a block's tokens (each region [B, L, columns]): the normed input
    [0, dim), qkv [dim, 4 dim), q, k, v [4 dim, 7 dim); the attention's projection back in [0, dim);
    the FFN's normed input [0, dim), w1's and w3's outputs after it (the SiLU gate written over
    w1's), w2's in [0, dim). adaLN's modulation and its four factors have a small buffer of their
    own. The buffer is no larger than what those tensors took at their peak before
    (``device_memory.activation_bytes``)."""

    def __init__(self, cfg: ZImageConfig, rows: int, dtype, device):
        """``rows``: batch times the most tokens a block of this forward runs."""
        self.flat = torch.empty(rows * max(7 * cfg.dim, cfg.dim + 2 * cfg.ffn_dim), dtype=dtype, device=device)
        self.small = None

    def region(self, x, start: int, columns: int) -> torch.Tensor:
        """The [B, L, columns] region from column ``start``, for ``x`` [B, L, ...]."""
        b, n = x.shape[:2]
        return self.flat[b * n * start:b * n * (start + columns)].view(b, n, columns)

    def heads(self, x, heads: int, head_dim: int) -> list:
        """q's, k's and v's [B, H, L, D] regions, for the normed input ``x`` [B, L, dim]."""
        b, n, dim = x.shape
        return [self.region(x, (4 + j) * dim, dim).view(b, heads, n, head_dim) for j in range(3)]

    @staticmethod
    def over(t):
        """Where an op's output replaces its input ``t`` (the residual, w1's output)."""
        return t

    def modulation(self, adaln, columns: int) -> tuple:
        """adaLN's [B, columns] modulation and its four [B, columns / 4] factors (each contiguous,
        as the kernels read them), in ``adaln``'s dtype."""
        b, d = adaln.shape[0], columns // 4
        if self.small is None:  # every block of a forward has the same adaln
            self.small = torch.empty(b * 2 * columns, dtype=adaln.dtype, device=self.flat.device)
        factors = self.small[b * columns:].view(4, b, d)
        return (self.small[:b * columns].view(b, columns), *factors.unbind(0))


class Allocating:
    """``Scratch``'s places where there is no buffer (a forward run in pieces, and the blocks without
    adaLN): none, so each op allocates its output."""

    @staticmethod
    def region(x, start: int, columns: int):
        return None

    @staticmethod
    def heads(x, heads: int, head_dim: int):
        return None

    @staticmethod
    def over(t):
        return None

    @staticmethod
    def modulation(adaln, columns: int) -> tuple:
        return (None,) * 5


ALLOCATE = Allocating()


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


def linear(x, w, b=None, out=None):
    """F.linear in the activation dtype; a weight stored narrower (fp8) is upcast on the device.
    Given ``out``, the product is written there: the same kernel as F.linear's (``matmul`` without
    a bias, ``addmm`` with one, for 2-D ``x`` only, as F.linear itself calls them)."""
    w = w if w.dtype == x.dtype else w.to(x.dtype)
    if out is None:
        return F.linear(x, w, b)
    return torch.matmul(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)


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

    def attend(self, x, freqs, w: BigWeights, chunks: Chunks | None = None, s: Scratch | Allocating = ALLOCATE):
        _, n, dim = x.shape
        qkv = (linear(x, w.qkv, out=s.region(x, dim, 3 * dim)) if chunks is None
               else _rowwise(lambda y: linear(y, w.qkv), x, chunks.rows, chunks.tick))
        q, k, v = attention_input.make(qkv, self.attention.q_norm.weight, self.attention.k_norm.weight, freqs,
                                       self.n_heads, self.head_dim, out=s.heads(x, self.n_heads, self.head_dim))
        if chunks is None:
            return linear(self.attention_fn(q, k, v, self.n_heads), w.out, out=s.region(x, 0, dim))
        out = []
        for a, e in _pieces(n, chunks.queries):
            out.append(linear(self.attention_fn(q[:, :, a:e], k, v, self.n_heads), w.out))
            chunks.tick()
        return torch.cat(out, dim=1)

    def ffn(self, x, w: BigWeights, chunks: Chunks | None = None, s: Scratch | Allocating = ALLOCATE):
        dim, ffn = x.shape[-1], w.w1.shape[0]

        def run(y):
            a = linear(y, w.w1, out=s.region(y, dim, ffn))
            g = elementwise.silu_gate(a, linear(y, w.w3, out=s.region(y, dim + ffn, ffn)), out=s.over(a))
            return linear(clamp_fp16(g), w.w2, out=s.region(y, 0, dim))
        return run(x) if chunks is None else _rowwise(run, x, chunks.rows, chunks.tick)

    def forward(self, x, freqs, adaln, w: BigWeights, chunks: Chunks | None = None, scratch: Scratch | None = None):
        """``scratch``: where a modulated block writes its activations, run whole (``Scratch``)."""
        if not self.modulated:
            x = x + self.attention_norm2(clamp_fp16(self.attend(self.attention_norm1(x), freqs, w, chunks)))
            return x + self.ffn_norm2(self.ffn(self.ffn_norm1(x), w, chunks))
        s = scratch if scratch is not None and chunks is None else ALLOCATE
        scale_msa, gate_msa, scale_mlp, gate_mlp = self._factors(adaln, s)
        x = self._gated(x, self.attend(self._scaled(x, self.attention_norm1, scale_msa, s), freqs, w, chunks, s),
                        self.attention_norm2, gate_msa, s)
        return self._gated(x, self.ffn(self._scaled(x, self.ffn_norm1, scale_mlp, s), w, chunks, s),
                           self.ffn_norm2, gate_mlp, s)

    def _factors(self, adaln, s: Scratch | Allocating):
        """adaLN's 1 + scale and tanh(gate), for the attention and the FFN."""
        lin = self.adaLN_modulation[0]
        mod, *out = s.modulation(adaln, lin.weight.shape[0])
        scale_msa, gate_msa, scale_mlp, gate_mlp = linear(adaln, lin.weight, lin.bias, out=mod).chunk(4, dim=1)
        return (torch.add(scale_msa, 1, out=out[0]), torch.tanh(gate_msa, out=out[1]),
                torch.add(scale_mlp, 1, out=out[2]), torch.tanh(gate_mlp, out=out[3]))

    @staticmethod
    def _scaled(x, norm: RMSNorm, scale, s: Scratch | Allocating):
        """norm(x) * scale, scale [B, D] (adaLN's 1 + scale)."""
        return elementwise.scaled_norm(x, norm.weight, norm.eps, scale, out=s.region(x, 0, x.shape[-1]))

    @staticmethod
    def _gated(x, y, norm: RMSNorm, gate, s: Scratch | Allocating):
        """x + gate * norm(y), gate [B, D] (adaLN's tanh(gate)); y clamped first where fp16."""
        return elementwise.gated_residual(x, clamp_fp16(y), norm.weight, norm.eps, gate, out=s.over(x))


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

        # the modulated blocks' activations, one buffer per card for the whole forward (``Scratch``);
        # run in pieces (``chunks``), the blocks allocate theirs piece by piece instead
        scratches = {}
        rows = bs * (n_cap + img.shape[1])  # the main layers' joint sequence, the longest

        def stage(blocks, first, freqs, adaln):
            near = {}  # freqs and adaln on each device that runs these blocks (``LayerChain``), crossed once

            def run(i, y, big):
                if y.device not in near:
                    near[y.device] = [None if t is None else to_device(t, y.device) for t in (freqs, adaln)]
                if chunks is None and adaln is not None and y.device not in scratches:
                    scratches[y.device] = Scratch(cfg, rows, y.dtype, y.device)
                y = blocks[i - first](y, *near[y.device], big, chunks, scratches.get(y.device))
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
        scratches.clear()

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

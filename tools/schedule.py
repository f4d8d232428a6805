"""Flow-matching sigmas (ComfyUI's ``simple`` scheduler over a shifted table) and Euler steps."""
from __future__ import annotations

import torch


def shifted(sigma, shift=3.0):
    """Static shift of flow matching: 3 sigma / (1 + 2 sigma) for shift 3."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def sigmas(steps: int, shift: float = 3.0, table_size: int = 1000) -> torch.Tensor:
    """``steps + 1`` sigmas from 1 to 0, picked from the shifted table of ``table_size`` timesteps
    at even strides (what ComfyUI's ``simple`` scheduler gives with ModelSamplingAuraFlow)."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    table = shifted(torch.arange(1, table_size + 1, dtype=torch.float32) / table_size, shift)
    stride = table_size / steps
    picked = [float(table[-(1 + int(i * stride))]) for i in range(steps)]
    return torch.tensor(picked + [0.0], dtype=torch.float32)


def euler_sample(model, noise, context, steps=8, shift=3.0, callback=None):
    """Sample from pure noise; ``model`` returns velocity (noise - x0) like ComfyUI's Z-Image.
    Latents stay fp32 between steps; the model casts its input to the compute dtype."""
    table = sigmas(steps, shift)  # on the host: the model reads it without waiting for the device
    s = table.to(noise.device)
    x = noise.float() * s[0]
    for i in range(steps):
        options = {"sample_sigmas": table, "sigmas": table[i:i + 1]}
        v = model(x, s[i:i + 1].expand(x.shape[0]), context, transformer_options=options).float()
        x = x + (s[i + 1] - s[i]) * v
        if callback is not None:
            callback(i, x)
    return x

"""Checks the nodes make on what they are given and what they make.

ComfyUI's validation compares numbers with their min and max, which NaN passes: an API prompt
with "cfg": NaN reaches the node. A NaN that gets through makes a black image, so numbers are
checked at the node and latents where they leave the sampler and enter the decode."""
import math

import torch

# What to try when an image comes out NaN or infinite, most likely cause first.
NON_FINITE_FIXES = ("Try weight_dtype bf16 instead of fp16 on the Z-Image Model Loader (fp16 overflows), "
                    "check the model file (download it again if it may be damaged), or lower cfg.")


def number(name, value, lo, hi, usual):
    """``value`` if it is a finite number from ``lo`` to ``hi``; else a one-line error naming the input."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name} is {value}: give a number from {lo} to {hi} ({usual}).")
    return value


def finite_latent(latent: torch.Tensor, problem: str):
    """Raise with ``problem`` and what to try when ``latent`` holds NaN or infinity."""
    if not bool(torch.isfinite(latent).all()):
        bad = int((~torch.isfinite(latent)).sum())
        raise RuntimeError(f"{problem} ({bad} of {latent.numel()} latent values are NaN or infinite). "
                           f"{NON_FINITE_FIXES}")

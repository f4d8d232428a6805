"""An image's size as Z-Image sees it, in one place: pixels and latents (the VAE downscales by 8,
the transformer patches 2x2 latents, so sides are multiples of 16), and the sizes the pack takes."""
from __future__ import annotations

from dataclasses import dataclass

MULTIPLE = 16
LATENT_SCALE = 8
MAX_SIDE = 4096  # the largest image side the pack's nodes and commands take


def is_side(value: int, max_side: int = MAX_SIDE) -> bool:
    return value % MULTIPLE == 0 and MULTIPLE <= value <= max_side


def nearest_side(value: int, max_side: int = MAX_SIDE) -> int:
    """The side to suggest for ``value``: the multiple of 16 below it, within the sizes taken."""
    return min(max(MULTIPLE, value // MULTIPLE * MULTIPLE), max_side)


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int
    batch: int = 1

    @classmethod
    def of_latent(cls, latent_shape) -> "ImageSize":
        """The images a latent of ``latent_shape`` ([batch, channels, (frames,) height, width]) decodes to."""
        return cls(latent_shape[-1] * LATENT_SCALE, latent_shape[-2] * LATENT_SCALE, latent_shape[0])

    def latent_shape(self, channels: int) -> list:
        return [self.batch, channels, self.height // LATENT_SCALE, self.width // LATENT_SCALE]

    def scaled(self, s: float) -> "ImageSize":
        """The same shape scaled by ``s``, sides rounded to multiples of 16."""
        side = lambda v: max(MULTIPLE, round(v * s / MULTIPLE) * MULTIPLE)
        return ImageSize(side(self.width), side(self.height), self.batch)

    def largest_fitting(self, fits) -> "ImageSize | None":
        """The largest size of this shape (sides multiples of 16, at most this one's) for which
        ``fits(size)``, or None where not even the smallest does."""
        lo, hi, best = 1, max(self.width, self.height) // MULTIPLE, None
        while lo <= hi:  # bisect on the longer side, in steps of 16
            k = (lo + hi) // 2
            size = self.scaled(MULTIPLE * k / max(self.width, self.height))
            if fits(size):
                best, lo = size, k + 1
            else:
                hi = k - 1
        return best

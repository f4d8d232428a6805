"""Every streamed layer's weights checked for NaN and infinity the first time they run: an observer
of a ``LayerStreamer`` (``LayerStreamer.observe``), on the device, read back once at the end of the
forward that ran them."""
from __future__ import annotations

import torch

from .errors import NonFiniteWeights


def all_finite(t) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device: no NaN or infinity in ``t`` (fp8 e4m3fn has NaN only).
    One ``aminmax`` pass, which propagates NaN (an infinity is the minimum or the maximum): on a
    CPU 17 times faster than ``isfinite(t).all()``, which took seconds a model."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if not t.numel():
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


class FiniteChecks:
    def __init__(self, n_layers: int):
        self._unchecked = set(range(n_layers))
        self._pending = []  # (layer, {name: 0-d bool on the device}) of this forward

    def recheck(self, i):
        """Layer i's weights changed: check them again when they next run."""
        self._unchecked.add(i)

    def layer_ready(self, i, views):
        """Layer i's own values (before any patch: a patch checks its results itself) are on the device."""
        if i in self._unchecked:
            named = views._asdict() if isinstance(views, tuple) else views
            self._pending.append((i, {name: all_finite(v) for name, v in named.items()}))

    def forward_done(self):
        """Read the checks this forward queued (one wait for the device, once per layer ever)."""
        if not self._pending:
            return
        checks, self._pending = self._pending, []
        flags = torch.stack([f for _, named in checks for f in named.values()]).cpu().tolist()
        for layer, named in checks:
            for name in named:
                if not flags.pop(0):
                    raise NonFiniteWeights(layer, name)
            self._unchecked.discard(layer)

    def forward_stopped(self):
        self._pending.clear()

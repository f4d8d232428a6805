"""What a loaded transformer says about its split: the one-line status (once per change of split or
image size, to a node or the log), and once-per-plan advice (layers read from the file for want of
RAM; compression asked for and not used)."""
from __future__ import annotations

import contextlib
import logging

import torch

from . import compression, host_memory
from .device_memory import GiB
from .plans import Plan, split_line

log = logging.getLogger("zimage")


class SplitStatus:
    def __init__(self, cfg, streamer, settings):
        """For the transformer of ``cfg`` whose layers ``streamer`` holds, loaded with ``settings``."""
        self.cfg, self.streamer, self.settings = cfg, streamer, settings
        self.device = streamer.device
        self._to = None                # callback(str) for the one-line status, within ``to``
        self._last = None
        self._warned = None            # (file layers, streamed layers) last warned about
        self._said_uncompressed = False  # ZIMAGE_COMPRESSION=on left unused here: said once

    def announce(self, plan: Plan | None):
        """The one-line status of the split now and ``plan``'s image size, once per change: to the
        callback when one is set (a node shows it, in the console too), else to the log."""
        n, r = self.cfg.n_blocks, self.streamer.n_resident
        size = ""
        if plan:
            size = f" ({plan.width}x{plan.height}{'' if plan.batch == 1 else f', batch {plan.batch}'})"
        if self.device.type == "cpu":
            msg = (f"Z-Image: on the CPU, all {n} layers in host memory{size}" if r == n else
                   f"Z-Image: on the CPU, {r} of {n} layers kept, {n - r} streamed from host memory{size}")
        else:
            b = self.streamer.masters.blocks_on_device
            sources = plan.sources() if plan and (plan.resident_layers, plan.block_layers) == (r, b) else ""
            msg = split_line(r, b, n, sources) + size
        self.say(msg)

    def say(self, msg: str):
        """A status line, where it differs from the last one said: to the callback when one is set,
        else to the log."""
        if msg == self._last:
            return
        self._last = msg
        (self._to or log.info)(msg)

    @contextlib.contextmanager
    def to(self, callback):
        """Within: the one-line status goes to ``callback`` instead of the log."""
        self._to = callback
        try:
            yield
        finally:
            self._to = None

    def planned(self, p: Plan):
        """Advice on a new plan, each once."""
        self._warn_host(p)
        self._say_if_uncompressed(p)

    def _say_if_uncompressed(self, p):
        """Once: ZIMAGE_COMPRESSION=on asked for compressed layers and this plan has none (where the
        GPU's decode cannot run, its check has said why already)."""
        if self.settings.compress != "on" or p.compressed or self._said_uncompressed or not p.fits:
            return
        if not self.streamer.config.can_compress:
            why = (f"its layers are {str(self.streamer.layout.dtype).removeprefix('torch.')} here (compression "
                   "is for bf16 layers; an fp8 file streams as it is, the CPU computes in fp32)")
        elif self.device.type == "cuda" and not compression.decodes_on(self.device):
            return
        else:
            why = "every layer fits on the device: nothing streams"
        self._said_uncompressed = True
        log.info("Z-Image: ZIMAGE_COMPRESSION=on: not used, %s.", why)

    def _warn_host(self, p):
        """Once per plan that reads layers from the file for want of RAM: what would help."""
        key = (p.file_layers, p.streamed_layers)
        if not p.ram_short or key == self._warned:
            return
        self._warned = key
        fp8 = "" if self.streamer.layout.dtype == torch.float8_e4m3fn else "the fp8 checkpoint (half the bytes), "
        log.warning("Z-Image: the RAM holds %d of %d streamed layers pinned; %d are read from the file at every "
                    "step (slower; from the disk where the page cache cannot hold them). What would help: %s"
                    "more RAM, or closing other programs. ComfyUI keeps %.1f GiB of RAM free.",
                    p.pinned_layers, p.streamed_layers, p.file_layers, fp8, host_memory.BUDGET.headroom / GiB)

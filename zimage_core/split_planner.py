"""The plans of one loaded transformer: its settings as the planner's limits, the host room its
masters have, and the device's balance of compute and bus, measured once per image size."""
from __future__ import annotations

from . import compression, planner, plans
from .calibration import Calibration
from .dit import cpu_chunks
from .settings import Settings
from .streamer import LayerStreamer


class SplitPlanner:
    def __init__(self, cfg, dtype, streamer: LayerStreamer, settings: Settings):
        self.cfg, self.dtype, self.streamer, self.settings = cfg, dtype, streamer, settings
        self.device = streamer.device
        self.calibration = Calibration(cfg, dtype, streamer)

    def limits(self, resident: int | None = None) -> plans.Limits:
        """The limits of the next plan: the settings, and the host room the masters have."""
        return plans.Limits(max_resident=self.settings.max_resident, resident=resident,
                              leave_free=self.settings.leave_free, host_room=self.host_room())

    def host_room(self) -> int | None:
        """Host bytes the streamed layers' masters may take: those they hold, and what the budget
        leaves after the staging buffers every upload from the file needs. None on the CPU."""
        s = self.streamer
        if not s.cuda:
            return None
        m = s.masters
        return m.master_layers * m.master_bytes + max(0, s.pool.room() - m.staging_due())

    def plan(self, width, height, batch, free: int, text_tokens: int, resident: int | None, make_room) -> plans.Plan:
        """The plan for an image of this size with ``free`` bytes of device memory (the CPU: of RAM);
        ``resident``: a forced split. ``make_room()`` evicts a resident layer (False once none is
        left), for the measurement on a card the current split fills."""
        limits = self.limits(resident)
        mode = self.settings.compress if self.streamer.config.can_compress else "off"
        if self.device.type == "cpu":
            c = cpu_chunks(self.cfg, width, height, batch)
            # max_resident_layers holds on the CPU too: the others stream from their host masters
            return planner.plan_host(self.cfg, free, width, height, batch, limits, dtype=self.dtype,
                                     chunk_rows=c.rows, chunk_queries=c.queries, compress=mode, text_tokens=text_tokens)
        stored = self.streamer.masters.master_bytes if self.streamer.config.quantized else None
        sizes = dict(storage=self.streamer.layout.dtype, dtype=self.dtype, text_tokens=text_tokens, stored=stored)
        if mode != "on":  # a card that holds every layer: nothing to measure, nothing to compress
            whole = planner.plan(self.cfg, free, width, height, batch, limits, **sizes)
            if whole.fits and not whole.streamed_layers:
                return whole
        tokens = self.cfg.image_tokens(width, height) * batch
        ratio, file_copy, upload_s = self.calibration.ratios(tokens, make_room)
        limits = self.limits(resident)  # the measurement may have evicted layers and made their masters
        split = lambda **kw: planner.plan(self.cfg, free, width, height, batch, limits, compute_copy_ratio=ratio,
                                          file_copy=file_copy, upload_s=upload_s, **sizes, **kw)
        if mode == "auto" and ratio is not None and not split(compress="auto", decode=0.0).compressed:
            mode = "off"  # not even a decode that took no time would shorten a step: no check to wait for
        if mode != "off" and not (self.device.type == "cuda" and compression.decodes_on(self.device)):
            mode = "off"  # it says why, once
        if stored is not None:  # every streamed layer is dequantized where it lands
            return split(decode=self.calibration.dequantize_ratio(upload_s) if upload_s else 0.0)
        decode = self.calibration.decode_ratio(upload_s) if mode != "off" else 0.0
        return split(compress=mode, decode=decode)

"""A forward's layers run by several devices in turn: the runner of a transformer that spans
cards (``placement``). Each device's consecutive range of blocks is a ``LayerStreamer`` of its
own, over that device's slots, copy stream and upload thread, so every card uploads the layers it
runs over its own link, and they do so at once: a forward's start queues every card's first
uploads, and a card's last layers queue its first ones of the next forward, which then run while
the cards before it compute. The hidden states cross to the next card where its range begins;
each card runs the same kernels on the same buffers' layout as one card would, so the output is
the one-card output, bit for bit, on cards of one kind."""
from __future__ import annotations

from .devices import to_device
from .streamer import LayerStreamer


class LayerChain:
    def __init__(self, streamers: list, ranges: list):
        """``streamers[d]`` runs the blocks of ``ranges[d]`` (consecutive ranges, in order, covering
        every block; each streamer counts its blocks from 0)."""
        assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]] and ranges[0].start == 0
        assert [s.n_layers for s in streamers] == [len(r) for r in ranges]
        self.streamers: list[LayerStreamer] = list(streamers)
        self.ranges = list(ranges)
        self.n_layers = ranges[-1].stop

    @property
    def n_streamed(self) -> int:
        return sum(s.n_streamed for s in self.streamers)

    def prefetch_first(self):
        """Every card's first uploads, at once: the later cards' run while the first computes."""
        for s in self.streamers:
            s.prefetch_first()

    def run_layers(self, x, layer_fn, blocks=None, next_forward=False):
        """``LayerStreamer.run_layers`` over the chain: each part of ``blocks`` on the device that
        runs it, ``x`` crossing to it first (``layer_fn`` gets blocks by their index in the whole
        model, and the hidden states on the device that runs them)."""
        blocks = range(self.n_layers) if blocks is None else blocks
        for s, own in zip(self.streamers, self.ranges):
            part = range(max(blocks.start, own.start), min(blocks.stop, own.stop))
            if not part:
                continue
            x = s.run_layers(to_device(x, s.device), lambda i, y, big, a=own.start: layer_fn(i + a, y, big),
                             range(part.start - own.start, part.stop - own.start), next_forward)
        return x

    def release(self):
        for s in self.streamers:
            s.release()

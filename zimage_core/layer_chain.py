"""A transformer's layer store: its streamers, one (every block) or one per card of a transformer
that spans cards (``placement``), and the runner of a forward's layers by several devices in turn.
Patches and observers are told blocks by their index in the model; each card's streamer counts
its own from 0. Each device's consecutive range of blocks is a ``LayerStreamer`` of its
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
        self._observers, self._make_patch = [], None
        self.streamers, self.ranges = [], []
        self._closed_uploads = 0  # ``source_uploads`` of the streamers a recut stopped
        self.recut(streamers, ranges)

    def recut(self, streamers: list, ranges: list):
        """Run the layers on these streamers from now on (a transformer cut across its cards once
        it knows their memory): the old ones stop (their host pool is the new ones'), and the
        observers and the patches go to the new ones."""
        assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]] and ranges[0].start == 0
        assert [s.n_layers for s in streamers] == [len(r) for r in ranges]
        for s in self.streamers:
            if s not in streamers:
                s.close()
                self._closed_uploads += s.source_uploads
        self.streamers: list[LayerStreamer] = list(streamers)
        self.ranges = list(ranges)
        self.n_layers = ranges[-1].stop
        for s, own in zip(self.streamers, self.ranges):
            for observer in self._observers:
                s.observe(_shifted(observer, own.start))
        if self._make_patch is not None:
            self.set_patch(self._make_patch)

    @property
    def devices(self) -> list:
        return [s.device for s in self.streamers]

    @property
    def n_streamed(self) -> int:
        return sum(s.n_streamed for s in self.streamers)

    @property
    def n_resident(self) -> int:
        return sum(s.n_resident for s in self.streamers)

    @property
    def source_uploads(self) -> int:
        """``LayerStreamer.source_uploads`` of every streamer this chain has run."""
        return self._closed_uploads + sum(s.source_uploads for s in self.streamers)

    def device_bytes(self, device=None) -> int:
        """What the streamers hold on their devices (on ``device`` only, where given)."""
        return sum(s.device_bytes for s in self.streamers if device is None or s.device == device)

    def locate(self, i) -> tuple:
        """(the streamer that runs block i, the block's index there)."""
        for s, own in zip(self.streamers, self.ranges):
            if i in own:
                return s, i - own.start
        raise IndexError(i)

    def observe(self, observer):
        """``LayerStreamer.observe`` on every card, the observer told blocks by their index in the model."""
        self._observers.append(observer)
        for s, own in zip(self.streamers, self.ranges):
            s.observe(_shifted(observer, own.start))

    def set_patch(self, make):
        """``LayerStreamer.set_patch`` on every card: ``make(device, blocks)`` gives the patch of the
        blocks in range ``blocks`` (named by their index in the model, its tensors on ``device``),
        or None; ``make`` None takes the patches away. A later ``recut`` makes them again."""
        self._make_patch = make
        for s, own in zip(self.streamers, self.ranges):
            patch = None if make is None else make(s.device, own)
            s.set_patch(None if patch is None else _shifted(patch, own.start))

    def synchronize(self):
        for s in self.streamers:
            s.synchronize()

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


def _shifted(inner, by: int):
    return inner if by == 0 else _Shifted(inner, by)


class _Shifted:
    """A streamer's observer or patch that knows blocks by their index in the whole model: the
    streamer of a range counts its blocks from 0."""

    def __init__(self, inner, by: int):
        self.inner, self.by = inner, by

    @property
    def layers(self):
        return {i - self.by for i in self.inner.layers}

    def layer_ready(self, i, views):
        self.inner.layer_ready(i + self.by, views)

    def apply(self, i, views):
        self.inner.apply(i + self.by, views)

    def __getattr__(self, name):  # forward_done, forward_stopped, verify: the same for every block
        return getattr(self.inner, name)

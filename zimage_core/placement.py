"""Which device runs which layers when one transformer spans several GPUs: consecutive ranges of
the blocks in the order a forward runs them, one range per device, each planned as a stream of its
own (``planner``: resident layers spread through the range, the others uploaded over that device's
own link into that device's slots). A forward runs the ranges card by card, the activations
crossing once at each change of card; while one card computes, the others' copy engines fill
their slots, so two cards bring two links' worth of bus as well as two cards' memory.

The cut between ranges is chosen by the simulated step of the whole chain (``simulation.chain_step``)
where the balance of compute and bus was measured, else by the fewest streamed layers, spread
over the cards as evenly as their room allows. A placement is a value, as a plan is. Its ranges
stream plain layers (bf16, fp16, fp8): compressed masters and a GGUF's blocks kept on the device
are planned for one card."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import ZImageConfig
from .device_memory import GiB, activation_bytes
from .layout import PackLayout
from .planner import split_for, within
from .plans import TEXT_TOKENS, Limits, Plan
from .simulation import block_costs, chain_step, step_with_pinned


@dataclass(frozen=True)
class Placement:
    devices: tuple                 # the devices, in the order the forward runs them
    ranges: tuple                  # the blocks each runs (consecutive ranges covering every block)
    plans: tuple                   # each device's plan of its range (its layers counted from 0)
    step_s: float | None = None    # the chain's simulated step in seconds, where the balance was measured

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.plans)

    @property
    def resident_layers(self) -> int:
        return sum(p.resident_layers for p in self.plans)

    @property
    def streamed_layers(self) -> int:
        return sum(p.streamed_layers for p in self.plans)

    def summary(self) -> str:
        for device, blocks, p in zip(self.devices, self.ranges, self.plans):
            if not p.fits:
                return (f"Z-Image: {device} is too small for its share of the layers ({_span(blocks)}): it needs "
                        f"at least {p.needed_bytes / GiB:.2f} GiB of GPU memory and has {p.free_bytes / GiB:.2f} "
                        f"GiB free. Free GPU memory on {device}, or leave it out of the loader's devices.")
        parts = [f"{device} {_span(blocks)}: {p.resident_layers} on the GPU, {p.streamed_layers} streamed{p.sources()}"
                 for device, blocks, p in zip(self.devices, self.ranges, self.plans)]
        return f"Z-Image: {self.resident_layers} of {sum(map(len, self.ranges))} layers on the GPUs: " \
               f"{'; '.join(parts)} ({self.plans[0].size_words})"


def _span(blocks: range) -> str:
    return f"layer {blocks.start}" if len(blocks) == 1 else f"layers {blocks.start}-{blocks.stop - 1}"


def handoff_copies(cfg: ZImageConfig, width, height, batch, text_tokens, storage, dtype) -> float:
    """One crossing of the activations between cards, in plain uploads of a layer: the hidden
    states of the caption and the image, through host memory (down one link, up the other) where
    the cards have no direct path; what a step pays at each change of card."""
    tokens = batch * (cfg.image_tokens(width, height) + text_tokens)
    return 2 * tokens * cfg.dim * dtype.itemsize / PackLayout(cfg, storage).nbytes


def place(cfg: ZImageConfig, devices: list, frees: list, width: int, height: int, batch: int = 1,
          limits: Limits = Limits(), storage=torch.bfloat16, dtype=torch.bfloat16,
          compute_copy_ratio: float | None = None, file_copy: float | None = None,
          text_tokens: int = TEXT_TOKENS, upload_s: float | None = None, ranges: tuple | None = None) -> Placement:
    """The layers of every device in ``devices`` (``frees[d]``: its free bytes) for an image of
    this size: ``planner.plan``'s arguments, the compute/copy balance assumed the same on every
    card (cards of one kind). Each card holds the fixed part (its ranges' norms and adaLN, the
    embedders) and a forward's activations beside its layers; ``limits.leave_free`` is left on
    each, ``limits.host_room`` goes to the masters of the layers that run first, and a
    ``max_resident`` or ``resident`` is shared out in proportion to the ranges. Starts from ranges
    in proportion to each card's room for layers and moves each cut by one layer while that
    shortens the step (or, unmeasured, streams fewer layers or spreads them more evenly). With
    ``ranges`` (a transformer cut already: its streamers and masters are per range) each card's
    plan of those ranges."""
    n = cfg.n_blocks
    act = activation_bytes(cfg, width, height, batch, text_tokens, dtype=dtype, storage=storage)
    rooms = [max(1, f - limits.leave_free - cfg.fixed_params() * dtype.itemsize - act) for f in frees]
    cuts, acc = [], 0
    for room in rooms[:-1]:
        acc += room
        cuts.append(max(1, min(n - 1, round(n * acc / sum(rooms)))))
    costs = None if compute_copy_ratio is None else \
        [c * compute_copy_ratio for c in block_costs(cfg, width, height, batch, text_tokens)]
    handoff = handoff_copies(cfg, width, height, batch, text_tokens, storage, dtype)

    def build(cuts) -> tuple:
        ranges = [range(a, b) for a, b in zip([0, *cuts], [*cuts, n])]
        plans, host_room = [], limits.host_room
        for device, free, blocks in zip(devices, frees, ranges):
            idle = 0.0 if costs is None else sum(costs) - sum(costs[blocks.start:blocks.stop])
            p, _ = split_for(cfg, free - limits.leave_free, width, height, batch, storage, dtype,
                             compute_copy_ratio, host_room, file_copy, text_tokens, upload_s, blocks=blocks, idle=idle)
            p = within(replace(p, step_s=None), _share(limits, host_room, len(blocks), n))
            plans.append(p)
            if host_room is not None:
                host_room = max(0, host_room - p.pinned_host_bytes)
        step = None
        if costs is not None and all(p.fits for p in plans):
            step = chain_step([_segment_step(p, costs[b.start:b.stop], file_copy) for p, b in zip(plans, ranges)],
                              0.25 * compute_copy_ratio, handoff)
        return Placement(tuple(devices), tuple(ranges), tuple(plans),
                         None if step is None or not upload_s else step * upload_s), step

    def score(built):
        placement, step = built
        streamed = [p.streamed_layers for p in placement.plans]
        return (not placement.fits, step if step is not None else 0.0, sum(streamed), max(streamed))

    if ranges is not None:
        cuts = [r.stop for r in ranges[:-1]]
    best = build(cuts)
    improved = len(devices) > 1 and ranges is None
    while improved:
        improved = False
        for d in range(len(cuts)):
            for move in (-1, 1):
                moved = cuts[:d] + [cuts[d] + move] + cuts[d + 1:]
                if not all(a < b for a, b in zip([0, *moved], [*moved, n])):
                    continue
                candidate = build(moved)
                if score(candidate) < score(best):
                    best, cuts, improved = candidate, moved, True
    return best[0]


def _share(limits: Limits, host_room, layers: int, n: int) -> Limits:
    """A range's limits: the host room left to it, its share of a resident count."""
    share = lambda count: None if count is None else round(count * layers / n)
    return Limits(max_resident=share(limits.max_resident), resident=share(limits.resident), host_room=host_room)


def _segment_step(p: Plan, costs: list, file_copy):
    """``chain_step``'s step of one range: its plan simulated with ``idle`` beside its layers."""
    n = p.resident_layers + p.streamed_layers
    return lambda idle: step_with_pinned(n, p.resident_layers, p.slots, costs, idle, p.pinned_layers,
                                         file_copy or 1.0)

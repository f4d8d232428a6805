"""A transformer over several cards: which card runs which layers (``placement``, no GPU needed),
and the chain of streamers that runs them (``LayerChain``), on the CPU bit-identical to one
streamer at every cut and split, through an interrupt."""
import pytest
import torch

from conftest import TINY, chain_of, inputs
from zimage_core.config import FULL
from zimage_core.errors import CheckpointError
from zimage_core.placement import place
from zimage_core.planner import plan
from zimage_core.plans import Limits
from zimage_core.simulation import chain_step, step_with_pinned
from zimage_core.transformer import ZImageTransformer

GiB = 1 << 30
TWO = ["cuda:0", "cuda:1"]
# a 1024x1024 layer's compute over its upload on an H200 at 7.5 GiB, a page-cache upload over a
# pinned one, a layer's upload in seconds
MEASURED = dict(compute_copy_ratio=0.57, file_copy=1.2, upload_s=0.0066)


def _gib(*cards):
    return [int(g * GiB) for g in cards]


def test_the_ranges_cover_every_block_in_order_and_each_card_fits_its_plan():
    for cards in ((7.5, 7.5), (5.5, 5.5), (11.5, 5.5), (5.5, 11.5), (3.5, 3.5)):
        for measured in ({}, MEASURED):
            p = place(FULL, TWO, _gib(*cards), 1024, 1024, **measured)
            assert p.fits, (cards, p.summary())
            assert [r.start for r in p.ranges] == [0, p.ranges[0].stop] and p.ranges[-1].stop == FULL.n_blocks
            for blocks, sub, free in zip(p.ranges, p.plans, _gib(*cards)):
                assert sub.resident_layers + sub.streamed_layers == len(blocks)
                assert sub.device_bytes <= free
                assert sub.slots >= (2 if sub.streamed_layers > 1 else sub.streamed_layers)


def test_two_cards_hold_what_one_card_of_both_their_memory_holds():
    """Two 7.5 GiB cards keep every layer on a GPU, where one keeps half; two 5.5 GiB cards keep
    twice one card's. The bigger card of two takes the longer range."""
    one = plan(FULL, int(7.5 * GiB), 1024, 1024)
    two = place(FULL, TWO, _gib(7.5, 7.5), 1024, 1024)
    assert one.streamed_layers > 10 and two.streamed_layers == 0
    small = place(FULL, TWO, _gib(5.5, 5.5), 1024, 1024)
    assert small.resident_layers >= 2 * plan(FULL, int(5.5 * GiB), 1024, 1024).resident_layers
    uneven = place(FULL, TWO, _gib(11.5, 5.5), 1024, 1024)
    assert len(uneven.ranges[0]) > len(uneven.ranges[1])
    assert len(place(FULL, TWO, _gib(5.5, 11.5), 1024, 1024).ranges[1]) > len(uneven.ranges[1])


def test_two_links_make_two_small_cards_faster_than_one_and_close_to_the_whole_gpu():
    """Simulated at an H200's measured balance: each card streams its own layers over its own link,
    and while one card computes the other's copy engine fills its slots."""
    one = plan(FULL, int(5.5 * GiB), 1024, 1024, **MEASURED)
    two = place(FULL, TWO, _gib(5.5, 5.5), 1024, 1024, **MEASURED)
    whole = plan(FULL, 139 * GiB, 1024, 1024, **MEASURED)
    assert two.streamed_layers > 0 and two.step_s < one.step_s / 1.15
    big = place(FULL, TWO, _gib(7.5, 7.5), 1024, 1024, **MEASURED)
    assert big.step_s <= 1.05 * whole.step_s


def test_one_card_is_the_one_card_plan():
    for g in (5.5, 7.5, 139):
        for measured in ({}, MEASURED):
            [p] = place(FULL, ["cuda:0"], _gib(g), 1024, 1024, **measured).plans
            one = plan(FULL, int(g * GiB), 1024, 1024, **measured)
            assert (p.resident_layers, p.slots, p.pinned) == (one.resident_layers, one.slots, one.pinned)


def test_the_chain_step_of_one_range_is_its_own_step():
    costs = [0.6] * 10
    step = lambda idle: step_with_pinned(10, 4, 2, costs, idle, 6, 1.0)
    assert chain_step([step], 0.2) == pytest.approx(step(0.2))
    # a second range's copies run while the first computes: the chain beats its ranges run alone
    alone = step(0.2) + step(0.2) - 0.2
    assert chain_step([step, step], 0.2) < alone


def test_host_room_goes_to_the_layers_that_run_first_and_limits_are_shared():
    layer = plan(FULL, int(5.5 * GiB), 1024, 1024).master_bytes
    p = place(FULL, TWO, _gib(5.5, 5.5), 1024, 1024, limits=Limits(host_room=3 * layer))
    assert [s.pinned_layers for s in p.plans] == [3, 0]
    capped = place(FULL, TWO, _gib(11.5, 11.5), 1024, 1024, limits=Limits(max_resident=10))
    assert capped.resident_layers == 10
    spare = place(FULL, TWO, _gib(7.5, 7.5), 1024, 1024, limits=Limits(leave_free=2 * GiB))
    assert spare.streamed_layers > 0 and all(s.device_bytes <= 5.5 * GiB for s in spare.plans)


def test_a_card_too_small_for_its_share_is_named():
    p = place(FULL, TWO, _gib(7.5, 0.5), 1024, 1024)
    assert not p.fits
    line = p.summary()
    assert "cuda:1 is too small" in line and "0.50 GiB free" in line and "devices" in line


def test_the_summary_says_what_each_card_runs():
    line = place(FULL, TWO, _gib(5.5, 5.5), 1024, 1024).summary()
    assert line.startswith("Z-Image: 22 of 34 layers on the GPUs: cuda:0 layers 0-16: 11 on the GPU, 6 streamed")
    assert "cuda:1 layers 17-33" in line and line.endswith("(1024x1024)")


@pytest.fixture(scope="module")
def one_card(tiny_file):
    m = ZImageTransformer.load(tiny_file, device="cpu", dtype="bf16")
    yield m
    m.release()


@pytest.mark.parametrize("cuts,splits", [([1], [(0, 1), (3, 2)]), ([2], [(1, 1), (0, 2)]),
                                          ([3], [(3, 0), (1, 2)]), ([1, 4], [(0, 1), (1, 2), (2, 0)])])
def test_a_chain_of_streamers_gives_the_one_card_output_bit_for_bit(one_card, cuts, splits):
    """Cut inside the refiners, between them and the main layers, inside the main layers, in three;
    every range with its own split: the output of one streamer with every layer resident."""
    m = one_card
    x, t, ctx = inputs(TINY, seed=3)
    m.prepare(64, 48, 1, resident_layers=TINY.n_blocks)
    ref = m(x, t, ctx)
    own = m.model.runner
    chain = chain_of(m, cuts, splits, ["cpu"] * (len(cuts) + 1))
    try:
        m.model.runner = chain
        for _ in range(2):  # a second forward runs from the uploads the first queued ahead
            assert torch.equal(m.model(x, t, ctx, transformer_options=_another_follows()), ref)
        m.model.runner = _Interrupted(chain, at=TINY.n_blocks - 1)
        with pytest.raises(KeyboardInterrupt):
            m.model(x, t, ctx)
        m.model.runner = chain
        assert torch.equal(m.model(x, t, ctx), ref)
    finally:
        m.model.runner = own
        chain.release()


def _another_follows():
    return {"sample_sigmas": torch.tensor([1.0, 0.5, 0.0]), "sigmas": torch.tensor([1.0])}


class _Interrupted:
    """A chain whose forward is stopped where block ``at`` begins (an interrupt mid-step)."""

    def __init__(self, chain, at):
        self.chain, self.at = chain, at
        self.n_streamed = chain.n_streamed
        self.prefetch_first = chain.prefetch_first

    def run_layers(self, x, layer_fn, blocks=None, next_forward=False):
        def stop(i, y, big):
            if i == self.at:
                raise KeyboardInterrupt
            return layer_fn(i, y, big)
        return self.chain.run_layers(x, stop, blocks, next_forward)


# -- a transformer loaded across devices (two CPU "cards": the same code paths, no GPU) -------------

def _across(tiny_file, resident=None, frees=(1 << 40, 1 << 40)):
    m = ZImageTransformer.load(tiny_file, device=["cpu", "cpu"], dtype="bf16")
    m.prepare(64, 48, resident_layers=resident, free_bytes=list(frees))
    return m


def test_a_transformer_across_two_devices_gives_the_one_device_output(one_card, tiny_file):
    """The first image cuts the layers across the devices, each card streaming part of its range;
    a later plan keeps the cut (its masters are per card) and the output stays one device's."""
    x, t, ctx = inputs(TINY, seed=5)
    one_card.prepare(64, 48, 1, resident_layers=TINY.n_blocks)
    ref = one_card(x, t, ctx)
    m = _across(tiny_file, resident=2)
    try:
        assert len(m.chain.streamers) == 2 and m.model.runner is m.chain
        cut = m.placement.ranges
        assert [(s.n_resident, s.n_streamed) for s in m.chain.streamers] == [(1, len(r) - 1) for r in cut]
        for _ in range(2):
            assert torch.equal(m(x, t, ctx, transformer_options=_another_follows()), ref)
        m.prepare(64, 48, free_bytes=[1 << 40, 1 << 40])
        assert m.placement.ranges == cut and m.chain.n_streamed == 0
        assert torch.equal(m(x, t, ctx), ref)
    finally:
        m.release()


def test_a_first_card_that_holds_every_layer_runs_them_alone(one_card, tiny_file):
    """Spanning cards only adds handoffs where the first card holds every layer: the others stay free."""
    x, t, ctx = inputs(TINY, seed=7)
    one_card.prepare(64, 48, 1, resident_layers=TINY.n_blocks)
    ref = one_card(x, t, ctx)
    m = _across(tiny_file)
    try:
        assert m.devices == (torch.device("cpu"),) and m.placement is None and m.model.runner is m.streamer
        assert m.streamer.n_resident == TINY.n_blocks and torch.equal(m(x, t, ctx), ref)
    finally:
        m.release()


def test_patches_and_checks_reach_each_card_by_the_blocks_index_in_the_model(one_card, tiny_file):
    """A patch is made per card for its range (its tensors there) and applied to the block it
    names; a NaN written into a block of the second card before the cut is carried by the cut
    and named with that block's own name."""
    x, t, ctx = inputs(TINY, seed=6)
    last = TINY.block_names()[-1]

    class AddOne:  # a weight patch: qkv of block ``i`` plus one
        def __init__(self, blocks):
            self.layers = {TINY.n_blocks - 1} & set(blocks)

        def apply(self, i, views):
            assert i == TINY.n_blocks - 1
            views.qkv.add_(1.0)

        def verify(self):
            pass

    made = []

    def make(device, blocks):
        made.append((device, blocks))
        return AddOne(blocks)
    one_card.prepare(64, 48, 1, resident_layers=TINY.n_blocks)
    one_card.weights.patch_layers(make)
    try:
        ref = one_card(x, t, ctx)
    finally:
        one_card.weights.patch_layers(None)
    assert made == [(torch.device("cpu"), range(TINY.n_blocks))]
    m = ZImageTransformer.load(tiny_file, device=["cpu", "cpu"], dtype="bf16")
    try:
        m.weights.patch_layers(make)
        key = f"{last}.attention.qkv.weight"
        good = m.weights.base(key)
        m.weights.set(key, torch.full_like(good, float("nan")))
        with pytest.raises(CheckpointError, match=f"{last}.attention.qkv.weight"):
            m.prepare(64, 48, resident_layers=2, free_bytes=[1 << 40, 1 << 40])
            m(x, t, ctx)
        assert made[1:] == [(torch.device("cpu"), range(TINY.n_blocks)),
                            *((torch.device("cpu"), r) for r in m.placement.ranges)]
        m.weights.set(key, good)
        assert torch.equal(m(x, t, ctx), ref)
    finally:
        m.release()


def test_devices_that_are_not_there_or_cannot_span_are_named(tiny_file, tmp_path):
    from tools.gguf_weights import write_gguf
    from zimage_core.errors import ZImageError
    count = torch.cuda.device_count()
    with pytest.raises(ZImageError, match=f"cuda:{count} is not there: this machine has {count} CUDA device"):
        ZImageTransformer.load(tiny_file, device=[*(f"cuda:{i}" for i in range(count)), f"cuda:{count}"])
    with pytest.raises(ZImageError, match="cards of one kind"):
        ZImageTransformer.load(tiny_file, device=["cpu", "cuda:0"])
    gguf = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_file, gguf, "Q8_0")
    with pytest.raises(ZImageError, match="a GGUF file runs on one card"):
        ZImageTransformer.load(gguf, device=["cpu", "cpu"])

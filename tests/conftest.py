import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from zimage_core.config import ZImageConfig  # noqa: E402
from tools.random_weights import write_checkpoint  # noqa: E402
# the ComfyUI server fixtures, here so that all test modules share one server per session
from comfy_server import comfy_base_dir, comfy_server  # noqa: E402,F401

# Small enough for a CPU, the real structure otherwise (head_dim 128, axes 32/48/48, t_dim 256).
TINY = ZImageConfig(dim=256, n_layers=4, n_refiner_layers=1, n_heads=2, ffn_dim=768, cap_feat_dim=64,
                    t_hidden=256)


@pytest.fixture(scope="session")
def tiny_cfg():
    return TINY


@pytest.fixture(scope="session")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weights") / "tiny.safetensors")
    write_checkpoint(path, TINY, dtype=torch.float32, seed=1)
    return path


def inputs(cfg, width=64, height=48, cap=7, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, height // 8, width // 8, generator=g)
    ctx = torch.randn(batch, cap, cfg.cap_feat_dim, generator=g)
    t = torch.full((batch,), 0.7)
    return x, t, ctx


def chain_of(m, cuts, splits, devices):
    """The layers of transformer ``m`` as a ``LayerChain`` cut at ``cuts``: each range streamed on
    its device of ``devices`` with its (resident, slots) of ``splits``, from ``m``'s file."""
    from zimage_core.host_memory import HostPool
    from zimage_core.layer_chain import LayerChain
    from zimage_core.layout import PackLayout, StreamConfig
    from zimage_core.streamer import LayerStreamer
    from zimage_core.transformer import layer_pieces

    cfg = m.cfg
    ranges = [range(a, b) for a, b in zip([0, *cuts], [*cuts, cfg.n_blocks])]
    names = cfg.block_names()
    streamers = []
    for blocks, (r, k), device in zip(ranges, splits, devices):
        s = LayerStreamer(StreamConfig(PackLayout(cfg, m.storage_dtype), device),
                          [layer_pieces(m.ckpt, f"{names[i]}.") for i in blocks], HostPool("transformer"))
        s.configure(r, k)
        streamers.append(s)
    return LayerChain(streamers, ranges)

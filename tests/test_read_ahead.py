"""The first image's reads begun as the model loads (``read_ahead``): on a real file, its layers are
in the page cache before any upload reads them; the reads follow the uploads' order, stay within
their room ahead of the uploads, skip what an upload reads first, and stop without an error when
a read fails or their owner goes."""
import gc
import os
import time

import pytest
import torch

from conftest import TINY, inputs
from tools.random_weights import write_checkpoint
from zimage_core import ram
from zimage_core.read_ahead import ReadAhead
from zimage_core.transformer import ZImageTransformer


def _until(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _layer_cached(masters, i) -> bool:
    """Every byte of layer i's tensors is in the page cache."""
    for parts in masters.sources[i].values():
        for _, st in parts:
            offset, nbytes = st.file._span(st.key)
            if not ram.in_page_cache(st.file._mapping().data_ptr() + offset, nbytes):
                return False
    return True


def _drop(path):
    """``path``'s pages leave the page cache (written out first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def cold_file(tmp_path):
    """A checkpoint whose pages are not in the page cache (written, flushed, dropped)."""
    path = str(tmp_path / "cold.safetensors")
    write_checkpoint(path, TINY, dtype=torch.float32, seed=3)
    _drop(path)
    from zimage_core.checkpoint import Checkpoint
    ckpt = Checkpoint(path)
    f = ckpt.files[0]
    offset, nbytes = max((f._span(k) for k in f.keys()), key=lambda span: span[1])  # far from the header read
    if ram.in_page_cache(f._mapping().data_ptr() + offset, nbytes):
        pytest.skip("this file system keeps a file's pages in memory (tmpfs): nothing to read ahead")
    ckpt.close()
    return path


def test_a_gguf_layer_is_read_into_the_page_cache_through_its_mapping(cold_file, tmp_path):
    """A GGUF's layers are views of the file's mapping: their reads fault them in (where the kernel
    can: ``MADV_POPULATE_READ``, Linux 5.14)."""
    pytest.importorskip("gguf")
    from tools.gguf_weights import write_gguf
    from zimage_core.checkpoint import Checkpoint
    from zimage_core.layout import PackLayout
    from zimage_core.transformer import layer_pieces
    path = str(write_gguf(cold_file, tmp_path / "cold.gguf"))
    ckpt = Checkpoint(path)
    _drop(path)  # after the open: its reads of the header read the small file's layers ahead too
    names = TINY.block_names()
    pieces = layer_pieces(ckpt, f"{names[len(names) // 2]}.")
    data = [p.tensor.data for parts in pieces.values() for _, p in parts]
    if any(ram.in_page_cache(d.data_ptr(), d.numel()) for d in data):
        pytest.skip("the layer's pages stayed in the page cache when dropped")
    ReadAhead([PackLayout(TINY, torch.float32).cache_parts(pieces)], [0], lambda: 1 << 40, ckpt)
    assert _until(lambda: all(ram.in_page_cache(d.data_ptr(), d.numel()) for d in data))
    ckpt.close()


def test_a_loaded_model_reads_its_layers_into_the_page_cache_before_any_upload(cold_file):
    m = ZImageTransformer.load(cold_file, device="cpu", dtype="fp32")
    masters, n = m.streamer.masters, TINY.n_blocks
    assert _until(lambda: all(_layer_cached(masters, i) for i in range(n))), \
        [i for i in range(n) if not _layer_cached(masters, i)]
    assert m.file_uploads == 0  # no upload has read a layer: the reads ahead brought them in
    x, t, ctx = inputs(TINY)
    m.prepare(64, 48, resident_layers=2)
    m(x, t, ctx)
    m.release()
    assert not masters._ahead.running


class _Owner:
    pass


def _recorded(sizes):
    """Synthetic layers of ``sizes`` bytes, two reads each, recording the layers read."""
    log = []
    parts = [[(n // 2, lambda _, i=i: log.append(i)), (n - n // 2, lambda _, i=i: log.append(i))]
             for i, n in enumerate(sizes)]
    return parts, log


def test_the_reads_follow_the_order_and_stay_within_their_room():
    parts, log = _recorded([10] * 5)
    owner = _Owner()
    ahead = ReadAhead(parts, [3, 1, 0, 2, 4], lambda: 25, owner)  # room for two layers
    assert _until(lambda: sorted(set(log)) == [1, 3])
    time.sleep(0.2)
    assert sorted(set(log)) == [1, 3] and log[:2] == [3, 3]  # the first in order first, no third layer
    ahead.reading(2)  # an upload reads layer 2 before the reads came to it: not read ahead any more
    ahead.reorder([4, 0])  # and the rest in a new order
    ahead.reading(3)  # the upload of a layer read ahead makes room for the next
    assert _until(lambda: 4 in log)
    time.sleep(0.2)
    assert 0 not in log
    ahead.reading(1)
    assert _until(lambda: not ahead.running)
    assert sorted(set(log)) == [0, 1, 3, 4] and log.count(4) == 2
    assert not ahead.reorder([2])  # over: a new order needs new reads (``HostMasters.read_ahead``)


def test_a_read_that_fails_stops_the_reads_without_an_error():
    log = []

    def fails(_):
        raise OSError(9, "Bad file descriptor")
    parts = [[(1, fails)], [(1, lambda _: log.append(1))]]
    owner = _Owner()
    ahead = ReadAhead(parts, [0, 1], lambda: 100, owner)
    assert _until(lambda: not ahead.running)
    assert log == []  # nothing after the failure


def test_the_reads_stop_when_their_owner_goes_or_they_are_stopped():
    parts, log = _recorded([10] * 3)
    owner = _Owner()
    ahead = ReadAhead(parts, [0, 1, 2], lambda: 0, owner)  # no room: they wait
    time.sleep(0.1)
    assert ahead.running and log == []
    del owner
    gc.collect()
    assert _until(lambda: not ahead.running, timeout=5)
    keep = _Owner()
    other = ReadAhead(parts, [0, 1, 2], lambda: 0, keep)
    other.stop()
    assert not other.running and log == []

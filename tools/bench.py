"""Step-time benchmark of the streamed transformer against its bound, in one process.

The bound of a step is max(compute of every layer, streamed bytes / pinned bandwidth). Both
terms are measured here under the same memory: compute by running the same steps with the
uploads skipped (the slots keep stale weights, so only the time is kept), bandwidth by timing
uploads alone.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import statistics
import subprocess
import sys
import time

import torch

from zimage_core import compression, host_memory
from zimage_core.settings import Settings
from zimage_core.transformer import ZImageTransformer

from .schedule import euler_sample


def _sync(dev):
    """Wait for the compute stream only, as a sampler reading its latents does: uploads queued
    for the next step keep running."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def _timed_steps(model, noise, ctx, steps):
    times = []
    last = [time.perf_counter()]

    def tick(i, x):
        _sync(model.device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    _sync(model.device)
    last[0] = time.perf_counter()
    out = euler_sample(model, noise, ctx, steps=steps, callback=tick)
    return out, times


def pinned_bandwidth(model, repeats=5) -> float | None:
    """Bytes per second of one packed layer upload from pinned memory, median of ``repeats``."""
    s = model.streamer
    host = next((h for h in reversed(s.masters.host) if h is not None), None)
    if host is None or model.device.type != "cuda":
        return None
    host = host.view(torch.uint8)  # a compressed master is shorter than the slot it decodes into
    dst = s.slots[0].view(torch.uint8)[:host.numel()] if s.slots else torch.empty_like(host, device=model.device)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s.copy_stream):
            a.record(s.copy_stream)
            dst.copy_(host, non_blocking=True)
            b.record(s.copy_stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return host.numel() / statistics.median(times)


_HOLDER = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
hold = torch.empty(max(0, int(free - float(sys.argv[1]) * 2**30)), dtype=torch.uint8, device="cuda")
print(f"{torch.cuda.mem_get_info()[0] / 2**30:.2f}", flush=True)
sys.stdin.read()
"""


_context_gib = []  # what this process's CUDA context took of the first simulated card's memory


@contextlib.contextmanager
def simulated_card(leave_gib):
    """Another process holds all GPU memory but ``leave_gib``, as a smaller card would show. This
    process's CUDA context, made after the first card is in place, takes its part of it, as a
    program started on such a card does; later cards leave that part less, so that every run in
    one process sees the same (``--compression both``'s second run saw 0.6 GiB more)."""
    if leave_gib is None:
        yield None
        return
    hold = leave_gib - (_context_gib[0] if _context_gib else 0.0)
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(hold)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        free = float(p.stdout.readline())
        if not _context_gib:
            _context_gib.append(max(0.0, leave_gib - torch.cuda.mem_get_info()[0] / 2**30))
        yield free
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def run(weights, width, height, steps=8, seed=0, splits=(None,), device=None, resident=False,
        cap_tokens=64, dtype="bf16", card_gib=None, compress="off", batch=1):
    """One result per split (None: planned); the model is loaded once. ``compress``: whether its
    masters are stored compressed (``Settings.compress``: off, on, auto). ``resident``: the first
    result is compared with every layer resident, run after the simulated card is gone (on the
    small card the planner would stream again what was asked to stay)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = None
    try:
        with simulated_card(card_gib):
            t0 = time.perf_counter()
            model = ZImageTransformer.load(weights, device=dev, dtype=dtype, settings=Settings(compress=compress))
            load_s = time.perf_counter() - t0
            results = [_run(model, dev, width, height, steps, seed, r, cap_tokens, batch) for r in splits]
        if resident:
            _compare_resident(model, dev, width, height, steps, seed, cap_tokens, batch, results[0])
    finally:
        if model is not None:
            model.release()
    for r in results:
        r["card_gib"] = card_gib
        r["compression"] = compress
    results[0]["load_s"] = load_s
    return results


@contextlib.contextmanager
def _upload_hook(streamer, hook):
    handle = streamer.register_upload_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _timed_upload(copies, stream, i, upload):
    if stream is None:  # on the CPU: counted, not timed
        copies.append((i, None))
        return upload()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    done_on = upload()
    end.record(stream)
    copies.append((i, (start, end)))
    return done_on


def _upload_bytes(s, i) -> int:
    """Bytes layer i's upload moves over the bus: its compressed chunks, or the packed layer."""
    codes = s.masters.codes[i]
    return sum(c.nbytes for c in codes) if codes else s.layout.nbytes


def _decode_time(s, dev) -> float | None:
    """Seconds the device takes to decode one compressed layer: its first run of chunks (one upload's
    worth, already on the device) timed and scaled to the layer. A whole layer's bytes and output
    beside a small card's plan would not fit."""
    m = s.masters
    i = next((i for i, c in enumerate(m.codes) if c), None)
    if i is None:
        return None
    run = compression.groups(m.codes[i])[0]  # from the layer's first weight on
    n = run[-1].start + run[-1].numel
    packed = m.host[i][:run[-1].offset + run[-1].nbytes].to(dev)
    out = torch.empty(n, dtype=s.layout.dtype, device=dev)
    return compression.decode_seconds(run, packed, out, repeats=4) * s.layout.numel / n


def _inputs(cfg, dev, width, height, seed, cap_tokens, batch):
    """The noise and the prompt's features every run of one seed starts from."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, cfg.in_channels, height // 8, width // 8, generator=g).to(dev)
    return noise, torch.randn(batch, cap_tokens, cfg.cap_feat_dim, generator=g).to(dev)


def _sha256(t) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _run(model, dev, width, height, steps, seed, resident_layers, cap_tokens, batch=1):
    noise, ctx = _inputs(model.cfg, dev, width, height, seed, cap_tokens, batch)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    plan = model.prepare(width, height, batch, resident_layers=resident_layers)
    s = model.streamer
    _sync(dev)
    prepare_s = time.perf_counter() - t0
    euler_sample(model, noise, ctx, steps=1)  # warm-up: kernels, allocator, first uploads, masters packed
    _sync(dev)
    first_forward_s = time.perf_counter() - t0
    pins = host_memory.pin_calls()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        held = torch.cuda.memory_allocated(dev)
        first_peaks = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    copies = []  # (layer, (start, end) events) of each upload into a slot
    with _upload_hook(s, functools.partial(_timed_upload, copies, s.copy_stream)):
        out, times = _timed_steps(model, noise, ctx, steps)
    s.synchronize()
    # the steps' own peaks, before the measurements below allocate buffers of their own
    if dev.type == "cuda":
        peak, peak_reserved = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
    copy_s = sum(e[0].elapsed_time(e[1]) for _, e in copies if e) / 1e3
    moved = sum(_upload_bytes(s, i) for i, _ in copies)
    streamed_bytes = moved / steps
    bw = pinned_bandwidth(model)
    with _upload_hook(s, lambda i, upload: None):  # compute alone, same memory, uploads skipped
        _, compute_times = _timed_steps(model, noise, ctx, steps)
    step = statistics.median(times[1:] or times)
    compute = statistics.median(compute_times[1:] or compute_times)
    # a compressed layer's decode runs on the device beside the step's compute, so it adds to it
    decode_s = _decode_time(s, dev) if dev.type == "cuda" else None
    work = compute + (decode_s or 0.0) * sum(bool(s.masters.codes[i]) for i, _ in copies) / steps
    bound = max(work, streamed_bytes / bw) if bw else work
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "width": width, "height": height, "batch": batch, "steps": steps,
        "resident_layers": s.n_resident, "streamed_layers": s.n_streamed, "slots": len(s.slots),
        # more than the split above where an out-of-memory error stepped it down during the run
        "planned_resident_layers": plan.resident_layers, "planned_slots": plan.slots,
        "planned_free_bytes": plan.free_bytes, "planned_activation_bytes": plan.activation_bytes,
        "prepare_s": prepare_s, "first_forward_s": first_forward_s, "pin_calls_in_steps": host_memory.pin_calls() - pins,
        "pinned_layers": s.masters.pinned_layers, "file_layers": s.n_streamed - s.masters.master_layers,
        "first_step_s": times[0], "median_step_s": step, "compute_step_s": compute,
        "streamed_bytes_per_step": streamed_bytes,
        "copy_bandwidth_Bps": (moved / copy_s) if copy_s else None,
        "compressed_layers": sum(c is not None for c in s.masters.codes), "encode_s": s.masters.encode_seconds,
        "pinned_bandwidth_Bps": bw, "bound_s": bound, "ratio_to_bound": step / bound,
        "output_sha256": _sha256(out),
    }
    if dev.type == "cuda":
        result["measured_activation_bytes"] = peak - held
        # the whole run's (first forward included) against the planner's floor for this size, which
        # assumes a 512-token prompt (--prompt-tokens 512 to compare) and every layer streamed
        result["peak_allocated_bytes"] = max(first_peaks[0], peak)
        result["peak_reserved_bytes"] = max(first_peaks[1], peak_reserved)
        result["floor_bytes"] = plan.needed_bytes
        result["decode_s_per_layer"] = decode_s
    return result


def _compare_resident(model, dev, width, height, steps, seed, cap_tokens, batch, result):
    """``result`` gains the same steps' time and output with every layer on the device."""
    noise, ctx = _inputs(model.cfg, dev, width, height, seed, cap_tokens, batch)
    model.prepare(width, height, batch, resident_layers=model.cfg.n_blocks)
    euler_sample(model, noise, ctx, steps=1)
    out, times = _timed_steps(model, noise, ctx, steps)
    result["resident_median_step_s"] = statistics.median(times[1:] or times)
    result["resident_output_sha256"] = _sha256(out)
    result["ratio_to_resident"] = result["median_step_s"] / result["resident_median_step_s"]


def dequantize_times(device, rows=10240, cols=3840, repeats=20) -> dict:
    """{GGML type: (wall ms, device ms)} of one rows x cols matrix of random blocks dequantized
    into bf16 by ``quants.dequantize_blocks``, as the decode stream does a kept or streamed matrix:
    the wall time is what the issuing thread spends (kernel launches included), the device time
    what the GPU does."""
    from zimage_core import quants
    from zimage_core.device_timing import device_seconds
    dev = torch.device(device)
    times = {}
    for name, q in quants.TYPES.items():
        blocks = torch.randint(0, 256, (rows * cols // q.elements, q.nbytes), dtype=torch.uint8, device=dev)
        out = torch.empty(blocks.shape[0], q.elements, dtype=torch.bfloat16, device=dev)
        run = functools.partial(quants.dequantize_blocks, blocks, name, out)
        run()
        _sync(dev)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        _sync(dev)
        wall = (time.perf_counter() - start) / repeats
        times[name] = (wall * 1e3, device_seconds(run) * 1e3 if dev.type == "cuda" else None)
    return times

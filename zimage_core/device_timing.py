"""Seconds of a CUDA device's work, without the CPU's time to queue it.

Timing events around work still being queued measure the queueing too: when another thread holds
the interpreter lock (a Triton compile beside the first image's plan), each launch waits for it,
the device idles in between, and a matmul timed that way can look several times slower than it
is: the planner then takes a bus-bound card for a compute-bound one, and does not compress. Here the work is queued behind a
spin of the device; a repeat whose spin ran out before everything was queued is not counted, and
the spin doubles (up to 32 times its start, 160 ms; past that a repeat is counted as it came).
A copy from pageable memory returns only once the device has done it, so it is never queued in
time: time it on the host's clock.
"""
from __future__ import annotations

import torch

_SPIN = 10_000_000  # clock cycles: about 5 ms on a recent GPU


def device_seconds(run, repeats: int = 3) -> float:
    """The shortest of ``repeats`` timings of what ``run()`` queues on the current CUDA stream
    (after one untimed run: first launches, allocations)."""
    run()
    spin, times, late = _SPIN, [], []
    for _ in range(repeats + 6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        start.record()
        run()
        end.record()
        reached = start.query()  # the device got to the start before the last launch was queued
        end.synchronize()
        (late if reached else times).append(start.elapsed_time(end) / 1e3)
        if reached:
            spin = min(2 * spin, 32 * _SPIN)
        elif len(times) == repeats:
            break
    return min(times or late)

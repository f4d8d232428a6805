"""Whether a kernel runs on a device: asked once per device, answered on a thread of its own when
asked early (a Triton compile takes a second or more, a few tenths from its cache on disk, and
then runs beside the prompt's encode instead of before the first step)."""
from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("zimage")


class DeviceCheck:
    """``check(device)`` says whether ``work(device)`` answered yes; ``work`` runs once per device
    (and says why not itself). A caller on any thread waits for an answer under way."""

    def __init__(self, work, thread_name: str):
        self._work, self._thread_name = work, thread_name
        self._answers = {}
        self._lock = threading.Lock()

    def __call__(self, device) -> bool:
        device = torch.device(device)
        with self._lock:
            if device not in self._answers:
                self._answers[device] = self._work(device)
            return self._answers[device]

    def soon(self, device):
        """Start the check of a CUDA device on a thread; nothing starts once the answer is known."""
        device = torch.device(device)
        if device.type == "cuda" and device not in self._answers:
            threading.Thread(target=self, args=(device,), name=self._thread_name, daemon=True).start()


def triton_check(check, what: str, instead: str, thread_name: str) -> DeviceCheck:
    """The ``DeviceCheck`` of Triton kernels: ``check(device)`` compiles and runs them and returns
    None where they give the right values, else why not; an exception (no Triton, no compiler, an
    unsupported GPU) means the same. Where they do not run, the console says so once: that ``what`` is
    off on that device and why, that ``instead`` runs, and what they need."""
    def work(device) -> bool:
        try:
            reason = check(device)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if reason:
            log.warning("Z-Image: %s: off on %s (%s); %s. It needs Triton (Linux: ships with torch; "
                        "Windows: pip install triton-windows).", what, device, reason.splitlines()[0][:200], instead)
        return reason is None
    return DeviceCheck(work, thread_name)

"""Whether a kernel runs on a device: asked once per device, answered on a thread of its own when
asked early (a Triton compile takes a second or more, a few tenths from its cache on disk, and
then runs beside the prompt's encode instead of before the first step)."""
from __future__ import annotations

import threading

import torch


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

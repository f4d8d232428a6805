"""What a transformer is loaded with: the dtypes it computes and stores in, and the settings it
is told once, at load (the loader node's inputs and the pack's environment)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STORAGE_DTYPES = dict(COMPUTE_DTYPES, fp8_e4m3fn=torch.float8_e4m3fn)


@dataclass(frozen=True)
class Settings:
    """What a loaded transformer is told once, at load (the loader node's inputs and the pack's
    environment), and reads when it plans: nothing is set on it afterwards."""
    max_resident: int | None = None   # the most layers kept on the device (None: as many as fit)
    leave_free: int = 0               # bytes of device memory the plan leaves to others
    pinned_cap: int | None = None     # host bytes this model may hold, beside the process-wide budget
    # bf16 masters stored compressed, fewer bytes in RAM and over the bus: "off", "on", or "auto"
    # (where the planner finds that it shortens the step: ``planner.plan``)
    compress: str = "off"

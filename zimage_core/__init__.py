"""Z-Image-Turbo transformer core: checkpoint reading, layer streaming, planning, host memory.
Imports only torch (and the standard library); ComfyUI is met in ``zimage_core.bridge``."""
from .checkpoint import Checkpoint
from .config import ZImageConfig
from .errors import CheckpointError, OutOfDeviceMemory, ZImageError
from .planner import plan
from .plans import Plan
from .transformer import ZImageTransformer

__all__ = ["Checkpoint", "ZImageConfig", "CheckpointError", "OutOfDeviceMemory", "ZImageError", "Plan", "plan",
           "ZImageTransformer"]

"""The pack's environment variables, read in one place: the ComfyUI nodes (said once at start-up,
and refused by each prompt's loader and encode), the host budget, ``python -m zimage_core plan`` and the core
benchmark read the same values the same way, and refuse the same bad ones.

- ``ZIMAGE_PINNED_GIB``: the host bytes this process may hold in copies of weights, in all
  (pinned masters, staging); unset: planned from the RAM that is available.
- ``ZIMAGE_COMPRESSION``: ``auto`` (the default: where the planner finds that it shortens the
  step), ``on`` or ``off``: the streamed bf16 layers' masters stored compressed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import SettingError

GiB = 1 << 30
PINNED = "ZIMAGE_PINNED_GIB"
COMPRESSION = "ZIMAGE_COMPRESSION"
COMPRESSION_MODES = ("off", "on", "auto")


def pinned_cap() -> int | None:
    """ZIMAGE_PINNED_GIB in bytes, or None where it is unset."""
    text = os.environ.get(PINNED, "").strip()
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib >= 0):
        raise SettingError(f"{PINNED} is {text!r}: set it to a number of GiB >= 0 (e.g. 4 or 10.5; "
                           "0 pins nothing), or unset it to let the pack plan host memory from the RAM "
                           "that is available.")
    return int(gib * GiB)


def compression() -> str:
    """ZIMAGE_COMPRESSION: off, on or auto (the default)."""
    text = os.environ.get(COMPRESSION, "").strip().lower() or "auto"
    if text in COMPRESSION_MODES:
        return text
    raise SettingError(f"{COMPRESSION} is {text!r}: set it to auto (the default), on or off, or unset it.")


@dataclass(frozen=True)
class Environment:
    pinned_cap: int | None
    compression: str


def read() -> Environment:
    """Both settings; a SettingError names every one that is malformed."""
    values, problems = _read_all()
    if problems:
        raise SettingError(" ".join(problems))
    return Environment(*values)


def problems_now() -> list:
    """One message per malformed setting (empty when all are usable)."""
    return _read_all()[1]


def _read_all() -> tuple:
    """([pinned cap, compression], [messages of the malformed ones]): each variable parsed once."""
    values, problems = [], []
    for reader in (pinned_cap, compression):
        try:
            values.append(reader())
        except SettingError as e:
            problems.append(str(e))
    return values, problems

"""The pack's environment variables, read once per process, in one place: the ComfyUI nodes (said
once at start-up, and refused by each prompt's loader and encode), the host budget, ``python -m
zimage_core plan`` and the core benchmark read the same values, and refuse the same bad ones.

- ``ZIMAGE_PINNED_GIB``: the host bytes this process may hold in copies of weights, in all
  (pinned masters, staging); unset: planned from the RAM that is available.
- ``ZIMAGE_COMPRESSION``: ``auto`` (the default: where the planner finds that it shortens the
  step), ``on`` or ``off``: the streamed bf16 layers' masters stored compressed.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from .errors import SettingError

GiB = 1 << 30
PINNED = "ZIMAGE_PINNED_GIB"
COMPRESSION = "ZIMAGE_COMPRESSION"
COMPRESSION_MODES = ("off", "on", "auto")


def parse_pinned_gib(text: str) -> int | None:
    """ZIMAGE_PINNED_GIB's text in bytes, or None where it is empty."""
    text = text.strip()
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


def parse_compression(text: str) -> str:
    """ZIMAGE_COMPRESSION's text: off, on or auto (the default, where it is empty)."""
    text = text.strip().lower() or "auto"
    if text in COMPRESSION_MODES:
        return text
    raise SettingError(f"{COMPRESSION} is {text!r}: set it to auto (the default), on or off, or unset it.")


@dataclass(frozen=True)
class Environment:
    pinned_cap: int | None
    compression: str


@functools.cache
def _reading() -> tuple:
    """(the values, one message per malformed one): the variables parsed once, the first time asked."""
    values, problems = [], []
    for name, parse, fallback in ((PINNED, parse_pinned_gib, None), (COMPRESSION, parse_compression, "auto")):
        try:
            values.append(parse(os.environ.get(name, "")))
        except SettingError as e:
            values.append(fallback)
            problems.append(str(e))
    return Environment(*values), problems


def read() -> Environment:
    """Both settings; a SettingError names every one that is malformed."""
    env, problems = _reading()
    if problems:
        raise SettingError(" ".join(problems))
    return env


def problems_now() -> list:
    """One message per malformed setting (empty when all are usable)."""
    return _reading()[1]


def pinned_cap() -> int | None:
    """The cap, for the host budget; None where it is unset (or malformed: ``read`` refuses that)."""
    return _reading()[0].pinned_cap

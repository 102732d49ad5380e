"""Where a fastloader warning points: the first frame outside some packages.

warnings.warn's stacklevel counts frames up from its caller; fastloader's call
chains differ in depth from one path to another, so each warning site computes
it, here, instead of hard-coding a number that breaks when a helper moves.
"""
from __future__ import annotations

import os
import sys


def stacklevel_outside(*packages: str) -> int:
    """The stacklevel, for a warnings.warn() made by the caller of this function,
    of the first frame whose file is in none of `packages` (top-level package
    names; one that is not imported is ignored)."""
    skip = tuple(os.path.dirname(m.__file__) + os.sep
                 for m in map(sys.modules.get, packages)
                 if m is not None and getattr(m, "__file__", None))
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level

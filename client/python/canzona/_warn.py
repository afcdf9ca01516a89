"""RuntimeWarnings attributed to the training loop's line.

torch wraps an optimizer's step() (its profiling hook, no_grad) in frames
whose number changes between versions; a fixed ``stacklevel`` would name a
line inside torch. This walks out of canzona and torch instead."""

import os
import sys
import warnings

import torch

_INSIDE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                for m in (sys.modules["canzona"], torch))


def warn(message):
    """warnings.warn(message, RuntimeWarning) at the first frame outside
    canzona and torch."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(
            frame.f_code.co_filename).startswith(_INSIDE):
        level += 1
        frame = frame.f_back
    warnings.warn(message, RuntimeWarning, stacklevel=level)

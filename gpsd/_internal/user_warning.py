"""Warnings that point at the user's line: every warning gpsd issues goes through :func:`warn`."""

from __future__ import annotations

import os
import sys
import warnings

import gpytorch
import linear_operator
import torch

__all__ = ["warn"]


def _package_directory(init_file: str) -> str:
    return os.path.dirname(os.path.abspath(init_file)) + os.sep


#: Where the frames that are not the user's live: gpsd, and the libraries that call into it
#: (``model(x)`` reaches gpsd through ``torch.nn.Module.__call__``, a GPyTorch model through
#: GPyTorch and linear_operator).
_LIBRARY_DIRECTORIES = (
    _package_directory(os.path.dirname(os.path.abspath(__file__))),  # gpsd/
    *(_package_directory(module.__file__) for module in (torch, gpytorch, linear_operator)),
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame of the call stack
    outside gpsd and the libraries it calls through (torch, GPyTorch, linear_operator): the
    user's line, however deep in gpsd the warning is found, so that its file and line name the
    call that caused it, and ``warnings`` filters by module match the user's module."""
    frame = sys._getframe(1)  # the caller of warn: stacklevel 2
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _LIBRARY_DIRECTORIES
    ):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)

"""Progress bars on stderr (tqdm) for the slow steps of start-up: loading weights, compiling kernels.

    for spec in progress(specs, "loading weights", unit="tensor"):
        ...

A bar is drawn only when stderr is a terminal (never into a pipe, a file or a test's captured
output) and ``VEGAFUSE_PROGRESS`` is not ``0``; otherwise :func:`progress` returns the iterable
itself.  A step shorter than ``delay`` seconds shows nothing.
"""
from __future__ import annotations

import os
import sys


def shown() -> bool:
    """Are progress bars drawn: stderr is a terminal and ``VEGAFUSE_PROGRESS`` is not ``0``."""
    if os.environ.get("VEGAFUSE_PROGRESS", "1") == "0":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):             # replaced by an object without isatty, or closed
        return False


def progress(iterable, desc: str, total: int | None = None, unit: str = "it", delay: float = 0.3):
    """``iterable`` wrapped in a tqdm bar labelled ``desc`` on stderr when :func:`shown`, else
    ``iterable`` unchanged.  ``total``: its length where ``len`` cannot tell."""
    if not shown():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, delay=delay, leave=False, file=sys.stderr,
                dynamic_ncols=True)

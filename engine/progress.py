"""Progress bars on stderr (tqdm) for the slow steps of start-up: loading weights, compiling kernels.

    for spec in progress(specs, "loading weights", unit="tensor"):
        ...

A bar is drawn only when stderr is a terminal (never into a pipe, a file or a test's captured
output), ``VEGAFUSE_PROGRESS`` is not ``0`` and no generated text is streaming to the terminal
(:func:`streaming`); otherwise :func:`progress` returns the iterable itself.  A step shorter than
``delay`` seconds shows nothing.
"""
from __future__ import annotations

import contextlib
import sys

from codegen.env import switch


_STREAMING = []        # text is being written to stdout (``streaming``)


def _tty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):             # replaced by an object without isatty, or closed
        return False


def shown() -> bool:
    """Are progress bars drawn: stderr is a terminal, ``VEGAFUSE_PROGRESS`` is not ``0``, and no text
    is being streamed to stdout on a terminal (``streaming``: a bar would draw over its line)."""
    if not switch("VEGAFUSE_PROGRESS", True):
        return False
    return _tty(sys.stderr) and not (_STREAMING and _tty(sys.stdout))


@contextlib.contextmanager
def streaming():
    """While generated text goes to stdout a piece at a time (``engine.generate``: the decode step
    compiles after the first token is shown), draw no bar: on a terminal it shares the text's line."""
    _STREAMING.append(True)
    try:
        yield
    finally:
        _STREAMING.pop()


def progress(iterable, desc: str, total: int | None = None, unit: str = "it", delay: float = 0.3):
    """``iterable`` wrapped in a tqdm bar labelled ``desc`` on stderr when :func:`shown`, else
    ``iterable`` unchanged.  ``total``: its length where ``len`` cannot tell."""
    if not shown():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, delay=delay, leave=False, file=sys.stderr,
                dynamic_ncols=True)

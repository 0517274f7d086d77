"""The ``VEGAFUSE_*`` switches of the environment, each read where it acts and checked there: on/off
(:func:`switch`), a whole number (:func:`env_int`) or one of a few words (:func:`env_choice`).  A value
that is none of these is a ValueError of one line naming the switch and what to set it to, which the
command-line tools print as ``error: ...``; unset or empty, a switch takes its default."""
from __future__ import annotations

import os
import re


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def switch(name: str, default: bool, what: str = "") -> bool:
    """Is the on/off switch ``name`` on: ``1`` or ``0`` in the environment, else ``default``.
    ValueError naming it (and ``what`` 1 turns on) for any other value."""
    v = _raw(name)
    if not v:
        return default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: set it to 1{f' ({what})' if what else ''} or 0, or unset it "
                         f"(default {int(default)})")
    return v == "1"


def env_int(name: str, default: int, least: int | None = None, what: str = "", most: int | None = None) -> int:
    """The whole number (ASCII digits, a leading minus) the switch ``name`` sets, else ``default``;
    ValueError naming the switch when it is not one or is outside ``least`` .. ``most`` (the message
    says ``what`` to set it to, where given)."""
    v = _raw(name)
    if not v:
        return default
    n = int(v) if re.fullmatch(r"-?[0-9]+", v) else None
    if n is not None and (least is None or n >= least) and (most is None or n <= most):
        return n
    if what:
        raise ValueError(f"{name}={v!r}: set it to {what}, or unset it (default {default})")
    if n is None:
        raise ValueError(f"{name}={v!r} is not a whole number; set it to one (e.g. {name}={default}) or unset it")
    bounds = " to ".join(str(b) for b in (least, most) if b is not None)
    raise ValueError(f"{name}={v!r}: set it to {'at least ' if most is None else ''}{bounds}, or unset it "
                     f"(default {default})")


def env_choice(name: str, choices: tuple, default: str) -> str:
    """The word the switch ``name`` sets, one of ``choices``, else ``default``; ValueError naming the
    switch and the choices for any other value."""
    v = _raw(name)
    if not v:
        return default
    if v not in choices:
        raise ValueError(f"{name}={v!r}: set it to one of {', '.join(choices)}, or unset it (default {default})")
    return v

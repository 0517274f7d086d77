"""A/B/A measurement of one switch: ``python -m engine.bench --ab SWITCH [bench options]``.

SWITCH is a fusion rule (``epilogue``: B runs with it off, through ``VEGAFUSE_FUSION_OFF``) or a
codegen/engine switch ``VEGAFUSE_NAME=VALUE`` (B runs with it set, A with it unset: the default).
Each run is a fresh process (``engine.bench --decode-rates``), so no cache of this one carries
the other's code: A, then B, then A again, each timing ``--repeat`` greedy decodes of ``--tokens``
steps after a ``--cooldown`` pause.  A side's spread is the max minus the min of its repeats; when
the second A's median differs from the first's by more than the larger of their spreads, the
machine drifted during the run and the B/A ratio is flagged unreliable (the founding case studies'
rule: measure A/B/A, never A/B).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from .errors import ModelError

_ROOT = Path(__file__).resolve().parent.parent


def known_switches() -> set:
    """Every ``VEGAFUSE_*`` name the package's source reads (a name ending in ``_`` is a prefix)."""
    names = set()
    for pkg in ("dsl", "fusion", "codegen", "engine", "stdlib"):
        for f in (_ROOT / pkg).rglob("*.py"):
            names.update(re.findall(r"VEGAFUSE_[A-Z0-9_]+", f.read_text(errors="replace")))
    names.discard("VEGAFUSE_NAME")                # the placeholder of the help texts
    return names


def parse_switch(text: str) -> tuple[str, dict]:
    """(label, the environment B adds) for ``--ab``'s argument.

    Raises ModelError (one line naming the fix) for a name the package does not read, an
    environment switch without ``=VALUE``, or an unknown fusion rule."""
    from fusion.partition import RULES
    text = text.strip()
    if "=" in text:
        name, value = (s.strip() for s in text.split("=", 1))
        known = known_switches()
        if not name.startswith("VEGAFUSE_") or not (name in known or any(
                k.endswith("_") and name.startswith(k) for k in known)):
            near = sorted(k for k in known if not k.endswith("_"))
            raise ModelError(f"--ab {text}: {name} is not a switch vegafuse reads; give VEGAFUSE_NAME=VALUE "
                             f"with one of {', '.join(near)}, or a fusion rule ({', '.join(RULES)})")
        if name == "VEGAFUSE_FUSION_OFF":
            raise ModelError("--ab VEGAFUSE_FUSION_OFF=...: give the fusion rule's name instead, e.g. --ab epilogue")
        return text, {name: value}
    if text not in RULES:
        raise ModelError(f"--ab {text!r} is neither a fusion rule ({', '.join(RULES)}) nor a "
                         "switch VEGAFUSE_NAME=VALUE")
    off = [r for r in os.environ.get("VEGAFUSE_FUSION_OFF", "").split(",") if r.strip()]
    return f"fusion rule {text} off", {"VEGAFUSE_FUSION_OFF": ",".join(off + [text])}


def summarize(a1, b, a2) -> dict:
    """The A/B/A verdict from three lists of rates (tok/s, one per repeat).

    Returns {"A1"|"B"|"A2": {"median", "min", "max", "spread"}, "ratio": B's median over the mean
    of the A medians, "drift": |A2 - A1| / A1 of the medians, "noise": the larger A spread over the
    A1 median, "reliable": drift <= noise}."""
    sides = {}
    for name, rates in (("A1", a1), ("B", b), ("A2", a2)):
        if not rates:
            raise ValueError(f"side {name} has no rates")
        sides[name] = {"median": median(rates), "min": min(rates), "max": max(rates),
                       "spread": max(rates) - min(rates)}
    a_mid = (sides["A1"]["median"] + sides["A2"]["median"]) / 2
    drift = abs(sides["A2"]["median"] - sides["A1"]["median"]) / sides["A1"]["median"]
    noise = max(sides["A1"]["spread"], sides["A2"]["spread"]) / sides["A1"]["median"]
    return {**sides, "ratio": sides["B"]["median"] / a_mid, "drift": drift, "noise": noise,
            "reliable": drift <= noise}


def _child_argv(argv):
    """``argv`` without ``--ab X`` and ``--cooldown S`` (either spelled ``--opt=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--ab", "--cooldown"):
            skip = True
        elif not a.startswith(("--ab=", "--cooldown=")):
            out.append(a)
    return out


def _rates(argv, env) -> list:
    """Run ``engine.bench --decode-rates`` with ``argv`` in a fresh process under ``env``."""
    r = subprocess.run([sys.executable, "-m", "engine.bench", *argv, "--decode-rates"], cwd=str(_ROOT),
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise ModelError(f"an A/B/A run failed: {(r.stderr.strip().splitlines() or ['no message'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["rates"]


def main_ab(args, argv) -> int:
    """``--ab``: run A, B, A (each a fresh process timing ``--repeat`` decodes), print the three
    rows, B/A and the drift check; returns 0."""
    label, extra = parse_switch(args.ab)
    base, name = dict(os.environ), next(iter(extra))
    if name != "VEGAFUSE_FUSION_OFF":
        base.pop(name, None)                      # A: the switch's default
    child = _child_argv(argv)
    got = {}
    for i, (side, env) in enumerate((("A1", base), ("B", {**base, **extra}), ("A2", base))):
        if i and args.cooldown:
            time.sleep(args.cooldown)
        got[side] = _rates(child, env)
        print(f"  {side}: {' '.join(f'{r:.1f}' for r in got[side])} tok/s", file=sys.stderr, flush=True)
    s = summarize(got["A1"], got["B"], got["A2"])
    print(f"A/B/A of {label}: {args.backend}, {os.path.basename(str(args.model or 'the default model'))}, "
          f"tg{args.tokens}, {args.repeat} repeat{'' if args.repeat == 1 else 's'} a side, a fresh process each, "
          f"cool-down {args.cooldown:g} s")
    print("| run | setting | median t/s | min | max | spread |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for side in ("A1", "B", "A2"):
        r = s[side]
        print(f"| {side} | {label if side == 'B' else 'default'} | {r['median']:.2f} | {r['min']:.2f} | "
              f"{r['max']:.2f} | {r['spread']:.2f} |")
    verdict = (f"reliable: A drifted {100 * s['drift']:.1f}%, within the spread of repeats ({100 * s['noise']:.1f}%)"
               if s["reliable"] else
               f"UNRELIABLE: the second A differs from the first by {100 * s['drift']:.1f}%, more than the "
               f"spread of repeats ({100 * s['noise']:.1f}%); rerun with --cooldown or more --repeat")
    print(f"B / A = {s['ratio']:.3f}x (A: the mean of the two A medians); {verdict}")
    return 0


def decode_rates(args) -> int:
    """``--decode-rates`` (one side of an A/B/A): ``--repeat`` greedy decodes of ``--tokens`` steps
    after the prompt, on one model built once, after one untimed run (compiles, graph capture);
    prints {"rates": [tok/s, ...]} as the last line of stdout.  GPU: the device loop
    (``Model.decode_greedy``) from position 32 after a random 32-token prompt (or from ``--position``),
    random weights of a shape or a model file's weights; CPU: token by token with the argmax read
    back, as the CPU benchmark times it."""
    import numpy as np
    from .bench import SHAPES, random_params
    from .model import Model
    from .weights import default_dtype, load_model
    name = args.model or "smollm2-135m"
    if args.backend == "cuda" and (args.random_weights or name in SHAPES):
        from stdlib.config import LlamaConfig
        from .executable import get_device
        cfg = LlamaConfig(**SHAPES[name], max_seq_len=args.context, name=name)
        params = random_params(cfg, get_device("cuda"), args.dtype)
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 32).tolist()
    else:
        dtype = args.dtype or default_dtype(args.model, args.backend)
        cfg, params, tok = load_model(args.model, "native" if dtype in ("q4_0", "q4_1", "q8_0") else dtype, args.quant)
        ids = tok.encode(args.prompt)
    m = Model(cfg, params, backend=args.backend, context=max(args.context, len(ids) + args.tokens + 1),
              kv_dtype=args.kv_dtype)

    def once():
        m.reset()
        nxt = int(np.argmax(np.asarray(m.prefill(ids))))
        if args.position is not None:              # --position: attention reads that many cache positions
            m.pos = args.position
        t0 = time.perf_counter()
        if args.backend == "cuda":
            m.decode_greedy(nxt, args.tokens)
        else:
            for _ in range(args.tokens):
                nxt = int(np.argmax(np.asarray(m.decode(nxt))))
        return args.tokens / (time.perf_counter() - t0)
    once()
    print(json.dumps({"rates": [once() for _ in range(args.repeat)]}))
    return 0

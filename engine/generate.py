"""Generate text: python -m engine.generate [PROMPT] [options], also installed as vegafuse-generate.

Text streams to stdout, statistics go to stderr.  --json prints one object instead: prompt_ids,
ids (generated), text, finish_reason, decode_tokens_per_s, prefill_s.  Bad input (missing or
corrupt model, empty or too long prompt, a bad option) prints one line "error: ..." and exits
with status 2.

:func:`stream` is the generation loop (the chat and the server use it); :func:`generate` wraps it.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import NamedTuple

import numpy as np

from .errors import ModelError, Parser, run_cli
from .progress import streaming
from .sampling import is_eos, sample, settings_error
from codegen.env import switch


class Finished(NamedTuple):
    """The last item :func:`stream` yields.

    ids: the generated ids (list of int; no EOS id; with stop strings, up to the id that completed
        one). finish_reason: "stop" (an EOS id or a stop string) or "length" (max_tokens).
    text: everything yielded before it, joined. stats: {prefill_s, decode_s, decode_tokens_per_s}."""
    ids: list
    finish_reason: str
    text: str
    stats: dict


def _find_stop(text: str, stop) -> int:
    """Where the first of the ``stop`` strings that occur in ``text`` begins (-1: none)."""
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)


def _held(text: str, stop) -> int:
    """How many characters at the end of ``text`` could begin one of the ``stop`` strings."""
    return max((n for s in stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:n])), default=0)


def _on_device(model, repeat_penalty) -> bool:
    """Whether decode steps draw their ids on the device (``Model.decode_ids``): on GPU backends,
    without a repeat penalty (it needs the ids' history), unless ``VEGAFUSE_DEVICE_SAMPLING=0`` or a
    run is verified (``engine.verify`` checks the kernels of executable calls, one at a time)."""
    from .verify import active
    return (repeat_penalty == 1 and hasattr(model, "decode_ids") and getattr(model, "backend", "") in ("cuda", "hip")
            and switch("VEGAFUSE_DEVICE_SAMPLING", True) and active() is None)


def stream(model, tokenizer, prompt_ids, max_tokens=128, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
           repeat_penalty=1.0, seed=None, eos_ids=(), stop=(), repeat_last_n=64):
    """Prefill ``prompt_ids``, then decode up to ``max_tokens`` ids; yield the text as it is decoded.

    Yields str pieces (never splitting a UTF-8 character), then one :class:`Finished`.  Decoding
    ends at an EOS id (``eos_ids``), after ``max_tokens`` ids, or when the text contains one of the
    ``stop`` strings: the text before it is yielded, the stop string and what follows are not.  Text
    that could be the start of a stop string is held back until it is known not to be.  Sampling
    is :func:`engine.sampling.sample` with a ``np.random.default_rng(seed)``; the repeat penalty
    looks at the last ``repeat_last_n`` ids of the prompt and the generated text (0: none).  On a
    GPU backend the decode steps draw their ids on the device (``Model.decode_ids``: the same
    distribution, ``stdlib.sampling.sample``, with uniforms from the same generator), and the
    host reads them a few steps behind; a repeat penalty keeps the draws here.
    ``model``: an ``engine.model.Model`` (``prefill(ids)`` and ``decode(id)`` return logits [V]).
    Closing the generator early (``.close()``, or leaving a for loop) stops decoding.

    Raises:
        ValueError: an empty stop string, and what ``sample`` raises for bad sampling options."""
    from .tokenizer import StreamDecoder
    stop = tuple(stop)
    if any(not s for s in stop):
        raise ValueError("stop strings must not be empty")
    rng = np.random.default_rng(seed)
    decoder = StreamDecoder(tokenizer)
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids)
    t1 = time.perf_counter()
    compiled = getattr(model, "compile_s", 0.0)        # a compile while decoding is not decode time
    window = (lambda h: h[-repeat_last_n:]) if repeat_last_n > 0 else (lambda h: [])  # noqa: E731
    ids, text, pending, history, reason, hit = [], [], "", window(list(prompt_ids)), "length", -1

    def draws(logits):
        """The generated ids: the first from the prompt's logits, the rest from decode steps,
        drawn on the device when the model can (``_on_device``), else here from the logits."""
        nxt = sample(logits, temperature, top_k, top_p, rng, min_p, repeat_penalty, history)
        yield nxt
        if _on_device(model, repeat_penalty):
            greedy = temperature == 0 or top_k == 1
            yield from model.decode_ids(nxt, max_tokens - 1, rng=rng, sampling=None if greedy else dict(
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
            return
        while True:
            logits = model.decode(nxt)
            nxt = sample(logits, temperature, top_k, top_p, rng, min_p, repeat_penalty, history)
            yield nxt

    ids_drawn = draws(logits)
    try:
        for _, nxt in zip(range(max_tokens), ids_drawn):
            if is_eos(nxt, eos_ids):
                reason = "stop"
                break
            ids.append(nxt)
            history = window(history + [nxt])
            pending += decoder.push(nxt)
            hit = _find_stop(pending, stop)
            if hit >= 0:
                break
            n = len(pending) - _held(pending, stop)
            if n:
                text.append(pending[:n])
                yield pending[:n]
                pending = pending[n:]
    finally:
        ids_drawn.close()               # a device loop running ahead stops, and the model's position is set
    if hit < 0:
        pending += decoder.flush()
        hit = _find_stop(pending, stop)
    if hit >= 0:
        pending, reason = pending[:hit], "stop"
    if pending:
        text.append(pending)
        yield pending
    t2 = time.perf_counter()
    steps = max(0, len(ids) - 1)
    decode_s = t2 - t1 - (getattr(model, "compile_s", 0.0) - compiled)
    yield Finished(ids, reason, "".join(text), {
        "prefill_s": t1 - t0, "decode_s": decode_s,
        "decode_tokens_per_s": steps / decode_s if steps and decode_s > 0 else 0.0})


def generate(model, tokenizer, prompt_ids, max_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
             seed=None, eos_ids=(), on_text=None, *, min_p=0.0, repeat_penalty=1.0, stop=()):
    """:func:`stream` run to its end: returns (ids, stats), ids the generated ids (list of int),
    stats {prefill_s, decode_s, decode_tokens_per_s}; ``on_text(piece)`` receives each text piece."""
    for item in stream(model, tokenizer, prompt_ids, max_tokens, temperature, top_k, top_p, min_p,
                       repeat_penalty, seed, eos_ids, stop):
        if isinstance(item, Finished):
            return item.ids, item.stats
        if on_text:
            on_text(item)


def parse_args(argv=None):
    """The options of ``engine.generate`` (argparse.Namespace); a bad option prints one line
    ``error: ...`` and exits with status 2."""
    p = Parser("engine.generate", "Generate text with a model: the text streams to stdout, statistics to stderr.")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted and stdin is a pipe or a file)")
    p.add_argument("-p", "--prompt", dest="prompt_option", metavar="PROMPT", help="the prompt, as an option")
    p.add_argument("-m", "--model", help="a GGUF file, a Hugging Face directory, or the id of a Hugging Face repo "
                                         "in the local cache (default: SmolLM2-135M-Instruct Q4_1; "
                                         "python -m engine.models lists them)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="where kernels run (default cpu; hip is untested on hardware)")
    p.add_argument("-n", "--max-tokens", type=int, default=128,
                   help="most tokens to generate; -1: until the context is full (default 128)")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely ids; <= 0: no limit (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1.0 keeps all (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep the ids at least this likely relative to the most likely one; 0: off (default 0)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide the logits of recent ids by this (multiply when negative); 1.0: off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="the recent ids the repeat penalty looks at, prompt included (default 64)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable); it is not printed")
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("-c", "--context", type=int, default=None, help="KV-cache positions (default min(model, 2048))")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32"],
                   help="weights in memory: native keeps a GGUF's q4_0/q4_1/q8_0 tensors quantized, f16/f32 "
                        "dequantize (default native for a GGUF or a GPTQ directory, else f16)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_1", "q8_0"],
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"],
                   help="KV-cache element type (default f16: half the bytes attention reads)")
    p.add_argument("--profile", nargs="?", const=".", metavar="DIR",
                   help="after generating, profile 32 decode steps: a table on stderr, profile.json and "
                        "roofline.png in DIR (default: the current directory); give the prompt before it or with -p")
    p.add_argument("--verify", action="store_true",
                   help="check every kernel's output against the reference interpreter (float64) on the "
                        "kernel's own inputs, at every step; stops at the first mismatch (slow)")
    args = p.parse_args(argv)
    if args.prompt_option is not None:
        if args.prompt is not None:
            p.error("give the prompt once: as an argument or with -p/--prompt")
        args.prompt = args.prompt_option
    if args.max_tokens < -1:
        p.error(f"--max-tokens must be >= 0, or -1 for no limit, got {args.max_tokens}")
    args.max_tokens = sys.maxsize if args.max_tokens == -1 else args.max_tokens     # to the context's end
    bad = settings_error(args.temperature, args.top_p, args.min_p, args.repeat_penalty)
    if bad:
        p.error(bad)
    if args.repeat_last_n < 0:
        p.error(f"--repeat-last-n must be >= 0, got {args.repeat_last_n}")
    if "" in args.stop:
        p.error("--stop takes a non-empty text")
    if args.profile is not None and args.backend == "reference":
        p.error("--profile times compiled kernels: the reference backend has none; use --backend cpu, cuda or hip")
    return args


def main(argv=None):
    return run_cli(run, parse_args(argv))


def run(args):
    from .models import resolve_model
    prompt = args.prompt
    try:
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read()
            prompt = prompt[:-1] if prompt.endswith("\n") else prompt      # the newline `echo` adds
        (prompt or "").encode("utf-8")
    except UnicodeError:
        raise ModelError("the prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
    if not prompt and args.profile not in (None, ".") and not os.path.isdir(args.profile):
        raise ModelError(f"the prompt is empty: --profile took {args.profile!r} as its DIR; give the prompt "
                         "before --profile or with -p")
    if not prompt:
        raise ModelError("the prompt is empty: pass it as an argument, e.g. "
                         "python -m engine.generate \"Once upon a time\"")
    if args.max_tokens < 0:
        raise ModelError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.seed is not None and args.seed < 0:
        raise ModelError(f"--seed must be >= 0, got {args.seed}")
    if args.context is not None and args.context < 1:
        raise ModelError(f"--context must be at least 1, got {args.context}")
    if args.verify and args.backend == "reference":
        raise ModelError("--verify checks compiled kernels and the reference backend has none; "
                         "use --backend cpu, cuda or hip")
    path = resolve_model(args.model)             # checked without opening it: a FIFO would block
    from .build import COUNTS
    from .executable import get_device
    from .model import open_model
    from .weights import format_resident
    get_device(args.backend)                     # the device starts (or fails) before the model loads
    t_load = time.perf_counter()
    model, tok, eos = open_model(path, args.backend, args.dtype, args.quant, args.context, args.kv_dtype)
    t_load = time.perf_counter() - t_load
    params = model.params
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    prompt_ids = tok.encode(text)
    if not prompt_ids:
        raise ModelError("the prompt encodes to no tokens: give some text")
    if len(prompt_ids) >= model.context:
        raise ModelError(f"the prompt has {len(prompt_ids)} tokens but the context holds {model.context}; "
                         "shorten the prompt or raise --context")
    # the first token needs only the prefill: the decode step compiles after it is shown
    # (VEGAFUSE_PREFILL_FIRST=0: both before the prefill, for A/B)
    model.compile(len(prompt_ids), decode=not switch("VEGAFUSE_PREFILL_FIRST", True))
    max_tokens = min(args.max_tokens, model.context - len(prompt_ids))

    def emit(piece):
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    from .verify import checking
    with checking() if args.verify else contextlib.nullcontext() as checked, streaming():
        for out in stream(model, tok, prompt_ids, max_tokens, args.temperature, args.top_k, args.top_p,
                          args.min_p, args.repeat_penalty, args.seed, eos, args.stop, args.repeat_last_n):
            if isinstance(out, str) and not args.json:
                emit(out)
    ids, stats = out.ids, out.stats
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "ids": ids, "text": out.text, "finish_reason": out.finish_reason,
                          "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 3),
                          "prefill_s": round(stats["prefill_s"], 4)}))
    else:
        sys.stdout.write("\n")
    built = COUNTS["compiles"]
    print(f"[{len(prompt_ids)} prompt tokens, {len(ids)} generated, decode {stats['decode_tokens_per_s']:.1f} "
          f"tokens/s; backend {args.backend}; {format_resident(params)}]", file=sys.stderr)
    print(f"[load {t_load:.2f} s, compile {model.compile_s:.2f} s ({built} object{'s' * (built != 1)} compiled, "
          f"{COUNTS['cached']} from the cache), prefill {stats['prefill_s']:.2f} s, "
          f"decode {stats['decode_s']:.2f} s]", file=sys.stderr)
    if checked is not None:
        print(f"[{checked.summary()}]", file=sys.stderr)
    if args.profile is not None:
        from .profile import positions_needed, profile_model, steps_fitting
        steps = steps_fitting(model.context)
        if steps < 1:
            raise ModelError(f"--profile needs a context of at least {positions_needed(1)} positions; raise --context")
        profile_model(model, (ids or prompt_ids)[-1], steps, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())

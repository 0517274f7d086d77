"""Generate text: ``python -m engine.generate [PROMPT] [options]``.

Text streams to stdout, statistics go to stderr.  ``--json`` prints one object
instead: prompt_ids, ids (generated), text, decode_tokens_per_s, prefill_s.
Bad input (missing or corrupt model, empty or too long prompt) prints one line
``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .errors import ModelError, run_cli
from .sampling import is_eos, sample


def generate(model, tokenizer, prompt_ids, max_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
             seed=None, eos_ids=(), on_text=None):
    """Prefill ``prompt_ids``, then decode up to ``max_tokens`` ids, stopping at any EOS id.

    ``on_text(piece)`` receives streamed text (never splitting a UTF-8 character).
    Returns (ids, stats) with stats = {prefill_s, decode_s, decode_tokens_per_s}."""
    from .tokenizer import StreamDecoder
    rng = np.random.default_rng(seed)
    stream = StreamDecoder(tokenizer)
    t0 = time.perf_counter()
    logits = model.prefill(prompt_ids)
    t1 = time.perf_counter()
    ids, t_first = [], None
    for i in range(max_tokens):
        nxt = sample(logits, temperature, top_k, top_p, rng)
        if is_eos(nxt, eos_ids):
            break
        ids.append(nxt)
        if on_text:
            on_text(stream.push(nxt))
        if i + 1 == max_tokens:
            break
        if t_first is None:
            t_first = time.perf_counter()
        logits = model.decode(nxt)
    if on_text:
        on_text(stream.flush())
    t2 = time.perf_counter()
    steps = max(0, len(ids) - 1)
    decode_s = (t2 - t1)
    return ids, {"prefill_s": t1 - t0, "decode_s": decode_s,
                 "decode_tokens_per_s": steps / decode_s if steps and decode_s > 0 else 0.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted and stdin is a pipe)")
    p.add_argument("--model", help="a GGUF file or a Hugging Face directory (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="where kernels run (default cpu; hip is untested on hardware)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely ids; <= 0: no limit (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1.0 keeps all (default 0.95)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--context", type=int, default=None, help="KV-cache positions (default min(model, 2048))")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32"],
                   help="weights in memory: native keeps a GGUF's q4_0/q4_1/q8_0 tensors quantized, f16/f32 "
                        "dequantize (default native for a GGUF on the cpu, else f16)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_1", "q8_0"],
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"],
                   help="KV-cache element type (default f16: half the bytes attention reads)")
    return p.parse_args(argv)


def main(argv=None):
    return run_cli(run, parse_args(argv))


def run(args):
    from .model import Model
    from .weights import default_dtype, default_model_path, format_resident, load_model
    prompt = args.prompt
    try:
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read()
            prompt = prompt[:-1] if prompt.endswith("\n") else prompt      # the newline `echo` adds
        (prompt or "").encode("utf-8")
    except UnicodeError:
        raise ModelError("the prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
    if not prompt:
        raise ModelError("the prompt is empty: pass it as an argument, e.g. "
                         "python -m engine.generate \"Once upon a time\"")
    if args.max_tokens < 0:
        raise ModelError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:       # also rejects nan
        raise ModelError("need --temperature >= 0 and 0 < --top-p <= 1")
    if args.seed is not None and args.seed < 0:
        raise ModelError(f"--seed must be >= 0, got {args.seed}")
    if args.context is not None and args.context < 1:
        raise ModelError(f"--context must be at least 1, got {args.context}")
    path = args.model or default_model_path()
    t_load = time.perf_counter()
    cfg, params, tok = load_model(path, args.dtype or default_dtype(path, args.backend), args.quant)
    t_load = time.perf_counter() - t_load
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    prompt_ids = tok.encode(text)
    if not prompt_ids:
        raise ModelError("the prompt encodes to no tokens: give some text")
    if args.context is not None and args.context > cfg.max_seq_len:
        raise ModelError(f"--context {args.context} exceeds the {cfg.max_seq_len} positions the model was "
                         f"trained for; use --context {cfg.max_seq_len} or less")
    model = Model(cfg, params, backend=args.backend, context=args.context, kv_dtype=args.kv_dtype)
    if len(prompt_ids) >= model.context:
        raise ModelError(f"the prompt has {len(prompt_ids)} tokens but the context holds {model.context}; "
                         "shorten the prompt or raise --context")
    model.compile(len(prompt_ids))
    max_tokens = min(args.max_tokens, model.context - len(prompt_ids))
    eos = tuple(cfg.eos_ids) + ((tok.eos_id,) if tok.eos_id is not None else ())

    def emit(piece):
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    ids, stats = generate(model, tok, prompt_ids, max_tokens, args.temperature, args.top_k, args.top_p,
                          args.seed, eos, None if args.json else emit)
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "ids": ids, "text": tok.decode(ids),
                          "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 3),
                          "prefill_s": round(stats["prefill_s"], 4)}))
    else:
        sys.stdout.write("\n")
    print(f"[{len(prompt_ids)} prompt tokens, prefill {stats['prefill_s']:.2f} s; {len(ids)} generated, "
          f"decode {stats['decode_tokens_per_s']:.1f} tokens/s; backend {args.backend}]", file=sys.stderr)
    print(f"[{format_resident(params)}; loaded in {t_load:.2f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

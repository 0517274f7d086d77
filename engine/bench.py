"""Decode benchmark: ``python -m engine.bench [--model PATH] [--tokens 64] [--prompt TEXT]``.

Prints decode tokens/s for the same model and prompt, measured in one run:
  * vegafuse on the CPU (fused, LLVM-compiled kernels),
  * the vegafuse numpy reference interpreter (the same traced program, op by op),
  * Hugging Face transformers eager on the CPU in float32, when torch and
    transformers are importable (the model is exported from the GGUF first).
Greedy decoding; timings exclude compilation and the prefill.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np


def bench_vegafuse(cfg, params, ids, n_tokens, backend):
    from .model import Model
    m = Model(cfg, params, backend=backend, context=len(ids) + n_tokens + 8)
    m.compile(len(ids))
    logits = m.prefill(ids)
    nxt = int(np.argmax(logits))
    out = [nxt]
    t0 = time.perf_counter()
    for _ in range(n_tokens - 1):
        nxt = int(np.argmax(m.decode(nxt)))
        out.append(nxt)
    dt = time.perf_counter() - t0
    return (n_tokens - 1) / dt, out


def bench_hf(model_path, ids, n_tokens, threads):
    """Hugging Face eager float32 on the CPU; decode rate from generate(n) minus generate(1)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, None
    from .weights import export_hf_dir
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        if os.path.isdir(model_path):
            d = model_path
        else:
            export_hf_dir(model_path, d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t, out[0, len(ids):].tolist()
    run(2)                                               # warm up
    t1, _ = run(1)
    tn, out = run(n_tokens)
    return (n_tokens - 1) / (tn - t1), out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=64, help="tokens to decode (default 64)")
    p.add_argument("--reference-tokens", type=int, default=8, help="tokens for the slow interpreter (default 8)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    args = p.parse_args(argv)
    from .weights import default_model_path, load_model
    path = args.model or default_model_path()
    cfg, params, tok = load_model(path)
    ids = tok.encode(args.prompt)
    threads = os.cpu_count() or 1
    print(f"model {cfg.name or path}: {cfg.n_layers} layers, dim {cfg.dim}; prompt {len(ids)} tokens; "
          f"{os.cpu_count()} CPU threads", flush=True)
    rows = []
    tps, ours = bench_vegafuse(cfg, params, ids, args.tokens, "cpu")
    rows.append(("vegafuse cpu (fused, f16 weights)", tps, args.tokens))
    print(f"  {rows[-1][0]:<40} {tps:8.1f} tokens/s", flush=True)
    _, params32, _ = load_model(path, "f32")
    tps32, ours32 = bench_vegafuse(cfg, params32, ids, args.tokens, "cpu")
    del params32
    print(f"  {'vegafuse cpu (fused, f32 weights)':<40} {tps32:8.1f} tokens/s   (ids agree: {ours32 == ours})",
          flush=True)
    tps_ref, ref = bench_vegafuse(cfg, params, ids, args.reference_tokens, "reference")
    rows.append(("vegafuse reference interpreter (numpy)", tps_ref, args.reference_tokens))
    print(f"  {rows[-1][0]:<40} {tps_ref:8.1f} tokens/s   (ids agree: {ref == ours[:len(ref)]})", flush=True)
    if not args.no_hf:
        tps_hf, hf = bench_hf(path, ids, args.tokens, threads)
        if tps_hf is None:
            print("  Hugging Face eager: torch/transformers not importable, skipped")
        else:
            rows.append(("Hugging Face eager cpu (f32)", tps_hf, args.tokens))
            print(f"  {rows[-1][0]:<40} {tps_hf:8.1f} tokens/s   (ids agree: {hf == ours})")
    best = max(r[1] for r in rows[1:])
    print(f"speed-up over the best peer: {tps / best:.2f}x (f16 weights), {tps32 / best:.2f}x (f32 weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

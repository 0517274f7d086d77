"""Decode benchmark.

CPU: ``python -m engine.bench [--model PATH] [--tokens 64] [--prompt TEXT]`` prints decode
tokens/s for the same model and prompt, measured in one run:
  * vegafuse on the CPU (fused, LLVM-compiled kernels), with the weights of ``--dtype`` /
    ``--quant`` (default: a GGUF's own quantized tensors) and, for comparison, f16 weights
    (f32 when the first run is f16),
  * the vegafuse numpy reference interpreter (the same traced program, op by op),
  * Hugging Face transformers eager on the CPU in float32, when torch and
    transformers are importable (the model is exported from the GGUF first).
Greedy decoding; timings exclude compilation and the prefill: ``--tokens N`` times N decode steps
after the prefill's token.  Results print as a llama-bench-style table (model, size, backend, test
``tgN`` / ``ppN``, t/s), then notes (ids agreement, ratios); a rate that cannot be measured prints
``n/a``, never a division by zero.  Options are checked before the DSL is imported: bad ones print
one line ``error: ...`` and exit with status 2.

GPU: ``python -m engine.bench --backend cuda --model qwen2.5-1.5b --random-weights --dtype f16
--tokens 128 --context 512`` decodes greedily on the device (argmax in a kernel, no host sync per
token, CUDA graph replay) after a 32-token prompt and prints tokens/s, ms per token, weight bytes
per token, achieved GB/s against the device-to-device copy bandwidth measured in the same run, and
launches per token; beside it, the peer measured in the same run: Hugging Face transformers with a
static KV cache and ``torch.compile(mode="reduce-overhead", fullgraph=True)``, same shape and dtype.
``--capacity-check`` decodes 64 tokens with KV caches of 512 and 32768 positions.

Streaming: ``python -m engine.bench --backend cuda --stream`` times ``engine.generate.stream``
(the CLI's, chat's and server's loop; ids drawn on the device and read a few steps behind), greedy
and sampled, beside the device loop measured in the same run (``main_stream``).

Prefill: ``python -m engine.bench --prefill N`` times the forward over an N-token prompt (median
of ``--repeat`` runs) and prints tokens/s beside Hugging Face eager f32 on the CPU (the fixed text's
tokens), or with ``--backend cuda [--model qwen2.5-1.5b]`` (random weights, random ids) beside the
torch model's forward in the same dtype, measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from .errors import ModelError, Parser, run_cli

QUANT_DTYPES = ("q4_0", "q4_1", "q8_0", "gptq_int4")   # dsl.quant.QUANT_DTYPES: options parse without the DSL


def rate(n, seconds):
    """n / seconds, or None when that is no rate (nothing timed, or a clock that did not advance)."""
    return n / seconds if n > 0 and seconds > 0 else None


def bench_vegafuse(cfg, params, ids, n_tokens, backend, kv_dtype="f16", context=None, keep=None):
    """(tokens/s or None, ids): greedy decode of ``n_tokens`` steps after the prefill of ``ids``, timed
    from the first decode step; ids holds the prefill's token and the ``n_tokens`` decoded.  The KV
    cache holds ``context`` positions (default: just enough); ``keep``: a list the model is appended
    to (``--profile`` profiles it afterwards)."""
    from .model import Model
    m = Model(cfg, params, backend=backend, context=max(context or 0, len(ids) + n_tokens + 8), kv_dtype=kv_dtype)
    if keep is not None:
        keep.append(m)
    m.compile(len(ids))
    logits = m.prefill(ids)
    nxt = int(np.argmax(logits))
    out = [nxt]
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        nxt = int(np.argmax(m.decode(nxt)))
        out.append(nxt)
    return rate(n_tokens, time.perf_counter() - t0), out


def hf_cpu_model(model_path, threads):
    """The Hugging Face model of ``model_path`` (a GGUF, exported to a temporary directory first, or
    a Hugging Face directory) in float32 on ``threads`` CPU threads, in eval mode.  Needs torch and
    transformers."""
    import torch
    from transformers import AutoModelForCausalLM
    from .weights import export_hf_dir
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        if os.path.isdir(model_path):
            d = model_path
        else:
            export_hf_dir(model_path, d)
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def bench_hf(model_path, ids, n_tokens, threads):
    """Hugging Face eager float32 on the CPU: (tokens/s or None, ids) of ``n_tokens`` decode steps,
    from generate(n + 1) minus generate(1); (None, None) without torch and transformers."""
    try:
        import torch
        import transformers  # noqa: F401  (the peer needs it)
    except ImportError:
        return None, None
    model = hf_cpu_model(model_path, threads)
    x = torch.tensor([ids])
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t, out[0, len(ids):].tolist()
    run(2)                                               # warm up
    t1, _ = run(1)
    tn, out = run(n_tokens + 1)
    return rate(n_tokens, tn - t1), out


SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                         rope_theta=1e5, norm_eps=1e-5, tie_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960,
                         head_dim=128, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                         arch="qwen2"),
    "qwen2.5-7b": dict(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                       head_dim=128, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False, qkv_bias=True,
                       arch="qwen2"),
}


def random_params(cfg, dev, dtype="f16", seed=0):
    """Random weights of the real shapes, made on the device (speed depends on bytes, not values)."""
    from dsl.quant import random_qarray
    D, hd, F = cfg.dim, cfg.head_dim, cfg.ffn_dim
    seeds = iter(range(seed, seed + 1 << 20))
    if dtype in QUANT_DTYPES:                    # all 2-D weights quantized; uploaded once, when first bound
        mat = lambda n, k: random_qarray((n, k), dtype, next(seeds))               # noqa: E731
    else:
        mat = lambda n, k: dev.random((n, k), dtype, 0.02, next(seeds))          # noqa: E731
    vec = lambda n, shift=0.0: dev.random((n,), "f32", 0.02, next(seeds), shift)  # noqa: E731
    layers = []
    for _ in range(cfg.n_layers):
        p = {"attn_norm": vec(D, 1.0), "ffn_norm": vec(D, 1.0), "wq": mat(cfg.n_heads * hd, D),
             "wk": mat(cfg.n_kv_heads * hd, D), "wv": mat(cfg.n_kv_heads * hd, D), "wo": mat(D, cfg.n_heads * hd),
             "w_gate": mat(F, D), "w_up": mat(F, D), "w_down": mat(D, F)}
        if cfg.qkv_bias:
            p.update(bq=vec(cfg.n_heads * hd), bk=vec(cfg.n_kv_heads * hd), bv=vec(cfg.n_kv_heads * hd))
        layers.append(p)
    params = {"embed": mat(cfg.vocab_size, D), "layers": layers, "norm": vec(D, 1.0)}
    if not cfg.tie_embeddings:
        params["lm_head"] = mat(cfg.vocab_size, D)
    return params


def weight_bytes(cfg, params):
    """Bytes of weights one decode step streams (the embedding table only when it is the LM head)."""
    from dsl.pytree import flatten
    total = sum(int(a.nbytes) for a in flatten(params)[0])
    if not cfg.tie_embeddings:
        total -= int(params["embed"].nbytes) - int(params["embed"].nbytes) // cfg.vocab_size
    return total


def gpu_decode(cfg, params, n_tokens, context, prompt_tokens=32, seed=0, position=None, kv_dtype="f16", keep=None):
    """(tokens/s, executable) of greedy device-side decode after a random prompt of ``prompt_tokens``,
    timed after one untimed run of the same steps;
    ``position``: decode from this cache position instead (the positions between the prompt and it
    hold zeros: the step's speed depends on how many positions attention reads, not their values);
    ``keep``: a list the model is appended to (``--profile`` profiles it afterwards)."""
    from .model import Model
    m = Model(cfg, params, backend="cuda", context=context, kv_dtype=kv_dtype)
    if keep is not None:
        keep.append(m)
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt_tokens).tolist()
    first = int(np.argmax(np.asarray(m.prefill(prompt))))
    m.decode_greedy(first, 2)                      # compile, capture the graph
    start = prompt_tokens if position is None else position
    # one untimed decode of the same steps first: timed right after the capture, a freshly started
    # H200's first run took 1.673 ms a step against 1.424 in the next process (idle clocks: 345 MHz)
    m.pos = start
    m.decode_greedy(first, n_tokens)
    m.pos = start
    t0 = time.perf_counter()
    m.decode_greedy(first, n_tokens)
    dt = time.perf_counter() - t0
    ex = m.greedy_step.compile(m.params, np.zeros(1, np.int32), 0, 0, m.cache)
    return n_tokens / dt, ex


def hf_config(cfg, positions):
    """The Hugging Face config (Qwen2 with a QKV bias, else Llama) of ``cfg``'s shape, for ``positions``
    positions: the torch peers' model.  Needs transformers."""
    from transformers import LlamaConfig, Qwen2Config
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
              num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
              rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
              max_position_embeddings=positions)
    return Qwen2Config(**kw) if cfg.qkv_bias else LlamaConfig(head_dim=cfg.head_dim, **kw)


def bench_torch_compile(cfg, n_tokens, context, prompt_tokens=32, dtype="f16", position=None):
    """Hugging Face transformers with a static KV cache; the one-token forward (with argmax) under
    torch.compile(mode="reduce-overhead", fullgraph=True), called in a plain decode loop as in
    Hugging Face's static-cache guide; random weights of the same shape.  Returns tokens/s or None."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, StaticCache
    except ImportError:
        return None
    hf = hf_config(cfg, context)
    tdt = torch.float16 if dtype == "f16" else torch.float32
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf, dtype=tdt).eval()
    try:
        past = StaticCache(config=model.config, max_batch_size=1, max_cache_len=context, device="cuda", dtype=tdt)
    except TypeError:
        past = StaticCache(config=model.config, max_cache_len=context)

    def decode_one_token(tok, cache_position):
        logits = model(tok, cache_position=cache_position, past_key_values=past, use_cache=True,
                       return_dict=False)[0]
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True)
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), device="cuda")
    with torch.inference_mode():
        logits = model(ids, cache_position=torch.arange(prompt_tokens, device="cuda"), past_key_values=past,
                       use_cache=True, return_dict=False)[0]
        tok = torch.argmax(logits[:, -1], dim=-1, keepdim=True)

        def run(n, start):
            nonlocal tok
            pos = torch.tensor([start], device="cuda")
            for _ in range(n):
                torch.compiler.cudagraph_mark_step_begin()
                tok = step(tok.clone(), pos).clone()
                pos += 1
        run(8, prompt_tokens)                          # compile, record the graph
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(n_tokens, prompt_tokens if position is None else position)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    del model, past
    torch.cuda.empty_cache()
    return n_tokens / dt


def main_gpu(args):
    from .executable import get_device
    from stdlib.config import LlamaConfig
    if args.phases:                                # before anything compiles
        os.environ.update(VEGAFUSE_PERSISTENT="1", VEGAFUSE_PERSISTENT_TRACE="1")
    dev = get_device("cuda")
    if args.no_graphs:
        dev.graphs = False
    name = args.model or "smollm2-135m"
    if args.capacity_check:
        cfg = LlamaConfig(**SHAPES["smollm2-135m"], max_seq_len=32768)
        params = random_params(cfg, dev, args.dtype)
        r = {}
        for cap in (512, 32768):
            r[cap], _ = gpu_decode(cfg, params, 63, cap, prompt_tokens=1, kv_dtype=args.kv_dtype)
            print(f"  smollm2-135m, 64 tokens in a cache of {cap:>5} positions: {1e3 / r[cap]:.3f} ms/token")
        print(f"  capacity 32768 vs 512: {r[512] / r[32768]:.3f}x the time per token")
        return 0
    if args.random_weights or name in SHAPES:
        if name not in SHAPES:
            raise ModelError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
        cfg = LlamaConfig(**SHAPES[name], max_seq_len=args.context, name=name)
        params = random_params(cfg, dev, args.dtype)
    else:
        from .weights import format_resident, load_model
        cfg, params, _ = load_model(name, "native" if args.dtype in QUANT_DTYPES else args.dtype, args.quant)
        print(format_resident(params), flush=True)
        params = dev.put(params)
    bw = dev.copy_bandwidth()
    kept = []
    tps, ex = gpu_decode(cfg, params, args.tokens, args.context, position=args.position, kv_dtype=args.kv_dtype,
                         keep=kept)
    wb = weight_bytes(cfg, params)
    print(f"{name}: {cfg.n_layers} layers, dim {cfg.dim}, {args.dtype} weights, {args.kv_dtype} KV cache, batch 1, "
          f"{args.tokens} tokens after a 32-token prompt"
          f"{f' from position {args.position}' if args.position is not None else ''}, context {args.context}; device copy bandwidth "
          f"{bw:.0f} GB/s (read + write)", flush=True)
    table, tg = Table(), f"tg{args.tokens}"
    table.row(f"{name} {args.dtype}", size_text(wb), f"vegafuse cuda{'' if dev.graphs else ' (no graphs)'}", tg, tps)
    notes = [f"vegafuse cuda: {1e3 / tps:.3f} ms/token  {wb / 1e9:.3f} GB/token  {wb * tps / 1e9:.0f} GB/s = "
             f"{100 * wb * tps / 1e9 / bw:.1f}% of copy  {len(ex.plan.kernels) + 2} launches/token"]
    if not args.no_peer:
        peer_dtype = "f16" if args.dtype in QUANT_DTYPES else args.dtype     # the peer has no such weights
        peer = bench_torch_compile(cfg, args.tokens, args.context, dtype=peer_dtype, position=args.position)
        if peer is None:
            notes.append("torch.compile peer: torch/transformers not importable, skipped")
        else:
            table.row(f"{name} {peer_dtype}", size_text(wb) if peer_dtype == args.dtype else "",
                      "HF static cache + torch.compile", tg, peer)
            notes.append(f"HF static cache + torch.compile(reduce-overhead), {peer_dtype}: {1e3 / peer:.3f} ms/token"
                         f"  -> vegafuse {ratio(tps, peer)}")
    print("\n".join(notes), flush=True)
    if args.phases:
        from .profile import format_phases, phase_times
        print(format_phases(phase_times(ex)), flush=True)
    if args.profile is not None:
        profile(args, kept[0], f"{name} {args.dtype}")
    if args.marginal:
        from .profile import format_marginal, marginal_costs
        start = 32 if args.position is None else args.position          # where the decode above was timed
        print(format_marginal(marginal_costs(kept[0], 0, args.tokens, args.repeat, start)), flush=True)
    return 0


def profile(args, model, title):
    """``--profile [DIR]``: ``engine.profile`` over ``--tokens`` decode steps of the model just timed,
    from its position (every kernel timed, gaps, regimes, the batch-1 ceiling; DIR gets
    profile.json and roofline.png)."""
    from .profile import profile_model
    profile_model(model, 0, args.tokens, args.profile, title=title)


# ------------------------------------------------------------------------------ streaming (--stream)
def main_stream(args):
    """``--stream``: ``engine.generate.stream`` on the GPU (what the CLI, the chat and the server run)
    against the device loop (``Model.decode_greedy``: ids kept on the device, read once at the end),
    on a real model and prompt, measured in the same run in rounds A/B/A: the device loop, the stream
    greedy, the stream sampled (temperature 0.8, top-p 0.95), and the stream with its draws on the
    host (``VEGAFUSE_DEVICE_SAMPLING=0``: the logits read back every step).  Each rate counts the
    ``--tokens`` decode steps after the prompt's token; no EOS stops a run."""
    from .generate import Finished, stream
    from .model import open_model
    model, tok, _ = open_model(args.model, backend="cuda", context=args.context, kv_dtype=args.kv_dtype)
    ids, n = tok.encode(args.prompt), args.tokens

    def device_loop():
        first = int(np.argmax(np.asarray(model.prefill(ids))))
        t0 = time.perf_counter()
        model.decode_greedy(first, n)
        return n / (time.perf_counter() - t0)

    def streamed(on_host=False, **kw):
        os.environ["VEGAFUSE_DEVICE_SAMPLING"] = "0" if on_host else "1"
        try:
            for item in stream(model, tok, ids, max_tokens=n + 1, seed=0, **kw):
                if isinstance(item, Finished):
                    return item.stats["decode_tokens_per_s"]
        finally:
            os.environ.pop("VEGAFUSE_DEVICE_SAMPLING")

    runs = {"device loop, greedy": device_loop,
            "stream, greedy": lambda: streamed(temperature=0.0),
            "stream, temp 0.8 top-p 0.95": lambda: streamed(temperature=0.8, top_p=0.95),
            "stream, greedy, host draws": lambda: streamed(on_host=True, temperature=0.0)}
    for f in runs.values():                     # compile, capture the graphs
        f()
    got = {k: [] for k in runs}
    for _ in range(2):                          # A/B/A: each kind runs in two rounds
        for k, f in runs.items():
            got[k].append(f())
    table, tg = Table(), f"tg{n}"
    for k, rates in got.items():
        table.row(f"{os.path.basename(args.model)}"[:28], "", f"cuda {k}", tg, max(rates))
    best = {k: max(v) for k, v in got.items()}
    print(f"stream / device loop, greedy: {ratio(best['stream, greedy'], best['device loop, greedy'])};  "
          f"sampled / greedy, streamed: {ratio(best['stream, temp 0.8 top-p 0.95'], best['stream, greedy'])};  "
          f"rounds: " + ", ".join(f"{k} {' '.join(f'{r:.0f}' for r in v)}" for k, v in got.items()))
    return 0


# ------------------------------------------------------------------------------ prefill (--prefill N)
def prefill_ids(n, vocab, tok=None):
    """An N-token prompt: the fixed public-domain text's tokens (repeated as needed) with a
    tokenizer, else random ids (seeded)."""
    if tok is None:
        return np.random.default_rng(0).integers(0, vocab, n).tolist()
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                        "pride_and_prejudice_ch1.txt")
    ids = tok.encode(open(path, encoding="utf-8").read())
    return (ids * (n // len(ids) + 1))[:n]


def time_prefill(cfg, params, ids, backend, repeat, kv_dtype="f16"):
    """Seconds of each of ``repeat`` prefills of ``ids`` (compiled and run once first)."""
    from .model import Model
    m = Model(cfg, params, backend=backend, context=len(ids) + 8, kv_dtype=kv_dtype)
    m.compile(len(ids))
    np.asarray(m.prefill(ids))
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.asarray(m.prefill(ids))                   # the logits on the host: the device has finished
        out.append(time.perf_counter() - t0)
    return out


def hf_prefill(model_path, ids, threads, repeat):
    """Hugging Face eager float32 on the CPU: seconds of each forward over ``ids``; None without torch."""
    try:
        import torch
        import transformers  # noqa: F401  (the peer needs it)
    except ImportError:
        return None
    model = hf_cpu_model(model_path, threads)
    x = torch.tensor([ids])
    out = []
    with torch.inference_mode():
        model(x)
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(x)
            out.append(time.perf_counter() - t0)
    return out


def torch_gpu_prefill(cfg, ids, dtype, repeat):
    """The Hugging Face model of ``cfg``'s shape (random weights) in f16/f32 on the GPU: seconds of
    each forward over ``ids`` (synchronized); None without torch and transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    hf = hf_config(cfg, max(len(ids), 32))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float16 if dtype == "f16" else torch.float32).eval()
    x = torch.tensor([ids], device="cuda")
    out = []
    with torch.inference_mode():
        model(x)
        torch.cuda.synchronize()
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(x)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return out


def main_prefill(args):
    """``--prefill N``: the time to process an N-token prompt (one forward over it, KV cache written,
    last logits read back) and tokens/s, median of ``--repeat`` runs, beside the peer of the same run:
    Hugging Face eager f32 on the CPU; on ``--backend cuda`` the torch model's forward in the same dtype."""
    n, repeat = args.prefill, args.repeat
    if args.backend == "cuda":
        from .executable import get_device
        from stdlib.config import LlamaConfig
        name = args.model or "qwen2.5-1.5b"
        if name not in SHAPES:
            raise ModelError(f"--prefill on cuda takes a shape with random weights: {', '.join(SHAPES)}")
        cfg = LlamaConfig(**SHAPES[name], max_seq_len=n + 8, name=name)
        params = random_params(cfg, get_device("cuda"), args.dtype)
        ids = prefill_ids(n, cfg.vocab_size)
        peer_name, peer = f"torch eager cuda ({args.dtype})", lambda: torch_gpu_prefill(cfg, ids, args.dtype, repeat)
        what = f"{name} ({args.dtype} random weights)"
    else:
        from .weights import default_dtype, load_model
        path = args.model
        dtype = args.dtype or default_dtype(path, "cpu")
        cfg, params, tok = load_model(path, "native" if dtype in QUANT_DTYPES else dtype, args.quant)
        ids = prefill_ids(n, cfg.vocab_size, tok)
        peer_name, peer = "Hugging Face eager cpu", lambda: None if args.no_hf else hf_prefill(
            path, ids, os.cpu_count() or 1, repeat)
        name = cfg.name or os.path.basename(path)
        what = f"{name} ({args.quant or dtype} weights, {os.cpu_count()} CPU threads)"
    ours = time_prefill(cfg, params, ids, args.backend, repeat, args.kv_dtype)
    print(f"prefill of a {n}-token prompt, {what}; median of {repeat} runs (p10 .. p90)", flush=True)
    table, notes = Table(), []
    kind, nbytes = weights_of(params) if args.backend == "cpu" else (args.dtype, weight_bytes(cfg, params))

    def row(label, model, size, ts):
        q = np.percentile(ts, [10, 50, 90])
        table.row(model, size, label, f"pp{n}", rate(n, q[1]))
        notes.append(f"{label}: {q[1]:.4f} s = {n / q[1] if q[1] > 0 else float('nan'):.1f} tok/s "
                     f"(p10 .. p90: {q[0]:.4f} .. {q[2]:.4f} s)")
        return q[1]
    mine = row(f"vegafuse {args.backend}", f"{name} {kind}", size_text(nbytes), ours)
    theirs = peer()
    if theirs is not None:
        other = row(peer_name, f"{name} {'f32' if args.backend == 'cpu' else args.dtype}", "", theirs)
        notes.append(f"vegafuse / peer: {ratio(rate(n, mine), rate(n, other))} the peer's tokens/s")
    else:
        notes.append(f"{peer_name}: skipped (torch/transformers not importable, or --no-hf)")
    print("\n".join(notes))
    return 0


class Table:
    """llama-bench's table (model, size, backend, test, t/s) in Markdown: the header before the first
    row, each row as it is measured.  ``test`` is ``tgN`` (N tokens decoded, timed) or ``ppN`` (an
    N-token prompt); a rate that could not be measured prints as n/a."""
    COLS = (("model", 40, "<"), ("size", 10, ">"), ("backend", 30, "<"), ("test", 6, ">"), ("t/s", 9, ">"))

    def __init__(self):
        self.n = 0

    def row(self, model, size, backend, test, tps):
        if not self.n:
            print("| " + " | ".join(f"{c:{a}{w}}" for c, w, a in self.COLS) + " |")
            print("| " + " | ".join("-" * (w - 1) + (":" if a == ">" else "-") for _, w, a in self.COLS) + " |")
        self.n += 1
        cells = (model, size, backend, test, "n/a" if tps is None else f"{tps:.2f}")
        print("| " + " | ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(cells, self.COLS)) + " |", flush=True)


def size_text(nbytes) -> str:
    """llama-bench's size column: MiB below 1 GiB, else GiB."""
    return f"{nbytes / 2**20:.2f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def weights_of(params):
    """(the format holding most of the weight bytes, e.g. "q4_1", total bytes)."""
    from .weights import resident_bytes
    by_kind = resident_bytes(params)
    return next(iter(by_kind), "none"), sum(by_kind.values())


def ratio(a, b):
    """a / b as "1.23x", or "n/a" when either rate is missing."""
    return f"{a / b:.2f}x" if a and b else "n/a"


def parse_args(argv=None):
    """engine.bench's options, checked before anything loads: a bad one prints one line
    ``error: ...`` and exits with status 2."""
    p = Parser("engine.bench", "Benchmark decode (or, with --prefill, prompt processing) tokens/s "
                               "beside peers measured in the same run; prints a llama-bench-style table.")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("-m", "--model", help="GGUF file, Hugging Face directory or cached repo id (default: "
                                         f"SmolLM2-135M-Instruct); with --backend cuda also a shape: {', '.join(SHAPES)}")
    p.add_argument("--random-weights", action="store_true", help="real shapes, random values (cuda)")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32", *QUANT_DTYPES],
                   help="weights: native keeps a GGUF's q4_0/q4_1/q8_0 tensors quantized (default for a GGUF), "
                        "f16/f32 dequantize (default f16 for random weights on cuda), q4_0/q4_1/q8_0 quantize "
                        "every weight matrix (random weights on cuda; a file: as --quant)")
    p.add_argument("--quant", default=None, choices=list(QUANT_DTYPES),
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("-c", "--context", type=int, default=512, help="KV-cache positions (cuda, default 512)")
    p.add_argument("--position", type=int, default=None,
                   help="decode from this cache position (cuda; default: right after the 32-token prompt)")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="KV-cache element type (default f16)")
    p.add_argument("--no-peer", action="store_true", help="skip the torch.compile peer (cuda)")
    p.add_argument("--no-graphs", action="store_true", help="launch kernels one by one (cuda A/B)")
    p.add_argument("--capacity-check", action="store_true", help="cache 512 vs 32768 at context 64 (cuda)")
    p.add_argument("--profile", nargs="?", const=".", metavar="DIR",
                   help="then profile --tokens decode steps: every kernel timed, gaps, regimes, the batch-1 "
                        "ceiling on stderr; profile.json and roofline.png in DIR (default: the current directory)")
    p.add_argument("--marginal", action="store_true",
                   help="then each kernel's cost inside the step (its graph, unless --no-graphs): the step "
                        "with that kernel launched twice, A/B/A against the step as it is (cuda; "
                        "engine.profile.marginal_costs)")
    p.add_argument("--phases", action="store_true",
                   help="decode through the persistent kernel with its stamps (VEGAFUSE_PERSISTENT=1, "
                        "VEGAFUSE_PERSISTENT_TRACE=1), then print where its last step's time went, phase by "
                        "phase (cuda; engine.profile.phase_times)")
    p.add_argument("-n", "--tokens", type=int, default=None,
                   help="tokens to decode and time after the prefill's (default 64 cpu, 128 cuda)")
    p.add_argument("--reference-tokens", type=int, default=8, help="tokens for the slow interpreter (default 8)")
    p.add_argument("-p", "--prompt", default="The capital of France is")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    p.add_argument("--ab", metavar="SWITCH",
                   help="A/B/A of one switch: a fusion rule (B: off) or VEGAFUSE_NAME=VALUE (B: set), each side a "
                        "fresh process timing --repeat decodes")
    p.add_argument("--cooldown", type=float, default=0.0, metavar="S", help="pause between the A/B/A runs (s)")
    p.add_argument("--decode-rates", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", action="store_true",
                   help="time engine.generate's streaming, greedy and sampled, against the device loop (cuda)")
    p.add_argument("--prefill", type=int, metavar="N", help="time the prefill of an N-token prompt instead of decode")
    p.add_argument("--repeat", type=int, default=5, help="prefill runs to take the median of, or with --ab the decodes on each side (default 5)")
    args = p.parse_args(argv)
    args.tokens = args.tokens if args.tokens is not None else (128 if args.backend == "cuda" else 64)
    if args.tokens < 1 or args.reference_tokens < 1:
        p.error("--tokens and --reference-tokens take at least 1 token")
    if args.repeat < 1 or args.context < 1:
        p.error("--repeat and --context take at least 1")
    if args.position is not None and args.backend != "cuda" and args.prefill is None:
        p.error("--position is measured with --backend cuda (the CPU decodes right after the prompt)")
    if args.position is not None and args.prefill is None and not 32 <= args.position <= args.context - args.tokens:
        p.error(f"--position {args.position} must lie in [32, context - tokens = {args.context - args.tokens}]; "
                "raise --context")
    if args.backend != "cuda" and (args.random_weights or args.model in SHAPES):
        p.error(f"{'--random-weights' if args.random_weights else args.model} (random weights of a model's "
                "shape) is measured with --backend cuda; on the cpu give --model a GGUF file, a Hugging Face "
                "directory or a cached repo id")
    if args.dtype in QUANT_DTYPES:                 # --dtype q4_0: every weight matrix q4_0, as --quant q4_0
        if args.quant not in (None, args.dtype):
            p.error(f"--dtype {args.dtype} and --quant {args.quant} disagree: give one of them")
        args.quant = args.dtype
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.ab and (args.stream or args.prefill is not None or args.profile or args.capacity_check):
        p.error("--ab times greedy decode: leave out --stream, --prefill, --profile and --capacity-check")
    if args.cooldown < 0:
        p.error(f"--cooldown takes seconds >= 0, got {args.cooldown}")
    if args.stream and (args.backend != "cuda" or args.random_weights or args.model in SHAPES or args.prefill):
        p.error("--stream times a real model's text with --backend cuda: give a model file or leave --model "
                "out for the default SmolLM2 (no --random-weights, shape or --prefill)")
    if args.marginal and (args.backend != "cuda" or args.prefill is not None or args.stream or args.capacity_check
                          or args.ab):
        p.error("--marginal times the decode step's graph: give --backend cuda, and leave out --prefill, "
                "--stream, --capacity-check and --ab")
    if args.phases and (args.backend != "cuda" or args.prefill is not None or args.stream or args.capacity_check
                        or args.ab):
        p.error("--phases traces the persistent decode kernel: give --backend cuda, and leave out --prefill, "
                "--stream, --capacity-check and --ab")
    if args.profile is not None and (args.prefill is not None or args.stream or args.capacity_check):
        p.error("--profile profiles the decode benchmark: leave out --prefill, --stream and --capacity-check")
    if args.prefill is not None and args.prefill < 1:
        p.error("--prefill takes a prompt length of at least 1 token")
    args.gpu_only = next((o for o, on in (("--phases", args.phases), ("--marginal", args.marginal)) if on), "")
    return args


def main(argv=None):
    """``python -m engine.bench``: see the module docstring; returns the exit status."""
    return run_cli(run, parse_args(argv))


def run(args):
    """Run the measurement ``args`` asks for (parsed by :func:`parse_args`); returns 0."""
    if args.model not in SHAPES and not args.random_weights and (args.backend == "cpu" or args.model or args.stream):
        from .models import resolve_model
        args.model = resolve_model(args.model)          # checked before loading: a FIFO would block
    if args.prefill is not None:
        if args.backend == "cuda" and args.dtype in (None, "native"):
            args.dtype = "f16"
        return main_prefill(args)
    if args.stream:
        return main_stream(args)
    if args.backend == "cuda":
        random = args.random_weights or (args.model or "smollm2-135m") in SHAPES
        if random and args.dtype == "native":
            raise ModelError("random weights are f16, f32, q4_0, q4_1 or q8_0: pick one with --dtype")
        if random and args.quant:
            args.dtype = args.quant
        elif not args.dtype:                            # a file: as engine.generate loads it
            from .weights import default_dtype
            args.dtype = "f16" if random else default_dtype(args.model, "cuda")
    if args.ab or args.decode_rates:
        from .ab import decode_rates, main_ab
        return decode_rates(args) if args.decode_rates else main_ab(args, args.argv)
    return main_gpu(args) if args.backend == "cuda" else main_cpu(args)


def main_cpu(args):
    """CPU decode: vegafuse with the chosen weights and with f16 (f32) weights, the reference
    interpreter and Hugging Face eager, greedy, each timed over ``--tokens`` decode steps."""
    from .weights import default_dtype, format_resident, load_model
    path = args.model
    dtype = args.dtype or default_dtype(path, "cpu")
    cfg, params, tok = load_model(path, "native" if dtype in QUANT_DTYPES else dtype, args.quant)
    ids = tok.encode(args.prompt)
    if not ids:
        raise ModelError("--prompt encodes to no tokens: give some text")
    threads = os.cpu_count() or 1
    name = cfg.name or os.path.basename(path)
    print(f"model {name}: {cfg.n_layers} layers, dim {cfg.dim}; prompt {len(ids)} tokens; {threads} CPU threads; "
          f"{format_resident(params)}; {args.kv_dtype} KV cache; greedy", flush=True)
    table, tg = Table(), f"tg{args.tokens}"
    kind, nbytes = weights_of(params)
    from .profile import positions_needed
    kept, context = [], positions_needed(args.tokens) if args.profile is not None else None
    tps, ours = bench_vegafuse(cfg, params, ids, args.tokens, "cpu", args.kv_dtype, context, kept)
    table.row(f"{name} {kind}", size_text(nbytes), "vegafuse cpu", tg, tps)
    other = "f32" if kind == "f16" else "f16"          # the A/B comparison in the same run
    _, params2, _ = load_model(path, other)
    tps2, ours2 = bench_vegafuse(cfg, params2, ids, args.tokens, "cpu", args.kv_dtype)
    table.row(f"{name} {other}", size_text(weights_of(params2)[1]), "vegafuse cpu", tg, tps2)
    del params2
    tps_ref, ref = bench_vegafuse(cfg, params, ids, args.reference_tokens, "reference", args.kv_dtype)
    table.row(f"{name} {kind}", size_text(nbytes), "vegafuse reference (numpy)", f"tg{args.reference_tokens}", tps_ref)
    tps_hf = hf = None
    if not args.no_hf:
        tps_hf, hf = bench_hf(path, ids, args.tokens, threads)
        if hf is not None:
            n_params = sum(int(np.prod(a.shape)) for a in _leaves(params))
            table.row(f"{name} f32", size_text(4 * n_params), "Hugging Face eager cpu", tg, tps_hf)
    print(f"ids agree with the {kind} run: {other} {ours2 == ours}, reference {ref == ours[:len(ref)]}"
          f"{f', Hugging Face {hf == ours}' if hf is not None else ''}")
    print(f"{kind} weights against {other} weights, same run: {ratio(tps, tps2)}")
    if hf is not None:
        print(f"speed-up over Hugging Face eager: {ratio(tps, tps_hf)} ({kind} weights), {ratio(tps2, tps_hf)} "
              f"({other} weights)")
    else:
        print("no external peer measured (--no-hf, or torch and transformers not importable)")
    if args.profile is not None:
        sys.stdout.flush()
        profile(args, kept[0], f"{name} {kind}")
    return 0


def _leaves(params):
    from dsl.pytree import flatten
    return flatten(params)[0]


if __name__ == "__main__":
    sys.exit(main())

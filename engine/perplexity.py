"""Teacher-forced evaluation: perplexity and top-1 agreement over a fixed text.

    res = evaluate(model, ids)                          # engine.model.Model, token ids
    res["perplexity"], res["nll"], res["argmax"]
    evaluate(other, ids, reference_logits=res["argmax"])["agreement"]

The model sees the given ids, never its own predictions: the first id is
prefilled, then each next id is decoded, and the logits after id ``i`` are
scored against id ``i + 1``.  ``python -m engine.perplexity FILE`` prints the
perplexity of a text file and the tokens/s of the teacher-forced run; bad input
prints one line ``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from .errors import ModelError, Parser, run_cli


def positions_needed(n_ids: int) -> int:
    """KV-cache positions (``Model(..., context=)``) that ``evaluate`` needs for ``n_ids`` ids."""
    return max(2, n_ids - 1)


def nll_of(logits, target: int) -> float:
    """Negative log-likelihood of ``target`` under ``logits`` (any float [V]): the float64
    log-softmax of the logits, negated, at ``target``."""
    z = np.asarray(logits, np.float64)
    m = z.max()
    return float(m + np.log(np.exp(z - m).sum()) - z[target])


def top1_agreement(a, b) -> float:
    """Fraction of positions where two argmax id sequences (equal length, >= 1) agree.

    Raises ValueError when the lengths differ or are zero."""
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"top-1 agreement needs two argmax sequences of the same nonzero length, "
                         f"got {len(a)} and {len(b)}; evaluate both runs on the same ids")
    return float(np.mean(a == b))


def evaluate(model, ids, reference_logits=None) -> dict:
    """Teacher-forced pass of ``model`` (an ``engine.model.Model``) over ``ids``.

    Prefills ``ids[0]``, then decodes ``ids[1:-1]`` one at a time; the f32 logits [V] after
    ``ids[i]`` predict ``ids[i + 1]``.  The model's context must hold
    ``positions_needed(len(ids))`` positions.  Compile first (``model.compile(1)``) to keep
    compilation out of ``tokens_per_s``.

    Args:
        model: an ``engine.model.Model`` (anything with ``prefill(ids)``, ``decode(id)`` and
            ``context``); its cache is overwritten from position 0.
        ids: ``n >= 2`` token ids (ints in ``[0, V)``).
        reference_logits: optional, another run over the same ids: its argmax ids ``[n - 1]``
            (e.g. its ``result["argmax"]``) or its logits ``[n - 1, V]``.

    Returns:
        dict with ``nll`` (float64 [n - 1], per predicted token), ``mean_nll`` (float),
        ``perplexity`` (``exp(mean_nll)``), ``argmax`` (int64 [n - 1], the top-1 id at each
        position), ``n_predicted`` (n - 1), ``seconds`` and ``tokens_per_s`` (of the whole
        pass, one forward per predicted token), and ``agreement`` (the fraction of positions
        whose argmax equals the reference's; None without ``reference_logits``).

    Raises:
        ModelError: fewer than 2 ids, an id outside the vocabulary, a context too small.
        ValueError: ``reference_logits`` of the wrong length.
    """
    ids = [int(i) for i in ids]
    n = len(ids)
    if n < 2:
        raise ModelError(f"perplexity needs at least 2 tokens, got {n}; give a longer text")
    if n - 1 > model.context:
        raise ModelError(f"{n} tokens need a context of {positions_needed(n)} positions but the model "
                         f"holds {model.context}; raise the context or evaluate fewer tokens")
    nll = np.empty(n - 1, np.float64)
    top = np.empty(n - 1, np.int64)
    t0 = time.perf_counter()
    for i in range(n - 1):
        logits = np.asarray(model.prefill(ids[:1]) if i == 0 else model.decode(ids[i]))
        if not 0 <= ids[i + 1] < logits.shape[-1]:
            raise ModelError(f"token id {ids[i + 1]} at position {i + 1} is outside the vocabulary "
                             f"of {logits.shape[-1]}; encode the text with the model's tokenizer")
        nll[i] = nll_of(logits, ids[i + 1])
        top[i] = int(np.argmax(logits))
    seconds = time.perf_counter() - t0
    mean = float(nll.mean())
    agreement = None
    if reference_logits is not None:
        ref = np.asarray(reference_logits)
        agreement = top1_agreement(top, ref.argmax(-1) if ref.ndim == 2 else ref)
    return {"nll": nll, "mean_nll": mean, "perplexity": float(np.exp(mean)), "argmax": top,
            "n_predicted": n - 1, "seconds": seconds,
            "tokens_per_s": (n - 1) / seconds if seconds > 0 else 0.0, "agreement": agreement}


def parse_args(argv=None):
    """The options of ``engine.perplexity`` (argparse.Namespace), as ``engine.generate`` names them; a
    bad option prints one line ``error: ...`` and exits with status 2."""
    p = Parser("engine.perplexity", __doc__.split("\n")[0])
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("-m", "--model", help="a GGUF file, a Hugging Face directory, or the id of a Hugging Face repo "
                                         "in the local cache (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="where kernels run (default cpu)")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32"],
                   help="weights in memory: native keeps a GGUF's q4_0/q4_1/q8_0 tensors quantized, f16/f32 "
                        "dequantize (default native for a GGUF or a GPTQ directory, else f16, as engine.generate)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_1", "q8_0"],
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("--tokens", type=int, default=None, help="evaluate the first N tokens (default: all)")
    return p.parse_args(argv)


def main(argv=None):
    return run_cli(run, parse_args(argv))


def read_text(path: str) -> str:
    """The text of a UTF-8 file; ModelError (one line) when it is missing or not UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}; give a readable text file") from None
    except UnicodeError:
        raise ModelError(f"{path} is not valid UTF-8 text; re-encode it as UTF-8") from None


def run(args):
    from .model import Model
    from .models import resolve_model
    from .weights import default_dtype, format_resident, load_model
    if args.tokens is not None and args.tokens < 2:
        raise ModelError(f"--tokens must be at least 2, got {args.tokens}")
    text = read_text(args.file)
    path = resolve_model(args.model)
    dtype = args.dtype or default_dtype(path, args.backend)
    cfg, params, tok = load_model(path, dtype, quant=args.quant)
    ids = tok.encode(text)[:args.tokens]
    if len(ids) < 2:
        raise ModelError(f"{args.file} encodes to {len(ids)} token(s); perplexity needs at least 2")
    if positions_needed(len(ids)) > cfg.max_seq_len:
        raise ModelError(f"{len(ids)} tokens exceed the {cfg.max_seq_len} positions the model was trained "
                         f"for; use --tokens {cfg.max_seq_len + 1} or less")
    model = Model(cfg, params, backend=args.backend, context=positions_needed(len(ids)))
    model.compile(1)
    res = evaluate(model, ids)
    print(f"perplexity {res['perplexity']:.4f} over {res['n_predicted']} predicted tokens "
          f"(mean NLL {res['mean_nll']:.5f}); {res['tokens_per_s']:.1f} tokens/s; "
          f"backend {args.backend}; {format_resident(params)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Next-token sampling over one logits row: repeat penalty, temperature, top-k, top-p (nucleus)
and min-p."""
from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           rng: np.random.Generator | None = None, min_p: float = 0.0, repeat_penalty: float = 1.0,
           recent=()) -> int:
    """Pick the next token id from ``logits``.

    The steps run in llama.cpp's order (its default sampler chain: penalties, top-k, top-p, min-p,
    temperature), except that top-k and top-p weigh the tempered distribution, as Hugging Face does.

    Args:
        logits: shape [V], float (float32 expected); -inf entries are never picked.
        temperature: 0 -> greedy argmax (first index of the max on ties);
            otherwise logits are divided by it before the softmax.
        top_k: keep the k most likely ids (<= 0: no limit; 1: argmax, ties included).
            Ties at the k-th place keep the lower ids.
        top_p: keep the smallest set of most likely ids whose probability sum
            reaches ``top_p`` (after top_k); 1.0 keeps everything.
        rng: a seeded ``np.random.Generator`` (required unless greedy).
        min_p: keep the ids whose probability is at least ``min_p`` times the most likely id's,
            weighed before the temperature as llama.cpp does: ``logit >= max logit + ln(min_p)``
            (llama.cpp ``src/llama-sampling.cpp``, ``llama_sampler_min_p_apply``; its README: "the
            minimum probability for a token to be considered, relative to the probability of the
            most likely token").  0 keeps everything; in [0, 1].
        repeat_penalty: each distinct id of ``recent`` has its logit divided by the penalty when
            positive and multiplied by it when <= 0 (llama.cpp's ``llama_sampler_penalties_apply``,
            the CTRL paper's penalty, arXiv:1909.05858, made to lower negative logits too); it
            applies to greedy decoding as well.  1.0: off; must be > 0.
        recent: the ids the penalty applies to (llama.cpp: the last ``--repeat-last-n`` = 64 ids
            of the prompt and the generated text); ints in [0, V).

    Returns:
        the chosen id as a Python int.

    Raises:
        ValueError: logits not 1-D, temperature < 0, top_p outside (0, 1], min_p outside [0, 1],
            repeat_penalty not > 0, an id of ``recent`` outside [0, V), or rng missing when sampling.
    """
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must have shape [V] with V > 0, got {logits.shape}")
    if not temperature >= 0 or not 0 < top_p <= 1:             # also rejects nan
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if not 0 <= min_p <= 1 or not 0 < repeat_penalty < np.inf:
        raise ValueError(f"need 0 <= min_p <= 1 and repeat_penalty > 0, got {min_p}, {repeat_penalty}")
    logits = np.where(np.isnan(logits), -np.inf, logits.astype(np.float64))   # NaN never wins
    if repeat_penalty != 1 and len(recent):
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        if ids[0] < 0 or ids[-1] >= logits.size:
            raise ValueError(f"recent ids must lie in [0, {logits.size}), got {ids[0]} .. {ids[-1]}")
        x = logits[ids]
        logits[ids] = np.where(x <= 0, x * repeat_penalty, x / repeat_penalty)
    dropped = np.zeros(logits.size, bool)        # min-p's cut, applied after top-p (llama.cpp's order)
    if min_p > 0 and np.isfinite(logits.max()):
        with np.errstate(divide="ignore"):
            dropped = logits < logits.max() + np.log(min_p)
    if temperature == 0 or top_k == 1 or not np.isfinite(logits).any() or np.isposinf(logits).any():
        return int(np.argmax(logits))          # greedy; also when no finite logit is left to weigh
    if rng is None:
        raise ValueError("sampling with temperature > 0 needs an np.random.Generator")
    with np.errstate(over="ignore", invalid="ignore"):
        z = (logits - logits.max()) / temperature                # <= 0, so no overflow to inf - inf
    if top_k > 0 or top_p < 1:
        order = np.arange(len(z))
        if 0 < top_k < len(z):                         # the k best ids, ties -> lower ids
            kth = np.partition(z, -top_k)[-top_k]
            tied = np.flatnonzero(z == kth)[: top_k - int(np.count_nonzero(z > kth))]
            order = np.sort(np.concatenate([np.flatnonzero(z > kth), tied]))
        order = order[np.argsort(-z[order], kind="stable")]   # most likely first, ties by id
        z = z[order]
    else:
        order = None
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1   # first prefix with sum >= top_p
        p = p[:keep]
    p = np.where(dropped[order[:len(p)]] if order is not None else dropped, 0.0, p)
    cdf = np.cumsum(p)
    i = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(p) - 1)
    return int(i if order is None else order[i])


def settings_error(temperature: float, top_p: float, min_p: float, repeat_penalty: float) -> str | None:
    """The command line's sampling options checked: one line naming the first bad option and the
    range it takes, or None.  NaN fails every check."""
    if not 0 <= temperature < float("inf"):
        return f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
    if not 0 < top_p <= 1:
        return f"--top-p must lie in (0, 1] (1.0 keeps every id), got {top_p}"
    if not 0 <= min_p <= 1:
        return f"--min-p must lie in [0, 1], got {min_p}"
    if not 0 < repeat_penalty < float("inf"):
        return f"--repeat-penalty must be a finite number > 0 (1.0 is off), got {repeat_penalty}"
    return None


def is_eos(token_id: int, eos_ids) -> bool:
    """True if ``token_id`` is one of ``eos_ids`` (an iterable of ints, e.g. LlamaConfig.eos_ids)."""
    return int(token_id) in tuple(eos_ids)
